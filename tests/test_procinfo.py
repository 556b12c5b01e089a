"""Which host processes count as a service loading: real processes, real /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.adapters.procinfo import (
    _is_gpuctl_client,
    descendants,
    find_matching,
    is_alive,
    own_lineage,
    parse_container_id,
)
from tests.ensure_helpers import unique_name


@pytest.mark.parametrize(
    ("argv", "client"),
    [
        (["/usr/bin/python3", "/venv/bin/gpuctl", "ensure", "vllm"], True),
        # --config before the command (its value is not the command): a client too
        (["gpuctl", "--config", "x", "status"], True),
        (["/venv/bin/gpuctl", "-c", "/etc/gpuctl.toml", "ensure", "vllm"], True),
        (["gpuctl", "--config=x.toml", "ensure", "vllm"], True),
        (["gpuctl", "--config", "x", "sim", "model-server", "--name", "vllm"], False),
        (["gpuctl", "--config", "ensure"], False),  # a config named 'ensure', no command
        (["python", "-m", "gpuctl", "stop", "vllm"], True),
        (["python", "-m", "gpuctl", "sim", "model-server", "--name", "vllm"], False),
        (["sh", "-c", "gpuctl ensure vllm --json | grep ready"], True),
        (["/bin/bash", "-c", "cd /x && /venv/bin/gpuctl ensure vllm; sleep 30"], True),
        (["sh", "-c", "vllm serve Qwen --port 8000"], False),
        (["sh", "-c", "echo 'unbalanced"], False),
        (["vllm", "serve", "Qwen"], False),
    ],
)
def test_gpuctl_clients_are_not_servers(argv: list[str], client: bool) -> None:
    assert _is_gpuctl_client(argv) is client


@pytest.fixture
def named() -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    name = unique_name("proc")
    procs: list[subprocess.Popen[bytes]] = []
    yield name, procs
    for p in procs:
        p.kill()
        p.wait()


def test_find_matching_sees_a_server_but_not_a_wrapped_client(
    named: tuple[str, list[subprocess.Popen[bytes]]],
) -> None:
    name, procs = named
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"--model={name}"]
    )
    wrapper = subprocess.Popen(["sh", "-c", f"sleep 60; gpuctl ensure {name}"])
    procs += [server, wrapper]
    found = {s.pid: s for s in find_matching([name.upper()])}
    assert server.pid in found and wrapper.pid not in found
    assert found[server.pid].age_s is not None and 0 <= found[server.pid].age_s < 60


def test_find_matching_leaves_out_readers_of_gpuctls_own_files(
    named: tuple[str, list[subprocess.Popen[bytes]]], tmp_path: Path
) -> None:
    """`tail -f <state>/logs/NAME.log` reads the service's log: it is not the service, even
    for an explicit keyword; a server whose other files sit beside the state dir is."""
    name, procs = named
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    log = state / "logs" / f"{name}.log"
    log.touch()
    reader = subprocess.Popen(["tail", "-f", str(log)])
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", name, str(tmp_path / "sim")]
    )
    procs += [reader, server]
    found = {s.pid for s in find_matching([name], state_dir=str(state) + "/")}
    assert server.pid in found and reader.pid not in found
    # Without a state dir to know it by, it is a match like any other.
    assert reader.pid in {s.pid for s in find_matching([name])}


def test_own_lineage_is_this_process_and_its_parents() -> None:
    lineage = own_lineage()
    assert lineage[0] == os.getpid() and lineage[1] == os.getppid()
    assert lineage[-1] == 1 or len(lineage) >= 2


def test_zombie_is_dead() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    # Not reaped yet: a zombie, which kill(pid, 0) still finds.
    import time

    deadline = time.monotonic() + 10
    while is_alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(p.pid, 0)
    assert is_alive(p.pid) is False
    p.wait()


def test_container_id_from_cgroup() -> None:
    cid = "3f2a" + "0" * 60
    assert parse_container_id(f"0::/system.slice/docker-{cid}.scope\n") == cid
    assert parse_container_id(f"12:memory:/docker/{cid}\n") == cid
    assert parse_container_id("0::/user.slice/user-0.slice/session-1.scope\n") is None


def test_pipeline_neighbours_are_recognised() -> None:
    from gpuctl.adapters.pipeline import on_pipes

    r, w = os.pipe()
    try:
        inode = os.readlink(f"/proc/self/fd/{w}")[len("pipe:[") : -1]
        reader = subprocess.Popen(["sleep", "30"], stdin=r)
        loner = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL)
        try:
            assert on_pipes(reader.pid, [inode])
            assert not on_pipes(loner.pid, [inode])
            assert not on_pipes(reader.pid, [])
        finally:
            for p in (reader, loner):
                p.kill()
                p.wait()
    finally:
        os.close(r)
        os.close(w)


PIPELINE_PROBE = (
    "import json; from pathlib import Path; from gpuctl.adapters.pipeline import own_pipeline; "
    "print(json.dumps(sorted(Path(f'/proc/{p}/comm').read_text().strip() "
    "for p in own_pipeline())))"
)


def _pipeline_of_probe(script: str) -> list[str]:
    probe = f'{sys.executable} -c "{PIPELINE_PROBE}"'
    r = subprocess.run(
        ["sh", "-c", script.replace("PROBE", probe)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    import json

    return list(json.loads(r.stdout.strip().splitlines()[-1]))


def test_own_pipeline_follows_the_data_transitively() -> None:
    """`gpuctl … | cat | tee X.log`: both, two pipes away; and what feeds our stdin."""
    assert _pipeline_of_probe("PROBE | cat | tee /dev/null") == ["cat", "tee"]
    assert _pipeline_of_probe("sleep 3 | PROBE | cat") == ["cat", "sleep"]


def test_own_pipeline_leaves_out_a_background_job_on_the_same_pipe() -> None:
    """`script | tee log`, the script running `server &` then gpuctl: the server writes
    into the pipe we write into, but it is not joined to us by a pipe."""
    got = _pipeline_of_probe("{ sleep 5 & PROBE; kill $!; } | cat")
    assert got == ["cat"]


def test_own_pipeline_without_pipes_is_empty(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    with open(out, "w") as f:
        subprocess.run(
            [sys.executable, "-c", PIPELINE_PROBE],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.DEVNULL,
            check=True,
        )
    assert out.read_text().strip() == "[]"


def test_descendants_are_the_processes_below_the_roots() -> None:
    """A wrapper shell's child and grandchild are below it; the roots themselves, their
    parents and unrelated processes are not."""
    tree = subprocess.Popen(
        ["sh", "-c", "sh -c 'sleep 60; exit 0' & sleep 60; exit 0"],
        start_new_session=True,
    )
    other = subprocess.Popen(["sleep", "60"])
    try:

        def below() -> dict[int, int]:
            return descendants([tree.pid])

        deadline = time.monotonic() + 10
        while len(below()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = below()
        assert len(got) == 3 and set(got.values()) == {tree.pid}, got  # sh, sleep, sleep
        assert tree.pid not in got and other.pid not in got and os.getpid() not in got
        assert descendants([]) == {}
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait()
        other.kill()
        other.wait()


def test_descendants_from_a_proc_folder(tmp_path: Path) -> None:
    """Read from /proc/<pid>/stat: a zombie child is dead, a command with ") " in its
    name is parsed from the last parenthesis."""
    for pid, ppid, state, comm in [
        (10, 1, "S", "server"),
        (11, 10, "S", "worker ) x"),
        (12, 11, "S", "grandchild"),
        (13, 10, "Z", "dead"),
        (20, 1, "S", "other"),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} {ppid} 0 0\n")
    (tmp_path / "self").mkdir()
    assert descendants([10], proc_root=str(tmp_path)) == {11: 10, 12: 10}
    assert descendants([20], proc_root=str(tmp_path)) == {}


def test_a_server_launched_for_another_simulated_host_is_not_this_ones(tmp_path: Path) -> None:
    """Two simulated hosts on one machine: a server the process launcher started for one
    (GPUCTL_SIM_HOST beside its GPUCTL_SIM_DIR) counts for that host alone; a process
    naming another --sim-dir counts for none but that; any other process counts, as on
    a real host."""
    from gpuctl.adapters.procinfo import on_sim_dir

    def environ(pid: int, **env: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "environ").write_bytes(
            b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0"
        )

    environ(1, GPUCTL_SIM_DIR="/a/sim", GPUCTL_SIM_HOST="127.0.0.1")
    environ(2, GPUCTL_SIM_DIR="/b/sim", GPUCTL_SIM_HOST="127.0.0.2")
    environ(3, GPUCTL_SIM_DIR="/elsewhere", PATH="/bin")
    argv = ["python", "-m", "gpuctl", "sim", "model-server"]
    assert on_sim_dir(1, argv, "/a/sim/", proc_root=str(tmp_path))
    assert not on_sim_dir(2, argv, "/a/sim", proc_root=str(tmp_path))
    assert on_sim_dir(3, argv, "/a/sim", proc_root=str(tmp_path))
    assert not on_sim_dir(3, [*argv, "--sim-dir", "/b/sim"], "/a/sim", proc_root=str(tmp_path))
    assert on_sim_dir(2, [*argv, "--sim-dir=/a/sim"], "/a/sim", proc_root=str(tmp_path))
    assert on_sim_dir(4, argv, "/a/sim", proc_root=str(tmp_path))  # unreadable: as real
