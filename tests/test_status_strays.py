"""Processes that only mention a service, as a new user's machine has them: status does
not list them as starting, ensure shows no ETA bar for them, and Ctrl-C does not say
"keeps loading" when nothing of gpuctl's loads."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import gpuctl_in_process, tagged


@pytest.fixture
def name() -> str:
    return tagged("vllm")


@pytest.fixture
def strays(tmp_path: Path, name: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`python myvllmtools/bench.py` and `less notes-about-vllm.txt`: the service's name
    is in their command lines, never as a whole word."""
    tools = tmp_path / f"my{name}tools"
    tools.mkdir()
    (tools / "bench.py").write_text("import time\ntime.sleep(120)\n")
    notes = tmp_path / f"notes-about-{name}.txt"
    notes.write_text("notes\n")
    procs = [
        subprocess.Popen([sys.executable, str(tools / "bench.py")]),
        subprocess.Popen(["tail", "-f", str(notes)], stdout=subprocess.DEVNULL),
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def config(tmp_path: Path, name: str) -> Path:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[hosts.gpu]\nprobe = "sim"\n\n'
        f'[services."{name}"]\nlauncher = "process"\ncommand = "sleep 600"\n'
        'health = "http://127.0.0.1:1/health"\nmemory = "10GiB"\n'
    )
    return cfg


def env(tmp_path: Path) -> dict[str, str]:
    return {
        "GPUCTL_STATE_DIR": str(tmp_path / "s"),
        "GPUCTL_SIM_DIR": str(tmp_path / "sim"),
        "COLUMNS": "200",
        "NO_COLOR": "1",
    }


def test_status_lists_only_what_the_decision_counts_as_starting(
    tmp_path: Path, name: str, strays: list[subprocess.Popen[bytes]]
) -> None:
    cfg = config(tmp_path, name)
    r = gpuctl_in_process(cfg, "status", env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "IDLE" in r.stdout, r.stdout
    for p in strays:
        assert str(p.pid) not in r.stdout, r.stdout
    assert "starting" not in r.stdout, r.stdout
    js = gpuctl_in_process(cfg, "status", "--json", env=env(tmp_path))
    assert all(str(p.pid) not in js.stdout for p in strays), js.stdout


def test_ctrl_c_on_a_stray_that_names_the_service_does_not_say_it_keeps_loading(
    tmp_path: Path, name: str
) -> None:
    """A young process with the service's name as a word counts as it loading: ensure
    waits on it, but nothing of gpuctl's loads, so Ctrl-C must not say it keeps loading."""
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", name])
    try:
        cfg = config(tmp_path, name)
        e = gpuctl_in_process(cfg, "status", env=env(tmp_path))
        assert "LOADING" in e.stdout, e.stdout
        proc = subprocess.Popen(
            [*gpuctl_argv(), "ensure", name, "--timeout", "60s"],
            env=full_env(cfg, tmp_path),
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the notice: waiting for a keyword match
        assert "waiting for" in line, line
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
        said = line + rest
        assert proc.returncode == 130, said
        assert "keeps loading" not in said, said
        assert f"gpuctl: stopped waiting; nothing gpuctl started is loading {name}" in said, said
    finally:
        stray.kill()
        stray.wait()


def gpuctl_argv() -> list[str]:
    from tests.conftest import gpuctl_exe

    return [gpuctl_exe()]


def full_env(cfg: Path, tmp_path: Path) -> dict[str, str]:
    from tests.conftest import config_env

    return {**config_env(cfg), **env(tmp_path)}


def test_a_stray_that_names_the_service_gets_no_eta(
    tmp_path: Path, name: str, cli_env: Path
) -> None:
    """After a real start (so the record has a start time to expect), a process that only
    names the service is waited on without the ETA bar: it may be no server at all."""
    from gpuctl.config import load_config
    from gpuctl.flows.deps import EnsureRequest
    from gpuctl.flows.ensure.rounds import ensure
    from gpuctl.flows.ports import Tell
    from gpuctl.flows.results import Progress
    from gpuctl.sim.host import free_port
    from gpuctl.wiring.build import deps_for
    from tests.ensure_helpers import model_server_command, service_toml

    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[hosts.gpu]\nprobe = "sim"\n\n'
        + service_toml(name, port, model_server_command(name, port, load_time="1s"))
    )
    conf = load_config(cfg)
    deps = deps_for(conf, name)
    try:
        assert ensure(deps, EnsureRequest(timeout_s=60)).outcome.value == "ready"
    finally:
        deps.close()
    deps = deps_for(conf, name)
    try:
        from gpuctl.flows import service_ops

        service_ops.stop(deps)
    finally:
        deps.close()
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", name])
    ticks: list[Progress] = []
    deps = deps_for(conf, name, tell=Tell(progress=ticks.append))
    try:
        r = ensure(deps, EnsureRequest(timeout_s=3))
    finally:
        deps.close()
        stray.kill()
        stray.wait()
    assert r.outcome.value == "timeout", r
    assert ticks, r
    assert all(not t.ours and t.expected_s is None for t in ticks), ticks[:3]


def test_two_sim_processes_are_told_apart_at_80_columns(tmp_path: Path) -> None:
    """Cut to the same "python -m gpuctl sim hold --name team-…", two holds looked one."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[hosts.gpu]\nprobe = "sim"\n')
    e = env(tmp_path)
    names = (tagged("team-notebook-alpha"), tagged("team-notebook-beta"))
    holds = [
        subprocess.Popen(
            [*gpuctl_argv(), "sim", "hold", "--name", n, "--memory", "10GiB"],
            env=full_env(cfg, tmp_path),
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in names
    ]
    try:
        for h in holds:
            assert h.stdout is not None and "holding" in h.stdout.readline()
        r = gpuctl_in_process(cfg, "status", env={**e, "COLUMNS": "80"})
        rows = {
            ln.strip("│ ").split()[0]: ln
            for ln in r.stdout.splitlines()
            if any(ln.strip("│ ").startswith(f"{h.pid} ") for h in holds)
        }
        assert len(rows) == 2, r.stdout
        a, b = (rows[str(h.pid)] for h in holds)
        assert all(len(ln) <= 80 for ln in r.stdout.splitlines()), r.stdout
        assert a.split("GiB", 1)[1] != b.split("GiB", 1)[1], r.stdout
        assert "alpha" in a and "beta" in b, r.stdout
    finally:
        for h in holds:
            h.terminate()
            h.communicate()
