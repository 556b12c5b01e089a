"""The Jupyter launcher against a real ``jupyter server`` with terminals, on loopback.

The servers it launches are real processes: the simulated GPU's fake vLLM
(``gpuctl sim model-server``) or small Python commands. Every test kills what it
started, whatever happens.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from websockets.sync.client import connect

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.jupyter import (
    SCRIPT_DIR,
    JupyterLauncher,
    exec_line,
    launch_script,
    terminal_name,
)
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed, Unproven
from gpuctl.sim.host import free_port
from tests.jupyter_helpers import JupyterServer, jupyter_server
from tests.pid_helpers import OwnPids

pytestmark = pytest.mark.jupyter

PY = sys.executable


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    with jupyter_server(tmp_path_factory.mktemp("jupyter") / "root") as server:
        yield server


@pytest.fixture
def launcher(jupyter: JupyterServer) -> JupyterLauncher:
    return JupyterLauncher(jupyter.url, jupyter.token, host_name="lab", timeout_s=20)


@pytest.fixture
def pids() -> Iterator[OwnPids]:
    """Pids of launched servers: SIGKILLed (with their process group) at the end, each
    only while it is still that server (``tests.pid_helpers``)."""
    started = OwnPids()
    yield started
    started.kill_all(group=True)


def service(name: str, command: str, **kw: object) -> ServiceConfig:
    return ServiceConfig(name=name, host="lab", launcher="jupyter", command=command, **kw)  # type: ignore[arg-type]


def fake_vllm(name: str, port: int, sim_dir: Path, **kw: object) -> ServiceConfig:
    return service(
        name,
        f"{PY} -m gpuctl sim model-server --name {name} --memory 10GiB --load-time 2s "
        f"--port {port}",
        env={"GPUCTL_SIM_DIR": str(sim_dir)},
        **kw,
    )


def sleeper(name: str, **kw: object) -> ServiceConfig:
    return service(name, f"{PY} -c 'import time; time.sleep(600)'", **kw)


def dead(pid: int) -> bool:
    """Gone or a zombie (PID 1 here may not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def terminals(js: JupyterServer) -> list[str]:
    r = httpx.get(f"{js.url}/api/terminals", headers={"Authorization": f"token {js.token}"})
    r.raise_for_status()
    return [t["name"] for t in r.json()]


def type_in(js: JupyterServer, name: str, line: str, timeout_s: float = 20) -> str:
    """Type ``line`` into terminal ``name``; return what ``echo MARK=...`` printed after it."""
    nonce = secrets.token_hex(4)
    url = js.url.replace("http", "ws", 1) + f"/terminals/websocket/{name}"
    with connect(url, additional_headers={"Authorization": f"token {js.token}"}) as ws:
        ws.send(json.dumps(["stdin", f"{line}; echo T{nonce}_$((0+1))=$R\r"]))
        buf, deadline = "", time.monotonic() + timeout_s
        while f"T{nonce}_1=" not in buf or not buf.split(f"T{nonce}_1=", 1)[1].count("\n"):
            kind, *rest = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if kind == "stdout":
                buf += rest[0]
    return buf.split(f"T{nonce}_1=", 1)[1].split("\r", 1)[0]


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("command", "line"),
    [
        ("vllm serve m --port 8000", "exec vllm serve m --port 8000"),
        ("sh -c 'echo a; exit 3'", "exec sh -c 'echo a; exit 3'"),
        ("srv --log x 2>&1 > out", "exec srv --log x 2>&1 > out"),
        ("CUDA_VISIBLE_DEVICES=0 vllm serve m", "exec env CUDA_VISIBLE_DEVICES=0 vllm serve m"),
        (
            "source venv/bin/activate && vllm serve m",
            "exec bash -c 'source venv/bin/activate && vllm serve m'",
        ),
        ("a; b", "exec bash -c 'a; b'"),
        ("a | tee log", "exec bash -c 'a | tee log'"),
        ("srv &", "exec bash -c 'srv &'"),
        ("cd /x", "exec bash -c 'cd /x'"),
        ("exec srv", "exec srv"),
        ("FOO=1", "exec bash -c FOO=1"),
        ("srv 'unbalanced", "exec bash -c 'srv '\"'\"'unbalanced'"),
        ("a\nb", "exec bash -c 'a\nb'"),
    ],
)
def test_exec_line(command: str, line: str) -> None:
    assert exec_line(command) == line


