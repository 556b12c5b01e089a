"""`gpuctl ensure` end to end with the jupyter launcher, against a real ``jupyter server``.

The race of the issue (32 ``gpuctl ensure`` processes and 8 ``ensure_ready`` calls at
once, a fake vLLM with a 5 s load) must end in exactly one server launched once from
its Jupyter terminal, and a command that dies at once must fail the start with its log
and hold the next attempt back. The servers are real processes on this machine, so
the simulated GPU's agent sees them as it would see a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import set_marked_failpoints
from tests.ensure_helpers import (
    kill_servers,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    sim_claims,
    spawn_ensure,
    unique_name,
)
from tests.jupyter_helpers import JupyterServer, jupyter_server

pytestmark = pytest.mark.jupyter

CALLERS = 32
API_CALLS = 8
TOKEN_ENV = "GPUCTL_TEST_ENSURE_JUPYTER_AGENT_TOKEN"
JUPYTER_TOKEN_ENV = "GPUCTL_TEST_ENSURE_JUPYTER_TOKEN"


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    with jupyter_server(tmp_path_factory.mktemp("jupyter") / "root") as server:
        yield server


@pytest.fixture
def host(
    jupyter: JupyterServer,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SimHost]:
    set_marked_failpoints(request, monkeypatch)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    monkeypatch.setenv(JUPYTER_TOKEN_ENV, jupyter.token)
    api._reset_for_tests()
    with SimHost(root=tmp_path / "simhost") as h:
        monkeypatch.setenv(TOKEN_ENV, h.token)
        h.start_agent()
        yield h
    api._reset_for_tests()


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name("jp")
    yield name
    kill_servers(name)


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def jupyter_config(
    host: SimHost, jupyter: JupyterServer, name: str, port: int, command: str
) -> Path:
    """The simulated host (its agent and its JupyterLab) and one jupyter service."""
    path = host.base / "jupyter.toml"
    path.write_text(
        "[hosts.sim]\n"
        f"agent = {_toml_str(host.agent_url)}\n"
        f"token_env = {_toml_str(TOKEN_ENV)}\n"
        f"jupyter = {_toml_str(jupyter.url)}\n"
        f"jupyter_token_env = {_toml_str(JUPYTER_TOKEN_ENV)}\n"
        "\n"
        f"[services.{name}]\n"
        'launcher = "jupyter"\n'
        f"command = {_toml_str(command)}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f"match = [{_toml_str(name)}]\n"
        'memory = "20GiB"\n'
        'health_timeout = "120s"\n'
        f"env = {{ GPUCTL_SIM_DIR = {_toml_str(str(host.sim_dir))} }}\n"
    )
    return path


def server_log(jupyter: JupyterServer, name: str) -> Path:
    """Where the jupyter launcher sends the server's output (under Jupyter's root_dir)."""
    return jupyter.root / "gpuctl-jupyter" / f"{name}.log"


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")  # 32 callers: never beside another heavy test
def test_race_32_processes_and_8_api_calls_one_server(
    jupyter: JupyterServer, host: SimHost, svc: str
) -> None:
    port = free_port()
    cfg = jupyter_config(host, jupyter, svc, port, model_server_command(svc, port, load_time="5s"))

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

    rec = read_record(host, svc)
    assert rec["phase"] == "running" and rec["lease"] is None
    assert [a["outcome"] for a in rec["attempts"]] == ["ready"]
    assert rec["attempts"][0]["launcher"] == "jupyter"
    assert rec["handle"]["terminal"] == f"gpuctl_{svc}"
    # One server process (the one the terminal launched), one claim on the simulated GPU.
    assert server_pids(svc) == [rec["handle"]["pid"]]
    assert sim_claims(host, svc) == [rec["handle"]["pid"]]
    log = server_log(jupyter, svc).read_text(errors="replace")
    assert "Application startup complete" in log
    assert "CUDA out of memory" not in log


# A minute's back-off: the second call must land inside it however long the first took.
@pytest.mark.failpoints("ensure.backoff=seconds:60")
def test_failed_start_shows_the_log_and_backs_off(
    jupyter: JupyterServer, host: SimHost, svc: str
) -> None:
    port = free_port()
    # The service's name on the command line: the keywords see it while it runs.
    cmd = f"{sys.executable} -c \"print('boom: weights not found'); raise SystemExit(3)\" {svc}"
    cfg = jupyter_config(host, jupyter, svc, port, cmd)

    r = run_ensure(cfg, svc, "--timeout", "120s", timeout=180)
    out = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    assert out["outcome"] == "failed" and out["launched"] is True, out
    assert "exited" in out["reason"]
    assert "boom: weights not found" in out["log_tail"]
    log = server_log(jupyter, svc)
    written = log.stat().st_mtime_ns

    # The back-off holds the next attempt: FAILED at once, nothing launched again (a
    # second launch would rewrite the log).
    r2 = run_ensure(cfg, svc, "--timeout", "120s", timeout=180)
    out2 = json.loads(r2.stdout)
    assert r2.returncode == 1, r2.stderr
    assert out2["decision"] == "FAILED" and out2["launched"] is False, out2
    assert "next try in" in out2["reason"]
    assert "boom: weights not found" in out2["log_tail"]
    assert log.stat().st_mtime_ns == written
    rec = read_record(host, svc)
    assert rec["phase"] == "failed"
    assert [a["outcome"] for a in rec["attempts"]] == ["failed"]
    assert rec["failure"]["count"] == 1 and "boom" in rec["failure"]["log_tail"]


def test_caller_killed_between_launch_line_and_record(
    jupyter: JupyterServer, host: SimHost, svc: str
) -> None:
    """The jupyter launcher's window: the launch line is typed and the server runs, its
    caller is killed before it records it. A rival 80 GiB service is BUSY (no OOM); the
    same service asked again finds the server by its start nonce (never a second)."""
    import signal

    from tests.ensure_helpers import big_service, end_in_window, ensure_paused_at

    server = unique_name("anon")  # its command does not name the service
    rival = unique_name("rival")
    port, rival_port = free_port(), free_port()
    cfg = jupyter_config(
        host, jupyter, svc, port, model_server_command(server, port, "80GiB", "6s")
    )
    text = cfg.read_text().replace('memory = "20GiB"', 'memory = "80GiB"')
    cfg.write_text(text + "\n" + big_service(rival, rival_port, rival, "1s"))
    try:
        caller = ensure_paused_at(cfg, svc)
        end_in_window(caller, signal.SIGKILL)
        rec = read_record(host, svc)
        assert rec["phase"] == "starting" and rec["start_nonce"] and not rec["handle"]
        # The terminal runs the typed line on its own time: the server may appear a
        # moment after its caller died.
        deadline = time.monotonic() + 30
        while not server_pids(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        (first,) = server_pids(server)

        r = run_ensure(cfg, rival)
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert server_pids(rival) == []

        r = run_ensure(cfg, svc, "--timeout", "120s")
        out = json.loads(r.stdout)
        assert r.returncode == 0, (out["reason"], out["notes"])
        assert out["outcome"] == "ready" and out["launched"] is False
        assert server_pids(server) == [first]
        rec = read_record(host, svc)
        assert rec["phase"] == "running" and rec["handle"]["pid"] == first
        assert "CUDA out of memory" not in server_log(jupyter, svc).read_text()
    finally:
        kill_servers(server)
        kill_servers(rival)
