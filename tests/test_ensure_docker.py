"""`gpuctl ensure` end to end with the docker launcher, against a real Docker Engine.

The race of the issue (32 ``gpuctl ensure`` processes and 8 ``ensure_ready`` calls at
once, a fake vLLM with a 5 s load) must end in exactly one container started once, and
a container that dies at once must fail the start with its log and hold the next
attempt back. The containers run this checkout's gpuctl from read-only host mounts in a
locally imported image (tests/docker_helpers.py), on the host's network and PID
namespace, so the simulated GPU on the host sees their processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl import api
from gpuctl.adapters.launchers.docker import LABEL_SERVICE, container_name
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import set_marked_failpoints
from tests.docker_helpers import (
    docker_client,
    docker_unavailable,
    ensure_test_image,
    model_server_command,
    python_command,
    remove_service_containers,
    sim_service,
)
from tests.ensure_helpers import (
    kill_servers,
    read_record,
    run_ensure,
    server_pids,
    sim_claims,
    spawn_ensure,
    unique_name,
)

pytestmark = pytest.mark.docker

CALLERS = 32
API_CALLS = 8
TOKEN_ENV = "GPUCTL_TEST_ENSURE_DOCKER_TOKEN"


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    c = docker_client(timeout=60.0)
    ensure_test_image(c)
    yield c
    c.close()


@pytest.fixture
def host(
    client: Any,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SimHost]:
    set_marked_failpoints(request, monkeypatch)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    api._reset_for_tests()
    with SimHost(root=tmp_path / "simhost") as h:
        monkeypatch.setenv(TOKEN_ENV, h.token)
        h.start_agent()
        yield h
    api._reset_for_tests()


@pytest.fixture
def svc(client: Any) -> Iterator[str]:
    name = unique_name("dk")
    yield name
    remove_service_containers(client, [name])
    kill_servers(name)


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def docker_config(host: SimHost, name: str, port: int, command: str) -> Path:
    """The simulated host (its agent, and the Docker Engine in use) and one docker service."""
    spec = sim_service(name, command, sim_dir=host.sim_dir)
    env = ", ".join(f"{k} = {_toml_str(v)}" for k, v in spec.env.items())
    volumes = ", ".join(_toml_str(v) for v in spec.volumes)
    engine = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    path = host.base / "docker.toml"
    path.write_text(
        "[hosts.sim]\n"
        f"agent = {_toml_str(host.agent_url)}\n"
        f"token_env = {_toml_str(TOKEN_ENV)}\n"
        f"docker = {_toml_str(engine)}\n"
        "\n"
        f"[services.{name}]\n"
        'launcher = "docker"\n'
        f"image = {_toml_str(str(spec.image))}\n"
        f"command = {_toml_str(command)}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f"match = [{_toml_str(name)}]\n"
        'memory = "20GiB"\n'
        'health_timeout = "120s"\n'
        "gpus = false\n"
        'network = "host"\n'
        'pid_mode = "host"\n'
        'stop_timeout = "10s"\n'
        f"volumes = [{volumes}]\n"
        f"env = {{ {env} }}\n"
    )
    return path


def containers_of(client: Any, name: str) -> list[Any]:
    """Every container of the service, running or not (by label)."""
    return list(client.containers.list(all=True, filters={"label": f"{LABEL_SERVICE}={name}"}))


class IdWatcher:
    """Samples the ids of the service's containers while a race runs: a container removed
    and recreated in between (a second launch) leaves a second id behind."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> IdWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        c = docker_client(timeout=30.0)
        try:
            while True:
                try:
                    rows = c.api.containers(
                        all=True, quiet=True, filters={"label": f"{LABEL_SERVICE}={self.name}"}
                    )
                    self.seen.update(r["Id"] for r in rows)
                except Exception as e:  # an engine slow under the race: note it, go on
                    self.errors.append(f"{type(e).__name__}: {e}")
                if self._stop.wait(0.5):
                    break
        finally:
            c.close()


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")  # 32 callers: never beside another heavy test
def test_race_32_processes_and_8_api_calls_one_container(
    client: Any, host: SimHost, svc: str
) -> None:
    port = free_port()
    cfg = docker_config(host, svc, port, model_server_command(port, name=svc, load_time="5s"))

    async def api_calls() -> list[api.ReadyResult]:
        try:
            return list(
                await asyncio.gather(
                    *(api.ensure_ready(svc, config=cfg, timeout=120) for _ in range(API_CALLS))
                )
            )
        finally:
            await api.aclose()

    t0 = time.monotonic()
    with IdWatcher(svc) as watcher:
        procs = [spawn_ensure(cfg, svc, "--timeout", "120s") for _ in range(CALLERS)]
        try:
            results = asyncio.run(api_calls())
        finally:
            outs = [(p.communicate(timeout=180), p.returncode) for p in procs]
    took = time.monotonic() - t0

    codes = [rc for _, rc in outs]
    assert codes == [0] * CALLERS, [err[-400:] for (_, err), rc in outs if rc]
    assert all(r.ready for r in results), [r.reason for r in results if not r.ready]
    launched = [json.loads(out)["launched"] for (out, _), _ in outs]
    launched += [r.launched for r in results]
    assert launched.count(True) == 1, f"{launched.count(True)} launches in {took:.0f}s"

    # Exactly one container, started once, and never replaced during the race.
    (ct,) = containers_of(client, svc)
    assert ct.name == f"gpuctl-{svc}" and ct.status == "running"
    assert watcher.seen == {ct.id}, watcher.errors
    assert ct.attrs["RestartCount"] == 0
    rec = read_record(host, svc)
    assert rec["phase"] == "running" and rec["lease"] is None
    assert [a["outcome"] for a in rec["attempts"]] == ["ready"]
    assert rec["attempts"][0]["launcher"] == "docker"
    assert rec["handle"]["container_id"] == ct.id
    # One server on the simulated GPU: the container's process (host PID namespace).
    assert sim_claims(host, svc) == [rec["handle"]["pid"]]
    assert server_pids(svc) == [rec["handle"]["pid"]]
    logs = ct.logs(stdout=True, stderr=True).decode(errors="replace")
    assert "CUDA out of memory" not in logs