def test_terminal_name() -> None:
    assert terminal_name(service("vllm", "x")) == "gpuctl_vllm"
    assert terminal_name(service("chat-bot", "x")) == "gpuctl_chat_bot"
    assert terminal_name(service("vllm", "x", terminal="mine")) == "mine"


def test_launch_script_quotes_everything() -> None:
    script = launch_script(
        service("s", "srv", cwd="~/my dir", env={"A": "it's $HOME"}, log="~/logs/s.log")
    )
    assert "cd -- \"$HOME\"/'my dir'" in script
    assert "export A='it'\"'\"'s $HOME'" in script
    assert 'exec >>"$HOME"/logs/s.log 2>&1 </dev/null' in script
    assert script.rstrip().endswith("exec srv")
    with pytest.raises(StartFailed, match="not a shell variable"):
        launch_script(service("s", "srv", env={"BAD-NAME": "1"}))


# --------------------------------------------------------------------------- real Jupyter


def test_start_runs_the_server_itself_detached(
    launcher: JupyterLauncher, jupyter: JupyterServer, tmp_path: Path, pids: OwnPids
) -> None:
    port = free_port()
    svc = fake_vllm("vllm", port, tmp_path / "sim")
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)

    # The recorded pid is the model server, not a wrapper shell; its start time matches.
    proc = psutil.Process(handle.pid)
    assert "model-server" in " ".join(proc.cmdline())
    assert "bash" not in os.path.basename(proc.cmdline()[0])
    assert handle.pid_start is not None
    assert abs(handle.pid_start - proc.create_time()) < 2
    assert handle.kind == "jupyter"
    assert handle.terminal == "gpuctl_vllm"
    assert handle.log == str(jupyter.root / SCRIPT_DIR / "vllm.log")
    assert Handle.from_dict(handle.to_dict()) == handle

    # start() closed its websocket: the server runs on and loads.
    assert launcher.alive(handle) is True
    wait_until(lambda: healthy(port), 20, "/health 200")

    tail = launcher.log_tail(handle, 3)
    assert tail
    assert tail == "\n".join(Path(handle.log).read_text().splitlines()[-3:])
    # A launcher in a new process learns the root again.
    fresh = JupyterLauncher(jupyter.url, jupyter.token, timeout_s=20)
    assert fresh.log_tail(handle, 3) == tail

    launcher.stop(handle, grace_s=10)
    assert dead(handle.pid)
    assert launcher.alive(handle) is False
    assert not healthy(port)
    launcher.stop(handle, grace_s=10)  # idempotent


def test_the_terminal_is_found_again_not_recreated(
    launcher: JupyterLauncher, jupyter: JupyterServer, pids: OwnPids
) -> None:
    svc = sleeper("again")
    first = launcher.start(svc)
    assert first.pid is not None
    pids.append(first.pid)
    # A variable set in the shell survives only if the next start types into the same shell.
    assert type_in(jupyter, "gpuctl_again", "R=same-shell") == "same-shell"
    launcher.stop(first, grace_s=5)

    second = JupyterLauncher(jupyter.url, jupyter.token, timeout_s=20).start(svc)
    assert second.pid is not None
    pids.append(second.pid)
    assert second.pid != first.pid
    assert type_in(jupyter, "gpuctl_again", "true") == "same-shell"
    assert terminals(jupyter).count("gpuctl_again") == 1
    launcher.stop(second, grace_s=5)

    custom = launcher.start(sleeper("named", terminal="my_term"))
    assert custom.pid is not None
    pids.append(custom.pid)
    assert custom.terminal == "my_term"
    assert "my_term" in terminals(jupyter)
    launcher.stop(custom, grace_s=5)


