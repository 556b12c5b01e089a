"""The process launcher against real processes: what a server inherits, where it logs,
and how a start whose caller died is found again (its nonce in /proc/<pid>/environ)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.environ import START_NONCE_ENV, secret_names
from gpuctl.adapters.launchers.process import ProcessLauncher
from gpuctl.config import HostConfig, ServiceConfig
from gpuctl.errors import StartFailed
from tests.pid_helpers import OwnPids

PY = sys.executable
# Writes its environment to argv[1], then sleeps like a server.
DUMP_ENV = (
    f"{PY} -c 'import json, os, sys, time; "
    'json.dump(dict(os.environ), open(sys.argv[1], "w")); time.sleep(600)\''
)


@pytest.fixture
def pids() -> Iterator[OwnPids]:
    """Pids of launched servers: SIGKILLed at the end, each only while it is still that
    server (``tests.pid_helpers``), and reaped where they are our children."""
    started = OwnPids()
    yield started
    started.kill_all()
    for pid in started:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def read_env(path: Path) -> dict[str, str]:
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError, ValueError):
            data: dict[str, str] = json.loads(path.read_text())
            return data
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} was never written")
        time.sleep(0.05)


def test_server_gets_no_secrets_but_the_nonce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    monkeypatch.setenv("GPUCTL_AGENT_TOKEN", "agent-secret")
    monkeypatch.setenv("DGX_TOKEN", "host-secret")
    monkeypatch.setenv("LAB_TOKEN", "jupyter-secret")
    monkeypatch.setenv("GPUCTL_FAILPOINTS", "ensure.after_spawn=pause")
    monkeypatch.setenv("HARMLESS", "kept")
    host = HostConfig(name="dgx", token_env="DGX_TOKEN", jupyter_token_env="LAB_TOKEN")
    launcher = ProcessLauncher(tmp_path / "logs", secrets=secret_names(host))
    out = tmp_path / "env.json"
    svc = ServiceConfig(name="envdump", host="dgx", command=f"{DUMP_ENV} {out}")
    # Unique per run: other runs of this suite may share the machine.
    nonce = secrets.token_hex(8)
    handle = launcher.start(svc, start_nonce=nonce)
    assert handle.pid is not None
    pids.append(handle.pid)
    env = read_env(out)
    for name in ("GPUCTL_AGENT_TOKEN", "DGX_TOKEN", "LAB_TOKEN", "GPUCTL_FAILPOINTS"):
        assert name not in env
    assert env["HARMLESS"] == "kept"
    assert env[START_NONCE_ENV] == nonce


def test_service_env_may_set_a_secret_on_purpose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    monkeypatch.setenv("DGX_TOKEN", "host-secret")
    host = HostConfig(name="dgx", token_env="DGX_TOKEN")
    launcher = ProcessLauncher(tmp_path / "logs", secrets=secret_names(host))
    out = tmp_path / "env.json"
    svc = ServiceConfig(
        name="envdump", host="dgx", command=f"{DUMP_ENV} {out}", env={"DGX_TOKEN": "given"}
    )
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    env = read_env(out)
    assert env["DGX_TOKEN"] == "given"
    # A start without a nonce gets its own: it is the proof its stop checks.
    assert env[START_NONCE_ENV] == handle.proof


def test_a_log_that_is_a_symlink_is_refused(tmp_path: Path, pids: OwnPids) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "linked.log").symlink_to(victim)
    launcher = ProcessLauncher(logs)
    svc = ServiceConfig(name="linked", host="h", command=f"{PY} -c 'print(1)'")
    with pytest.raises(StartFailed, match="symbolic link") as err:
        launcher.start(svc)
    assert err.value.hint and "services.linked.log" in err.value.hint
    assert victim.read_text() == "precious\n"
    # Nor is its tail read through the link.
    from gpuctl.adapters.launchers.base import Handle

    assert launcher.log_tail(Handle(kind="process", log=str(logs / "linked.log"))) == ""


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_the_log_is_private_whatever_the_umask(tmp_path: Path, umask: int, pids: OwnPids) -> None:
    old = os.umask(umask)
    try:
        launcher = ProcessLauncher(tmp_path / "logs")
        svc = ServiceConfig(name="quiet", host="h", command=f"{PY} -c 'print(1)'")
        handle = launcher.start(svc)
    finally:
        os.umask(old)
    assert handle.pid is not None
    pids.append(handle.pid)
    log = tmp_path / "logs" / "quiet.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) & 0o077 == 0


def test_an_existing_log_is_made_private(tmp_path: Path, pids: OwnPids) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "old.log").write_text("before\n")
    (logs / "old.log").chmod(0o666)
    svc = ServiceConfig(name="old", host="h", command=f"{PY} -c 'print(1)'")
    handle = ProcessLauncher(logs).start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    assert stat.S_IMODE((logs / "old.log").stat().st_mode) == 0o600
    assert (logs / "old.log").read_text().startswith("before\n")


def test_a_long_lived_launcher_reaps_its_servers_when_they_exit(
    tmp_path: Path, pids: OwnPids
) -> None:
    """The agent launches for the web view and lives on: a server that exits (stopped
    by another process, or crashed) must not stay its zombie. This test process is the
    long-lived launcher here."""
    import psutil

    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(name="brief", host="h", command=f"{PY} -c 'import time; time.sleep(0.2)'")
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    deadline = time.monotonic() + 30
    while True:
        try:
            status = psutil.Process(handle.pid).status()
        except psutil.NoSuchProcess:
            break  # exited and reaped
        assert time.monotonic() < deadline, f"pid {handle.pid} is still here: {status}"
        time.sleep(0.05)
    assert launcher.alive(handle) is False


def test_a_server_that_exits_at_once_still_has_its_start_time(
    tmp_path: Path, pids: OwnPids
) -> None:
    """The handle's start time is what tells a reused pid from the server: read before
    the launcher's reaper may collect a server that exits at once (61 of 200 such starts
    had none when the reaper came first)."""
    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(name="quick", host="h", command="true")
    for _ in range(40):
        handle = launcher.start(svc)
        assert handle.pid is not None
        pids.append(handle.pid)
        assert handle.pid_start is not None


def test_find_by_nonce(tmp_path: Path, pids: OwnPids) -> None:
    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(name="found", host="h", command=f"{PY} -c 'import time; time.sleep(600)'")
    # Unique per run: other runs of this suite may share the machine.
    nonce = secrets.token_hex(8)
    handle = launcher.start(svc, start_nonce=nonce)
    assert handle.pid is not None
    pids.append(handle.pid)
    found = launcher.find(svc, nonce)
    assert found is not None
    assert found.pid == handle.pid
    assert found.pid_start == pytest.approx(handle.pid_start)
    assert launcher.find(svc, secrets.token_hex(8)) is None
    assert launcher.find(svc, None) is None
    # The nonce copied into another service's record names a server of another name.
    other = ServiceConfig(name="other", host="h", command=svc.command)
    assert launcher.find(other, nonce) is None
    os.kill(handle.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # the launcher's reaper may be first
        os.waitpid(handle.pid, 0)
    assert launcher.find(svc, nonce) is None


def test_a_decoy_with_a_copied_nonce_never_hides_the_server(tmp_path: Path, pids: OwnPids) -> None:
    """A process that carries a start's nonce (read from its record) but not the
    service's mark, started first: find skips it and names the server."""
    import subprocess

    nonce = secrets.token_hex(8)
    decoy = subprocess.Popen(
        [PY, "-c", "import time; time.sleep(600)"],
        env={**os.environ, START_NONCE_ENV: nonce},
        start_new_session=True,
    )
    pids.append(decoy.pid)
    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(name="real", host="h", command=f"{PY} -c 'import time; time.sleep(600)'")
    handle = launcher.start(svc, start_nonce=nonce)
    assert handle.pid is not None
    pids.append(handle.pid)
    try:
        deadline = time.monotonic() + 10
        while (found := launcher.find(svc, nonce)) is None:
            assert time.monotonic() < deadline, "the server was never found"
            time.sleep(0.05)
        assert found.pid == handle.pid != decoy.pid
    finally:
        decoy.kill()
        decoy.wait()


