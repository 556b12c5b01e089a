"""gpuctl never signals a process it cannot prove it started.

The records are writable by every write-token holder (and every member of the state
folder's group), and the read-only token learns any pid's age from ``/status?pids=``:
so a record can name any process with its real start time. Each launcher's stop checks
the proof its start left (the nonce in the server's environment, the container's label)
first. And a job's run marks never pass to a server launched from inside the job, so a
job stop never reaches that server.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import START_NONCE_ENV
from gpuctl.adapters.launchers.process import ProcessLauncher
from gpuctl.config import ServiceConfig
from gpuctl.errors import ExitCode, Unproven
from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl, gpuctl_in_process
from tests.ensure_helpers import agent_host, read_record, server_pids, unique_name
from tests.test_launcher_process import DUMP_ENV, read_env
from tests.test_reclaim import idle_past, started


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """Someone else's process: a `sleep` gpuctl did not start."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def forge(host: SimHost, svc: str, handle: dict[str, Any]) -> None:
    """With the write token: take the record's lease, write ``handle``, give it back."""
    from gpuctl.adapters.store import holder_here

    auth = {"Authorization": f"Bearer {host.token}"}
    h = holder_here("forge")
    base = f"{host.agent_url}/records/{svc}"
    r = httpx.post(f"{base}/lease", json={"holder": h.to_dict(), "ttl_s": 60}, headers=auth)
    assert r.status_code == 200 and r.json()["granted"], r.text
    body = {"holder": h.id, "update": {"phase": "running", "handle": handle}}
    assert httpx.patch(base, json=body, headers=auth).status_code == 200
    r = httpx.post(f"{base}/lease/release", json={"holder": h.id}, headers=auth)
    assert r.status_code == 200, r.text


def pointed_at(pid: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "process", "pid": pid, "pid_start": procinfo.start_time(pid), **extra}


def test_stop_of_a_forged_record_signals_nothing_and_reports_it(
    host: SimHost, sleeper: subprocess.Popen[bytes]
) -> None:
    svc = unique_name("reach")
    cfg = started(host, svc, idle="30m")
    real = read_record(host, svc)["handle"]
    try:
        # The attacker copies the real server's proof; the sleep does not carry it.
        forge(host, svc, pointed_at(sleeper.pid, proof=real["proof"]))
        r = gpuctl_in_process(cfg, "stop", svc)
        assert r.returncode == ExitCode.UNKNOWN, r.stderr
        assert f"{svc}: pid {sleeper.pid} is not the server its record names" in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 2
        time.sleep(0.3)
        assert sleeper.poll() is None
        rec = read_record(host, svc)
        assert rec["phase"] == "running" and rec["handle"]["pid"] == sleeper.pid
        # A record from before the proof (none): reported, never signalled, even when
        # it names the real server.
        forge(host, svc, {k: v for k, v in real.items() if k != "proof"})
        r = gpuctl_in_process(cfg, "stop", svc)
        assert r.returncode == ExitCode.UNKNOWN and "has no proof" in r.stderr, r.stderr
        assert server_pids(svc) == [real["pid"]]
        # Its own record: stopped.
        forge(host, svc, real)
        r = gpuctl_in_process(cfg, "stop", svc)
        assert r.returncode == 0, r.stderr
        assert server_pids(svc) == []
    finally:
        gpuctl_in_process(cfg, "stop", svc)


def test_a_record_copied_from_another_service_never_stops_that_server(
    host: SimHost,
) -> None:
    """A record is bound to its service, not only to a start: ``svcb``'s record copied to
    ``svca`` (its handle and proof whole) made ``gpuctl stop svca``, and reclaim, kill
    ``svcb``'s server. The server's ``GPUCTL_START_SERVICE`` names ``svcb``, so both are
    refused, nothing is signalled, and it is reported (failed before: svcb was killed)."""
    from gpuctl.sim.host import free_port
    from tests.ensure_helpers import model_server_command, service_toml

    a, b = unique_name("reacha"), unique_name("reachb")
    pa, pb = free_port(), free_port()
    cfg = host.write_config(
        service_toml(a, pa, model_server_command(a, pa, memory="20GiB", load_time="0.5s"),
                     extra='idle_timeout = "1s"')
        + service_toml(b, pb, model_server_command(b, pb, memory="20GiB", load_time="0.5s"),
                       extra='idle_timeout = "never"')
    )  # fmt: skip
    try:
        for svc in (a, b):
            r = gpuctl(cfg, "ensure", svc, "--json")
            assert r.returncode == 0, r.stdout + r.stderr
        real_a = read_record(host, a)["handle"]
        theirs = read_record(host, b)["handle"]
        (victim,) = server_pids(b)
        marks = Path(f"/proc/{victim}/environ").read_bytes().split(b"\0")
        assert f"GPUCTL_START_SERVICE={b}".encode() in marks
        forge(host, a, theirs)
        r = gpuctl_in_process(cfg, "stop", a)
        assert r.returncode == ExitCode.UNKNOWN, r.stderr
        assert "is not the server its record names" in r.stderr, r.stderr
        time.sleep(0.3)
        assert server_pids(b) == [victim]
        idle_past(host, a, 1.0)
        r = gpuctl_in_process(cfg, "reclaim", "--json")
        (c,) = [c for c in json.loads(r.stdout)["candidates"] if c["service"] == a]
        assert not c["done"] and "is not the server its record names" in c["error"], c
        time.sleep(0.3)
        assert server_pids(b) == [victim]
        forge(host, a, real_a)
    finally:
        gpuctl_in_process(cfg, "stop", a)
        gpuctl_in_process(cfg, "stop", b)