@pytest.mark.slow
def test_the_server_outlives_its_terminal_and_jupyter(tmp_path: Path, pids: OwnPids) -> None:
    root, port = tmp_path / "root", free_port()
    svc = fake_vllm("survivor", port, tmp_path / "sim")
    with jupyter_server(root) as first:
        launcher = JupyterLauncher(first.url, first.token, timeout_s=20)
        handle = launcher.start(svc)
        assert handle.pid is not None
        pids.append(handle.pid)
        wait_until(lambda: healthy(port), 20, "/health 200")

        r = httpx.delete(
            f"{first.url}/api/terminals/{handle.terminal}",
            headers={"Authorization": f"token {first.token}"},
        )
        assert r.status_code == 204
        wait_until(lambda: handle.terminal not in terminals(first), 10, "the terminal to go")
        assert not dead(handle.pid)
        assert launcher.alive(handle) is True  # in a new terminal of the same name
        assert healthy(port)

        first.kill(signal.SIGKILL)
        assert launcher.alive(handle) is None  # Jupyter is gone: cannot tell
        assert not dead(handle.pid)
        assert healthy(port)

    with jupyter_server(root) as second:
        again = JupyterLauncher(second.url, second.token, timeout_s=20)
        assert again.alive(handle) is True
        assert healthy(port)
        assert again.log_tail(handle, 5) == "\n".join(
            Path(str(handle.log)).read_text().splitlines()[-5:]
        )
        again.stop(handle, grace_s=10)
        assert dead(handle.pid)
        assert again.alive(handle) is False


def test_a_command_that_exits_at_once(launcher: JupyterLauncher, pids: OwnPids) -> None:
    handle = launcher.start(service("boom", "sh -c 'echo boom; exit 3'"))
    assert handle.pid is not None
    pids.append(handle.pid)
    wait_until(lambda: launcher.alive(handle) is False, 10, "alive() to say False")
    assert "boom" in launcher.log_tail(handle)
    launcher.stop(handle, grace_s=1)  # nothing to stop: no error


def test_stop_kills_what_ignores_sigterm(launcher: JupyterLauncher, pids: OwnPids) -> None:
    svc = service(
        "stubborn",
        f"{PY} -c 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        'print("ready", flush=True); time.sleep(600)\'',
    )
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    wait_until(lambda: "ready" in launcher.log_tail(handle), 10, "the command to set its handler")
    t0 = time.monotonic()
    launcher.stop(handle, grace_s=1)
    assert time.monotonic() - t0 >= 1
    assert dead(handle.pid)
    assert launcher.alive(handle) is False


def test_stop_reaches_the_children_of_a_compound_command(
    launcher: JupyterLauncher, pids: OwnPids
) -> None:
    handle = launcher.start(
        service("compound", f"echo starting && {PY} -c 'import time; time.sleep(600)'")
    )
    assert handle.pid is not None
    pids.append(handle.pid)
    wrapper = psutil.Process(handle.pid)

    def the_server() -> list[int]:
        # bash may exec the list's last command in the wrapper's place (the wrapper is
        # then the server), or run it as the wrapper's child.
        if "time.sleep" in " ".join(wrapper.cmdline()):
            return [handle.pid]
        return [c.pid for c in wrapper.children() if "time.sleep" in " ".join(c.cmdline())]

    wait_until(lambda: bool(the_server()), 10, "the server of the compound command")
    group = the_server()
    pids.extend(group)
    launcher.stop(handle, grace_s=5)
    assert dead(handle.pid)
    assert all(dead(p) for p in group)