def test_find_by_env_prefers_the_root_of_a_tree(tmp_path: Path, pids: OwnPids) -> None:
    """A command that is not exec'd (a shell with a child) carries the nonce twice: the
    one whose parent does not is the start's own process."""
    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(
        name="tree",
        host="h",
        command=f"sh -c '{PY} -c \"import time; time.sleep(600)\" & wait'",
    )
    # Unique per run: other runs of this suite may share the machine.
    nonce = secrets.token_hex(8)
    handle = launcher.start(svc, start_nonce=nonce)
    assert handle.pid is not None
    pids.append(handle.pid)
    deadline = time.monotonic() + 10
    while len(procinfo.pids_with_env(START_NONCE_ENV, nonce)) < 2:
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    assert procinfo.find_by_env(START_NONCE_ENV, nonce) == handle.pid
    with contextlib.suppress(OSError):
        os.killpg(handle.pid, signal.SIGKILL)


# Issue 17: the secrets a server inherited beyond GPUCTL_AGENT_TOKEN, each one a leak.
INHERITED_SECRETS = {
    "GPUCTL_AGENT_READ_TOKEN": "read-secret",
    "OTHER_HOST_TOKEN": "other-host-secret",  # another host's token_env
    "OTHER_HOST_READ": "other-host-read-secret",  # another host's read_token_env
    "PROXY_KEYS": "proxy-key-1,proxy-key-2",  # proxy.api_keys_env
    "GPUCTL_RUN_JOB": "train",  # an enclosing `gpuctl run` job's marks
    "GPUCTL_RUN_NONCE": "run-nonce-0123456789abcdef",
    "GPUCTL_RUN_PREEMPTIBLE": "1",
    "GPUCTL_SOME_FUTURE_TOKEN": "future-secret",  # any GPUCTL_* secret by its name
}