# A minute's back-off: the second call must land inside it however long the first took.
@pytest.mark.failpoints("ensure.backoff=seconds:60")
def test_failed_start_shows_the_log_and_backs_off(client: Any, host: SimHost, svc: str) -> None:
    port = free_port()
    # The service's name on the command line: the keywords see it while it runs.
    cmd = python_command("-c", "print('boom: weights not found'); raise SystemExit(3)", svc)
    cfg = docker_config(host, svc, port, cmd)

    r = run_ensure(cfg, svc, "--timeout", "120s", timeout=180)
    out = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    assert out["outcome"] == "failed" and out["launched"] is True, out
    assert "exited" in out["reason"]
    assert "boom: weights not found" in out["log_tail"]
    (ct,) = containers_of(client, svc)
    assert ct.name == container_name(sim_service(svc, cmd, sim_dir=host.sim_dir))
    assert ct.status == "exited" and ct.attrs["State"]["ExitCode"] == 3
    started_at = ct.attrs["State"]["StartedAt"]

    # The back-off holds the next attempt: FAILED at once, the container not started again.
    r2 = run_ensure(cfg, svc, "--timeout", "120s", timeout=180)
    out2 = json.loads(r2.stdout)
    assert r2.returncode == 1, r2.stderr
    assert out2["decision"] == "FAILED" and out2["launched"] is False, out2
    assert "next try in" in out2["reason"]
    assert "boom: weights not found" in out2["log_tail"]
    (ct2,) = containers_of(client, svc)
    assert ct2.id == ct.id and ct2.attrs["State"]["StartedAt"] == started_at
    rec = read_record(host, svc)
    assert rec["phase"] == "failed"
    assert [a["outcome"] for a in rec["attempts"]] == ["failed"]
    assert rec["failure"]["count"] == 1 and "boom" in rec["failure"]["log_tail"]


def test_caller_killed_between_container_start_and_record(
    client: Any, host: SimHost, svc: str
) -> None:
    """The docker launcher's window: the container runs, its caller is killed before it
    records it. A rival 80 GiB service is BUSY (no OOM); the same service asked again
    finds the container (never a second)."""
    import signal

    from tests.ensure_helpers import big_service, end_in_window, ensure_paused_at

    server = unique_name("anon")  # the container's command does not name the service
    rival = unique_name("rival")
    port, rival_port = free_port(), free_port()
    cfg = docker_config(
        host, svc, port, model_server_command(port, name=server, memory="80GiB", load_time="6s")
    )
    text = cfg.read_text().replace('memory = "20GiB"', 'memory = "80GiB"')
    cfg.write_text(text + "\n" + big_service(rival, rival_port, rival, "1s"))
    try:
        caller = ensure_paused_at(cfg, svc)
        end_in_window(caller, signal.SIGKILL)
        rec = read_record(host, svc)
        assert rec["phase"] == "starting" and rec["start_nonce"] and not rec["handle"]

        r = run_ensure(cfg, rival)
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert server_pids(rival) == []

        r = run_ensure(cfg, svc, "--timeout", "120s")
        out = json.loads(r.stdout)
        assert r.returncode == 0, (out["reason"], out["notes"])
        assert out["outcome"] == "ready" and out["launched"] is False
        (ct,) = containers_of(client, svc)
        assert ct.attrs["RestartCount"] == 0
        rec = read_record(host, svc)
        assert rec["phase"] == "running" and rec["handle"]["container_id"] == ct.id
        assert len(sim_claims(host, server)) == 1
        logs = ct.logs(stdout=True, stderr=True).decode(errors="replace")
        assert "CUDA out of memory" not in logs
    finally:
        kill_servers(server)
        kill_servers(rival)