def test_a_reused_pid_is_not_ours(launcher: JupyterLauncher) -> None:
    """A pid whose start time differs is not ours (left alone, no error); one whose
    start time matches is signalled only when its environment carries the handle's
    start nonce: a record naming the right pid with another proof gets Unproven."""
    nonce = "a1" * 16
    env = {**os.environ, "GPUCTL_START_NONCE": nonce}
    proc = subprocess.Popen(
        [PY, "-c", "import time; time.sleep(600)"], start_new_session=True, env=env
    )
    try:
        stranger = Handle(
            kind="jupyter", pid=proc.pid, pid_start=1.0, terminal="gpuctl_reuse", proof=nonce
        )
        assert launcher.alive(stranger) is False
        launcher.stop(stranger, grace_s=1)
        assert proc.poll() is None  # not signalled

        started = psutil.Process(proc.pid).create_time()
        forged = Handle(
            kind="jupyter",
            pid=proc.pid,
            pid_start=started,
            terminal="gpuctl_reuse",
            proof="b2" * 16,
        )
        with pytest.raises(Unproven):
            launcher.stop(forged, grace_s=1)
        assert proc.poll() is None  # not signalled

        ours = Handle(
            kind="jupyter", pid=proc.pid, pid_start=started, terminal="gpuctl_reuse", proof=nonce
        )
        assert launcher.alive(ours) is True
        launcher.stop(ours, grace_s=5)
        assert proc.wait(5) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_cwd_env_and_long_values_go_through_the_script(
    launcher: JupyterLauncher, jupyter: JupyterServer, pids: OwnPids
) -> None:
    (jupyter.root / "work dir").mkdir(exist_ok=True)
    big = "x" * 3500
    odd = 'it\'s "quoted" $HOME `date` \\ ;'
    code = (
        "import os; print('CWD', os.getcwd()); print('BIG', len(os.environ['BIG'])); "
        "print('ODD', os.environ['ODD']); print('ARG', len(os.environ['ARG']))"
    )
    # The command line itself is long too: a 3000-character argument.
    svc = service(
        "long",
        f'{PY} -c "{code}" {"y" * 3000}',
        cwd="work dir",
        env={"BIG": big, "ODD": odd, "ARG": "z" * 1000},
    )
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    wait_until(lambda: launcher.alive(handle) is False, 10, "the command to finish")
    tail = launcher.log_tail(handle)
    assert f"CWD {jupyter.root / 'work dir'}" in tail
    assert "BIG 3500" in tail
    assert f"ODD {odd}" in tail
    assert "ARG 1000" in tail


def test_a_log_outside_root_is_tailed_in_the_terminal(
    launcher: JupyterLauncher, tmp_path: Path, pids: OwnPids
) -> None:
    log = tmp_path / "elsewhere" / "out.log"
    handle = launcher.start(
        service("outside", f"{PY} -c 'print(*range(30), sep=chr(10))'", log=str(log))
    )
    assert handle.pid is not None
    pids.append(handle.pid)
    assert handle.log == str(log)
    wait_until(lambda: launcher.alive(handle) is False, 10, "the command to finish")
    assert launcher.log_tail(handle, 3) == "27\n28\n29"
    assert launcher.log_tail(Handle(kind="jupyter", log=str(tmp_path / "none.log"))) == ""


def test_big_and_binary_logs(launcher: JupyterLauncher, pids: OwnPids) -> None:
    # Over 1 MiB the log is tailed in the terminal, not downloaded through the Contents API.
    big = launcher.start(
        service("biglog", f'{PY} -c \'print(("x" * 999 + chr(10)) * 1500, end=""); print("last")\'')
    )
    # Bytes that are not UTF-8 come back from the Contents API as base64.
    binary = launcher.start(
        service("binlog", f"{PY} -c 'import sys; sys.stdout.buffer.write(b\"\\xff ok\\n\")'")
    )
    for handle in (big, binary):
        assert handle.pid is not None
        pids.append(handle.pid)
    wait_until(lambda: launcher.alive(big) is False, 10, "the big log to be written")
    wait_until(lambda: launcher.alive(binary) is False, 10, "the binary log to be written")
    assert Path(str(big.log)).stat().st_size > 1 << 20
    assert launcher.log_tail(big, 2) == "x" * 999 + "\nlast"
    assert launcher.log_tail(binary) == "\ufffd ok"