def test_reclaim_of_a_forged_record_signals_nothing(
    host: SimHost, sleeper: subprocess.Popen[bytes]
) -> None:
    svc = unique_name("reach")
    cfg = started(host, svc)
    real = read_record(host, svc)["handle"]
    try:
        forge(host, svc, pointed_at(sleeper.pid, proof=real["proof"]))
        idle_past(host, svc, 1.0)
        r = gpuctl_in_process(cfg, "reclaim", "--json")
        (c,) = [c for c in json.loads(r.stdout)["candidates"] if c["service"] == svc]
        assert not c["done"] and "is not the server its record names" in c["error"], c
        time.sleep(0.3)
        assert sleeper.poll() is None
        assert read_record(host, svc)["handle"]["pid"] == sleeper.pid
    finally:
        forge(host, svc, real)
        gpuctl_in_process(cfg, "stop", svc)


def test_the_process_launcher_proves_before_it_signals(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    launcher = ProcessLauncher(tmp_path / "logs")
    for proof in (None, "", "short", "a" * 32, 7):
        h = Handle(kind="process", pid=sleeper.pid, pid_start=procinfo.start_time(sleeper.pid))
        h = Handle.from_dict({**h.to_dict(), "proof": proof})
        with pytest.raises(Unproven):
            launcher.stop(h, 0.5)
    assert sleeper.poll() is None
    # A start without a nonce still leaves a proof, and its stop works.
    svc = ServiceConfig(name="proven", host="h", command="sleep 600")
    own = launcher.start(svc)
    assert own.pid is not None and own.proof and len(own.proof) >= 16
    launcher.stop(own, 5.0)
    assert not procinfo.is_alive(own.pid)


def test_a_server_never_inherits_a_jobs_run_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in (
        ("GPUCTL_RUN_JOB", "j"),
        ("GPUCTL_RUN_NONCE", "b" * 32),
        ("GPUCTL_RUN_PREEMPTIBLE", "1"),
        ("GPUCTL_RUN_FUTURE", "x"),
    ):
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    launcher = ProcessLauncher(tmp_path / "logs")
    svc = ServiceConfig(name="envdump", host="h", command=f"{DUMP_ENV} {out}")
    h = launcher.start(svc)
    try:
        env = read_env(out)
        assert not [k for k in env if k.startswith("GPUCTL_RUN_")], env
        assert env[START_NONCE_ENV] == h.proof
    finally:
        launcher.stop(h, 1.0)


def test_a_job_stop_refuses_a_server_that_carries_the_marks(tmp_path: Path) -> None:
    """A server started by an older gpuctl from inside the job inherited the job's marks
    and leads its own session: its start nonce tells it from the job's CMD."""
    from gpuctl.adapters.job_cmd import verify_job
    from gpuctl.errors import LauncherError

    d = tmp_path / "4242"
    d.mkdir()
    marks = b"GPUCTL_RUN_JOB=j\0GPUCTL_RUN_NONCE=" + b"a" * 32 + b"\0GPUCTL_RUN_PREEMPTIBLE=1\0"
    (d / "stat").write_text("4242 (x y) S 1 4242 4242 0")
    (d / "environ").write_bytes(marks + b"GPUCTL_START_NONCE=" + b"c" * 16 + b"\0")
    with pytest.raises(LauncherError, match="is a server gpuctl launched"):
        verify_job(4242, "j", "a" * 32, proc_root=str(tmp_path))


class _Container:
    def __init__(self, labels: dict[str, str]) -> None:
        self.name, self.id, self.status, self.labels = "gpuctl-x", "c1", "running", labels
        self.stopped = False

    def stop(self, timeout: int) -> None:
        self.stopped = True


class _Client:
    def __init__(self, ct: _Container) -> None:
        self.containers = self
        self.ct = ct

    def get(self, ref: str) -> _Container:
        return self.ct

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("labels", "proof", "ok"),
    [
        ({"gpuctl.managed": "true", "gpuctl.proof": "p" * 16}, "p" * 16, True),
        ({"gpuctl.managed": "true", "gpuctl.proof": "p" * 16}, "q" * 16, False),
        ({"gpuctl.managed": "true"}, None, False),  # created before the label
        ({"gpuctl.proof": "p" * 16}, "p" * 16, False),  # not gpuctl's
        ({"gpuctl.managed": "true", "gpuctl.proof": "p"}, "p", False),  # too short
    ],
)
def test_docker_stops_only_a_container_with_its_proof_label(
    labels: dict[str, str], proof: str | None, ok: bool
) -> None:
    """The engine's own objects are replaced (no engine here); the rule is the
    launcher's: a real engine run is in tests/test_ensure_docker.py."""
    pytest.importorskip("docker")
    from gpuctl.adapters.launchers.docker import DockerLauncher

    ct = _Container(labels)
    launcher = DockerLauncher("unix:///nonexistent.sock")
    launcher._client_obj = _Client(ct)
    h = Handle(kind="docker", container_id="c1", proof=proof)
    if ok:
        launcher.stop(h, 1.0)
    else:
        with pytest.raises(Unproven):
            launcher.stop(h, 1.0)
    assert ct.stopped is ok


@pytest.mark.parametrize("name", ["run.x", "run.", "run.chat.v2"])
def test_a_service_named_like_a_job_is_refused(tmp_path: Path, name: str) -> None:
    """``gpuctl run --name x`` keeps its record as run.x: a service of that name would
    share it."""
    from gpuctl.config import load_config
    from gpuctl.errors import ConfigError

    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[hosts.h]\nprobe = "sim"\n\n[services."{name}"]\ncommand = "sleep 1"\n')
    with pytest.raises(ConfigError, match=r"services\.\S+: a service name may not start"):
        load_config(cfg)