def config_with_secrets() -> Any:
    """Two hosts and a proxy, each naming secrets in the environment."""
    from gpuctl.config import Config
    from gpuctl.config.values import ProxyConfig

    here = HostConfig(name="here", token_env="DGX_TOKEN")
    other = HostConfig(
        name="other",
        agent="http://other:8765",
        token_env="OTHER_HOST_TOKEN",
        read_token_env="OTHER_HOST_READ",
    )
    return Config(
        path=None,
        hosts={"here": here, "other": other},
        proxy=ProxyConfig(api_keys_env="PROXY_KEYS"),
    )


def environ_of(pid: int, timeout_s: float = 10) -> dict[str, str]:
    """A launched server's environment, as /proc shows it to whoever may read it, once
    its last exec is done. Until then the pid's environment is the launcher's (empty
    during the exec itself, or a shell's or a terminal's): the start nonce, which the
    launcher sets for the server alone, says the exec has happened."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        env = dict(e.split("=", 1) for e in raw.decode().split("\0") if "=" in e)
        if START_NONCE_ENV in env or time.monotonic() > deadline:
            return env
        time.sleep(0.02)


def test_a_launched_server_inherits_no_secret_the_config_or_gpuctl_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    """Before issue 17 every one of ``INHERITED_SECRETS`` reached the server: only the
    agent's token and this host's variables were dropped. The launcher comes from the
    same wiring ``ensure`` and ``reclaim`` use; the environment is read from /proc."""
    from gpuctl.wiring.launchers import launcher_for

    for name, value in INHERITED_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUCTL_CONFIG", "/etc/gpuctl.toml")
    monkeypatch.setenv("HARMLESS", "kept")
    config = config_with_secrets()
    svc = ServiceConfig(
        name="envdump",
        host="here",
        launcher="process",
        command=f"{PY} -c 'import time; time.sleep(600)'",
        env={"OTHER_HOST_TOKEN": "given on purpose"},
    )
    launcher = launcher_for(svc, config.hosts["here"], None, config)
    nonce = secrets.token_hex(8)
    handle = launcher.start(svc, start_nonce=nonce)
    assert handle.pid is not None
    pids.append(handle.pid)
    env = environ_of(handle.pid)
    for name in INHERITED_SECRETS:
        if name != "OTHER_HOST_TOKEN":
            assert name not in env, name
    assert env["OTHER_HOST_TOKEN"] == "given on purpose"
    # gpuctl's own settings stay: a server that runs gpuctl needs them.
    assert env["GPUCTL_CONFIG"] == "/etc/gpuctl.toml" and env["HARMLESS"] == "kept"
    assert env[START_NONCE_ENV] == nonce


def test_a_stop_proves_the_service_too_and_an_inherited_mark_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pids: OwnPids
) -> None:
    """A gpuctl that itself runs under another service's server inherits that server's
    ``GPUCTL_START_SERVICE``: its launch must not pass it on, and a stop for another
    service refuses a server whose mark names its own (failed before: no such mark)."""
    from gpuctl.adapters.launchers.environ import START_SERVICE_ENV
    from gpuctl.errors import Unproven

    monkeypatch.setenv(START_SERVICE_ENV, "svcb")
    monkeypatch.setenv(START_NONCE_ENV, "f" * 32)
    launcher = ProcessLauncher(tmp_path / "logs")
    out = tmp_path / "env.json"
    svc = ServiceConfig(name="svca", host="dgx", command=f"{DUMP_ENV} {out}")
    handle = launcher.start(svc)
    assert handle.pid is not None
    pids.append(handle.pid)
    env = read_env(out)
    assert env[START_SERVICE_ENV] == "svca" and env[START_NONCE_ENV] == handle.proof
    with pytest.raises(Unproven):
        launcher.stop(handle, 1.0, "svcb")
    assert procinfo.is_alive(handle.pid)
    launcher.stop(handle, 5.0, "svca")
    assert not procinfo.is_alive(handle.pid)