def test_missing_log_is_empty(launcher: JupyterLauncher, jupyter: JupyterServer) -> None:
    handle = Handle(kind="jupyter", log=str(jupyter.root / SCRIPT_DIR / "never.log"))
    assert launcher.log_tail(handle) == ""
    assert launcher.log_tail(Handle(kind="jupyter")) == ""


def test_wrong_token(jupyter: JupyterServer) -> None:
    bad = JupyterLauncher(jupyter.url, "not-the-token", host_name="lab", timeout_s=10)
    with pytest.raises(LauncherError, match="token") as e:
        bad.start(sleeper("never"))
    assert "hosts.lab.jupyter_token_env" in e.value.hint
    with pytest.raises(LauncherError, match="token"):
        bad.alive(Handle(kind="jupyter", pid=1, terminal="gpuctl_never"))
    none = JupyterLauncher(jupyter.url, None, host_name="lab", timeout_s=10)
    with pytest.raises(LauncherError, match="token"):
        none.start(sleeper("never"))


def test_jupyter_down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    down = JupyterLauncher(url, "t", host_name="lab", timeout_s=5)
    with pytest.raises(LauncherError, match="cannot reach JupyterLab") as e:
        down.start(sleeper("never"))
    assert url in str(e.value)
    assert down.alive(Handle(kind="jupyter", pid=1, terminal="gpuctl_never")) is None
    with pytest.raises(LauncherError, match="cannot reach"):
        down.stop(Handle(kind="jupyter", pid=1, terminal="gpuctl_never", proof="c3" * 16), 1)


def test_no_terminals_and_a_refused_host_header(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with jupyter_server(
        root,
        "--ServerApp.terminals_enabled=False",
        "--ServerApp.local_hostnames=['nowhere.invalid']",
    ) as js:
        (root / SCRIPT_DIR).write_text("a file where the launcher wants its folder")
        with pytest.raises(StartFailed, match=f"would not write {SCRIPT_DIR}") as e:
            JupyterLauncher(js.url, js.token, timeout_s=10).start(sleeper("never"))
        (root / SCRIPT_DIR).unlink()

        with pytest.raises(LauncherError, match="no terminals") as e:
            JupyterLauncher(js.url, js.token, timeout_s=10).start(sleeper("never"))
        assert "jupyter_server_terminals" in e.value.hint

        addrs = {a[4][0] for a in socket.getaddrinfo("localhost", None, socket.AF_UNSPEC)}
        if addrs != {"127.0.0.1"}:
            pytest.skip("localhost does not resolve to 127.0.0.1 only here")
        by_name = js.url.replace("127.0.0.1", "localhost")
        with pytest.raises(LauncherError, match="Host header") as e:
            JupyterLauncher(by_name, js.token, timeout_s=10).start(sleeper("never"))
        assert "allow_remote_access" in e.value.hint


# --------------------------------------------------------------------------- files, secrets


def test_a_log_that_is_a_symlink_is_refused(
    launcher: JupyterLauncher, jupyter: JupyterServer, tmp_path: Path, pids: OwnPids
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (jupyter.root / SCRIPT_DIR).mkdir(exist_ok=True)
    link = jupyter.root / SCRIPT_DIR / "linked.log"
    link.symlink_to(victim)
    with pytest.raises(StartFailed, match="symbolic link") as err:
        launcher.start(sleeper("linked"))
    assert err.value.hint and "services.linked.log" in err.value.hint
    assert victim.read_text() == "precious\n"


def test_the_log_is_private_whatever_the_umask(
    launcher: JupyterLauncher, jupyter: JupyterServer, pids: OwnPids
) -> None:
    handle = launcher.start(service("private", f"{PY} -c 'import os; os.umask(0); print(1)'"))
    assert handle.pid is not None
    pids.append(handle.pid)
    assert handle.log is not None
    wait_until(lambda: launcher.alive(handle) is False, 10, "the command to finish")
    assert os.stat(handle.log).st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_no_secrets_from_jupyters_environment_and_find_by_nonce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    """The terminal's shell has the Jupyter server's environment: gpuctl's secrets there
    are unset in the launch script, and the start nonce is exported, so ``find`` (and the
    agent) can tell the server of a start whose caller died before recording it."""
    from gpuctl.adapters.launchers.environ import START_NONCE_ENV, secret_names
    from gpuctl.config import HostConfig

    monkeypatch.setenv("GPUCTL_AGENT_TOKEN", "agent-secret")
    monkeypatch.setenv("DGX_TOKEN", "host-secret")
    monkeypatch.setenv("LAB_TOKEN", "jupyter-secret")
    monkeypatch.setenv("HARMLESS", "kept")
    host = HostConfig(name="lab", token_env="DGX_TOKEN", jupyter_token_env="LAB_TOKEN")
    with jupyter_server(tmp_path / "root") as js:
        launcher = JupyterLauncher(js.url, js.token, timeout_s=20, secrets=secret_names(host))
        out = tmp_path / "env.json"
        code = 'import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], "w")); time.sleep(600)'
        svc = service("envdump", f"{PY} -c '{code}' {out}")
        # Unique per run: other runs of this suite may share the machine.
        nonce = secrets.token_hex(8)
        handle = launcher.start(svc, start_nonce=nonce)
        assert handle.pid is not None
        pids.append(handle.pid)
        wait_until(out.exists, 20, "the environment dump")
        time.sleep(0.2)
        env = json.loads(out.read_text())
        for name in ("GPUCTL_AGENT_TOKEN", "DGX_TOKEN", "LAB_TOKEN"):
            assert name not in env
        assert env["HARMLESS"] == "kept"
        assert env[START_NONCE_ENV] == nonce

        found = launcher.find(svc, nonce)
        assert found is not None
        assert found.pid == handle.pid
        assert found.pid_start == pytest.approx(handle.pid_start, abs=2)
        assert launcher.find(svc, secrets.token_hex(8)) is None
        assert launcher.find(svc) is None
        launcher.stop(handle, grace_s=5)
        assert launcher.find(svc, nonce) is None


def test_a_terminal_server_inherits_no_secret_the_config_or_gpuctl_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    """Issue 17: the terminal's shell has the Jupyter server's environment, and every one
    of these reached the server before (only this host's names were unset). The names
    the config gives are unset by list; any ``GPUCTL_RUN_*`` or secret-named ``GPUCTL_*``
    by pattern. The environment is read from /proc."""
    from gpuctl.adapters.launchers.environ import secret_names
    from tests.test_launcher_process import INHERITED_SECRETS, config_with_secrets, environ_of

    for name, value in INHERITED_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUCTL_CONFIG", "/etc/gpuctl.toml")
    config = config_with_secrets()
    with jupyter_server(tmp_path / "root") as js:
        launcher = JupyterLauncher(js.url, js.token, timeout_s=20, secrets=secret_names(config))
        svc = service("envdump2", f"{PY} -c 'import time; time.sleep(600)'")
        handle = launcher.start(svc, start_nonce=secrets.token_hex(8))
        assert handle.pid is not None
        pids.append(handle.pid)
        # ``$!`` names the nohup that execs bash that execs the server: until the last
        # exec the pid's environment is still the terminal's, secrets and all.
        env = environ_of(handle.pid)
        launcher.stop(handle, grace_s=5)
    for name in INHERITED_SECRETS:
        assert name not in env, name
    assert env["GPUCTL_CONFIG"] == "/etc/gpuctl.toml"
