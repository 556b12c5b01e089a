"""The agent over real HTTP: the ASGI app under uvicorn on loopback, and the real CLI.

Unit-ish checks use an in-memory FakeProbe; the end-to-end tests run the installed
``gpuctl agent --probe sim`` as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gpuctl.adapters.agent_client import AgentClient
from gpuctl.adapters.procinfo import host_identity
from gpuctl.agent.app import AgentApp, AgentSettings, create_app
from gpuctl.agent.server import parse_listen, resolve_listen, serve
from gpuctl.cli.agent_cmd import read_token_file
from gpuctl.cli.app import create_app as create_cli
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import GpuProcess, Snapshot
from gpuctl.core.status_wire import parse_status
from gpuctl.errors import AgentUnavailable, ProbeError, UsageError
from gpuctl.sim.host import free_port
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread
from tests.conftest import gpuctl_exe

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VLLM = GpuProcess(
    pid=4242,
    command="python -m vllm.entrypoints.openai.api_server --model Qwen",
    memory_mib=8200,
    user="me",
    container="3f2a" * 16,
    gpu=0,
)
HIDDEN = GpuProcess(pid=4343, command=None, memory_mib=34, user=None, container=None, gpu=0)
STATUS_KEYS = {
    "schema",
    "is_idle",
    "memory_used_mib",
    "memory_total_mib",
    "unified_memory",
    "probe",
    "taken_at",
    "gpus",
    "devices",
    "processes",
    "host",
    "state_dir",
    "servers",  # whose each recorded server (and its children) is
    "notes",  # the probe's words for a person (a sim gpu.json that wins), never decisions
}


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe(reading_of(VLLM, HIDDEN, used=None, total=131072))


@pytest.fixture
def agent(probe: FakeProbe) -> Iterator[str]:
    settings = AgentSettings(token=TOKEN, cache_ttl_s=5.0, state_dir="/var/lib/gpuctl")
    with serve_in_thread(create_app(settings, probe)) as url:
        yield url


# --------------------------------------------------------------------------- auth


def test_healthz_and_openapi_need_no_token(agent: str) -> None:
    r = httpx.get(f"{agent}/healthz")
    assert r.status_code == 200
    assert r.json() == {"ok": True, "version": "0.1.0"}
    r = httpx.get(f"{agent}/openapi.json")
    assert r.status_code == 200
    assert r.json()["openapi"] == "3.1.0"


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({}, "requires a bearer token"),
        ({"Authorization": "Bearer wrong"}, "token is wrong"),
        ({"Authorization": f"Bearer {TOKEN}x"}, "token is wrong"),
        ({"Authorization": f"Basic {TOKEN}"}, "token is wrong"),
        ({"Authorization": "Bearer"}, "token is wrong"),
    ],
)
@pytest.mark.parametrize("path", ["/status", "/metrics"])
def test_protected_endpoints_answer_401(
    agent: str, path: str, headers: dict[str, str], fragment: str
) -> None:
    r = httpx.get(f"{agent}{path}", headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    body = r.json()
    assert fragment in body["error"]
    assert "Authorization: Bearer" in body["hint"]


def test_bearer_scheme_is_case_insensitive(agent: str) -> None:
    assert httpx.get(f"{agent}/status", headers={"Authorization": f"bearer {TOKEN}"}).is_success


def test_no_token_means_no_auth(probe: FakeProbe) -> None:
    with serve_in_thread(create_app(AgentSettings(token=None), probe)) as url:
        assert httpx.get(f"{url}/status").status_code == 200


# --------------------------------------------------------------------------- /status


def test_status_follows_the_contract(agent: str) -> None:
    r = httpx.get(f"{agent}/status", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == STATUS_KEYS  # no `starting` without ?match
    assert body["schema"] == 1
    assert body["is_idle"] is False
    # The device gave no used figure (unified memory): the processes' sum stands in.
    assert body["memory_used_mib"] == 8200 + 34
    assert body["memory_total_mib"] == 131072
    assert body["unified_memory"] is True
    assert body["probe"] == "fake"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["taken_at"])
    assert body["gpus"] == 1
    assert body["notes"] == []
    assert body["processes"] == [
        {
            "pid": 4242,
            "command": "python -m vllm.entrypoints.openai.api_server --model Qwen",
            "memory_mib": 8200,
            "user": "me",
            "container": "3f2a" * 16,
            "gpu": 0,
            "on_gpu": True,
            "sm_util_pct": None,
            "mig": None,
        },
        # Unreadable command: kept, with its memory, as null.
        {
            "pid": 4343,
            "command": None,
            "memory_mib": 34,
            "user": None,
            "container": None,
            "gpu": 0,
            "on_gpu": True,
            "sm_util_pct": None,
            "mig": None,
        },
    ]
    # Per GPU: the one device of this reading, its used memory what its processes hold.
    (device,) = body["devices"]
    assert (device["index"], device["memory_used_mib"], device["memory_total_mib"]) == (
        0,
        8200 + 34,
        131072,
    )
    assert device["unified"] is True and device["error"] is None
    assert device["utilization_pct"] is None  # unknown, not 0
    me = host_identity()
    assert body["host"] == {"hostname": me.hostname, "boot_id": me.boot_id}
    assert body["state_dir"] == "/var/lib/gpuctl"
    # And the client reads it back to the same Snapshot.
    assert parse_status(body).to_wire() == body


def test_idle_with_no_process_and_nothing_held() -> None:
    probe = FakeProbe(reading_of(used=None, total=None))
    settings = AgentSettings(token=None, gpu_memory_mib=128 * 1024)
    with serve_in_thread(create_app(settings, probe)) as url:
        body = httpx.get(f"{url}/status").json()
    assert body["is_idle"] is True
    assert body["processes"] == []
    assert body["memory_used_mib"] == 0
    # The device could not tell its total: the configured --gpu-memory stands in.
    assert body["memory_total_mib"] == 128 * 1024


def test_device_figures_win_over_fallbacks() -> None:
    probe = FakeProbe(reading_of(VLLM, used=9000, total=81920, unified=False))
    settings = AgentSettings(token=None, gpu_memory_mib=1)
    with serve_in_thread(create_app(settings, probe)) as url:
        body = httpx.get(f"{url}/status").json()
    assert (body["memory_used_mib"], body["memory_total_mib"]) == (9000, 81920)
    assert body["unified_memory"] is False


def test_many_concurrent_pollers_share_one_scan() -> None:
    probe = FakeProbe(reading_of(VLLM), delay_s=0.3)
    app = create_app(AgentSettings(token=TOKEN, cache_ttl_s=5.0), probe)

    async def poll_all(url: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(headers=AUTH, limits=limits, timeout=10) as client:
            return await asyncio.gather(*(client.get(f"{url}/status") for _ in range(50)))

    with serve_in_thread(app) as url:
        responses = asyncio.run(poll_all(url))
        again = httpx.get(f"{url}/status", headers=AUTH)
    assert all(r.status_code == 200 for r in responses)
    assert len({r.content for r in responses}) == 1
    assert again.content == responses[0].content  # served from the cache
    assert probe.calls == 1
    assert probe.max_concurrent == 1


def test_cache_expires_after_its_ttl() -> None:
    probe = FakeProbe(reading_of(VLLM))
    with serve_in_thread(create_app(AgentSettings(token=None, cache_ttl_s=1.0), probe)) as url:
        httpx.get(f"{url}/status")
        httpx.get(f"{url}/status")
        assert probe.calls == 1
        time.sleep(1.1)
        httpx.get(f"{url}/status")
        assert probe.calls == 2


def test_a_slow_probe_does_not_block_the_event_loop() -> None:
    probe = FakeProbe(reading_of(VLLM), delay_s=2.0)
    with serve_in_thread(create_app(AgentSettings(token=None), probe)) as url:
        slow = threading.Thread(target=httpx.get, args=(f"{url}/status",), kwargs={"timeout": 10})
        slow.start()
        while probe.calls == 0:
            time.sleep(0.01)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        # Answered while the 2 s scan still runs: the loop was not blocked.
        assert slow.is_alive() and probe.calls == 1
        slow.join()


@pytest.mark.parametrize(
    ("error", "fragment", "hint"),
    [
        (ProbeError("NVML: the GPU is lost", hint="reboot the host"), "the GPU is lost", "reboot"),
        (RuntimeError("pynvml blew up"), "RuntimeError: pynvml blew up", "agent's log"),
    ],
)
def test_probe_failure_is_503_never_idle(error: Exception, fragment: str, hint: str) -> None:
    probe = FakeProbe(error=error)
    with serve_in_thread(create_app(AgentSettings(token=TOKEN), probe)) as url:
        r = httpx.get(f"{url}/status", headers=AUTH)
        assert r.status_code == 503
        body = r.json()
        assert set(body) == {"error", "hint"}
        assert fragment in body["error"]
        assert hint in body["hint"]
        with (
            AgentClient(url, TOKEN, host_name="dgx") as client,
            pytest.raises(AgentUnavailable) as exc,
        ):
            client.status()
    assert fragment in exc.value.message
    assert url in exc.value.message
    assert "503" in exc.value.message
    assert hint in exc.value.hint


def test_probe_errors_are_cached_and_counted() -> None:
    probe = FakeProbe(error=ProbeError("nvidia-smi timed out"))
    with serve_in_thread(create_app(AgentSettings(token=None, cache_ttl_s=5.0), probe)) as url:
        for _ in range(5):
            assert httpx.get(f"{url}/status").status_code == 503
        metrics = httpx.get(f"{url}/metrics").text
    assert probe.calls == 1  # a failing probe is not hammered either
    assert "gpuctl_probe_errors_total 1\n" in metrics
    assert "gpuctl_probe_up 0\n" in metrics
    assert "gpuctl_gpu_memory_used_bytes{" not in metrics


@pytest.fixture
def keyword() -> str:
    return f"gpuctl-test-kw-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sleepers(keyword: str) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two real processes with ``keyword`` in their argv: one "loading", one "on the GPU"."""
    code = "import time; time.sleep(30)"
    procs = (
        subprocess.Popen([sys.executable, "-c", code, keyword, "loading"]),
        subprocess.Popen([sys.executable, "-c", code, keyword, "on-gpu"]),
    )
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_match_lists_starting_processes_but_not_gpu_ones(
    keyword: str, sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
) -> None:
    loading, on_gpu = sleepers
    gpu_proc = GpuProcess(pid=on_gpu.pid, command=f"python {keyword}", memory_mib=1000)
    probe = FakeProbe(reading_of(gpu_proc))
    with serve_in_thread(create_app(AgentSettings(token=TOKEN, cache_ttl_s=0.0), probe)) as url:
        body = httpx.get(
            f"{url}/status", params={"match": f"nothing-else,{keyword}"}, headers=AUTH
        ).json()
        upper = httpx.get(f"{url}/status", params={"match": keyword.upper()}, headers=AUTH).json()
        none = httpx.get(f"{url}/status", params={"match": "no-such-kw-xyz"}, headers=AUTH).json()
        plain = httpx.get(f"{url}/status", headers=AUTH).json()
        with AgentClient(url, TOKEN) as client:
            snap = client.status([keyword])
    assert set(body) == {*STATUS_KEYS, "starting"}
    assert [s["pid"] for s in body["starting"]] == [loading.pid]
    assert keyword in body["starting"][0]["command"]
    assert body["starting"][0]["command"].endswith("loading")
    assert [p["pid"] for p in body["processes"]] == [on_gpu.pid]
    assert [s["pid"] for s in upper["starting"]] == [loading.pid]  # case-insensitive
    assert none["starting"] == []
    assert "starting" not in plain
    assert snap.starting is not None
    assert [s.pid for s in snap.starting] == [loading.pid]


def test_match_scan_is_cached_per_keyword_set(keyword: str) -> None:
    probe = FakeProbe(reading_of())
    with serve_in_thread(create_app(AgentSettings(token=None, cache_ttl_s=5.0), probe)) as url:
        first = httpx.get(f"{url}/status", params={"match": keyword}).json()
        late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", keyword])
        try:
            cached = httpx.get(f"{url}/status", params={"match": keyword}).json()
            other_order = httpx.get(f"{url}/status", params={"match": f"{keyword},"}).json()
            fresh = httpx.get(f"{url}/status", params={"match": f"{keyword},zz-other"}).json()
        finally:
            late.kill()
            late.wait()
    assert first["starting"] == cached["starting"] == other_order["starting"] == []
    assert [s["pid"] for s in fresh["starting"]] == [late.pid]


def test_too_many_match_keywords_is_400(agent: str) -> None:
    match = ",".join(f"kw{i}" for i in range(40))
    r = httpx.get(f"{agent}/status", params={"match": match}, headers=AUTH)
    assert r.status_code == 400
    assert "at most 32" in r.json()["error"]


# --------------------------------------------------------------------------- /metrics, routing


def test_metrics_text() -> None:
    odd = GpuProcess(pid=77, command='python -c "x"\n' + "a" * 200, memory_mib=512, gpu=1)
    probe = FakeProbe(reading_of(VLLM, HIDDEN, odd, used=20000, total=131072))
    with serve_in_thread(create_app(AgentSettings(token=TOKEN), probe)) as url:
        httpx.get(f"{url}/status", headers=AUTH)
        httpx.get(f"{url}/nope", headers=AUTH)
        r = httpx.get(f"{url}/metrics", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    # Base units, per GPU (issue 11: the _mib names are gone, no aliases).
    gpu0 = 'gpu="0",uuid="",model=""'
    assert f"gpuctl_gpu_memory_used_bytes{{{gpu0}}} {20000 * 2**20}" in lines
    assert f"gpuctl_gpu_memory_total_bytes{{{gpu0}}} {131072 * 2**20}" in lines
    assert not [x for x in lines if "_mib" in x]
    assert "gpuctl_gpu_processes 3" in lines
    assert "gpuctl_probe_errors_total 0" in lines
    assert "gpuctl_probe_up 1" in lines
    # Per service and GPU (summed), gpu and service labels only: never a pid (a series
    # per start) nor the command line (unbounded, and it may carry secrets).
    assert f'gpuctl_process_memory_bytes{{gpu="0",service=""}} {(8200 + 34) * 2**20}' in lines
    assert f'gpuctl_process_memory_bytes{{gpu="1",service=""}} {512 * 2**20}' in lines
    assert "command=" not in r.text and "pid=" not in r.text
    assert 'gpuctl_agent_requests_total{path="/status"} 1' in lines
    assert 'gpuctl_agent_requests_total{path="/metrics"} 1' in lines
    assert 'gpuctl_agent_requests_total{path="other"} 1' in lines
    assert "# TYPE gpuctl_probe_errors_total counter" in lines


def test_unknown_path_is_404_and_wrong_method_405(agent: str) -> None:
    r = httpx.get(f"{agent}/nope", headers=AUTH)
    assert r.status_code == 404
    assert "no such endpoint: /nope" in r.json()["error"]
    r = httpx.post(f"{agent}/status", headers=AUTH, content=b"{}")
    assert r.status_code == 405
    assert r.headers["allow"] == "GET, HEAD"
    assert set(r.json()) == {"error", "hint"}
    r = httpx.head(f"{agent}/status", headers=AUTH)
    assert r.status_code == 200
    assert r.content == b""
    assert int(r.headers["content-length"]) > 0


def test_openapi_describes_every_route(probe: FakeProbe) -> None:
    app = create_app(AgentSettings(token=TOKEN), probe)
    assert isinstance(app, AgentApp)
    with serve_in_thread(app) as url:
        doc = httpx.get(f"{url}/openapi.json").json()
        status = httpx.get(f"{url}/status", headers=AUTH).json()
    # The /records endpoints route themselves (path parameters): test_agent_store.py.
    routed = {p for p in doc["paths"] if not p.startswith("/records")}
    assert routed == set(app.router.routes)
    for path, route in app.router.routes.items():
        assert {m.upper() for m in doc["paths"][path]} == set(route.handlers)
        for op in doc["paths"][path].values():  # every method of a path shares its auth
            public = op.get("security") == []
            assert public == (not route.auth)
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
    }
    schema = doc["components"]["schemas"]["Status"]
    assert set(schema["required"]) == set(status)
    assert set(schema["properties"]) == {*status, "starting"}
    proc = doc["components"]["schemas"]["GpuProcess"]
    assert set(proc["required"]) == set(status["processes"][0])


# --------------------------------------------------------------------------- server


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9400", ("127.0.0.1", 9400)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:9400", ("::1", 9400)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("9400", "HOST:PORT"),
        (":9400", "HOST:PORT"),
        ("host:", "port should be a number"),
        ("host:http", "port should be a number"),
        ("host:70000", "port should be a number"),
        ("::1:9400", "in brackets"),
        ("[::1]9400", "HOST:PORT"),
    ],
)
def test_parse_listen_rejects(text: str, fragment: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_listen(text)
    assert fragment in exc.value.message
    # The proxy's examples name its own port, never the agent's.
    with pytest.raises(UsageError) as exc:
        parse_listen(text, 9401)
    assert fragment in exc.value.message
    assert "9400" not in exc.value.message.replace(repr(text), ""), exc.value.message


def test_loopback_is_judged_on_the_address() -> None:
    assert resolve_listen("127.0.0.1:0").loopback
    assert resolve_listen("localhost:0").loopback
    assert not resolve_listen("0.0.0.0:0").loopback


def test_refuses_to_listen_off_loopback_without_a_token() -> None:
    with pytest.raises(UsageError) as exc:
        serve("0.0.0.0:9400", "sim", None)
    assert exc.value.message == "refusing to listen on 0.0.0.0:9400 without a token"
    assert exc.value.hint == "set GPUCTL_AGENT_TOKEN or pass --token-file"
    with pytest.raises(UsageError):
        serve("0.0.0.0:9400", "sim", "")


def test_cli_refuses_off_loopback_without_a_token(cli_env: Path) -> None:
    result = CliRunner().invoke(
        create_cli(), ["agent", "--listen", "0.0.0.0:9400", "--probe", "sim"]
    )
    assert result.exit_code == 2
    assert "refusing to listen on 0.0.0.0:9400 without a token" in result.output
    assert "hint: set GPUCTL_AGENT_TOKEN or pass --token-file" in result.output


def test_port_in_use_is_a_clear_error(cli_env: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(UsageError) as exc:
            serve(f"127.0.0.1:{port}", "sim", TOKEN)
        assert exc.value.message == f"cannot listen on 127.0.0.1:{port}: address already in use"
        assert "--listen" in exc.value.hint
        result = CliRunner().invoke(
            create_cli(), ["agent", "--listen", f"127.0.0.1:{port}", "--probe", "sim"]
        )
    assert result.exit_code == 2
    assert "address already in use" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--gpu-memory", "lots"], "--gpu-memory: expected a size"),
        (["--cache-ttl", "soon"], "--cache-ttl:"),
        (["--log-level", "chatty"], "--log-level:"),
        (["--listen", "nowhere"], "bad --listen 'nowhere'"),
    ],
)
def test_cli_rejects_bad_options(cli_env: Path, args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(create_cli(), ["agent", "--probe", "sim", *args])
    assert result.exit_code == 2
    assert fragment in result.output


def test_token_file_is_stripped_and_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    assert read_token_file(path) == TOKEN
    assert capsys.readouterr().err == ""
    path.chmod(0o644)
    assert read_token_file(path) == TOKEN
    err = capsys.readouterr().err
    assert "readable by group/others" in err
    assert "chmod 600" in err
    path.write_text("\n")
    with pytest.raises(UsageError, match="is empty"):
        read_token_file(path)
    with pytest.raises(UsageError, match="cannot read the token file"):
        read_token_file(tmp_path / "missing")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# --------------------------------------------------------------------------- end to end


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the agent exited with {proc.returncode}: {err}")
        try:
            if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pytest.fail("the agent did not answer /healthz in time")


def _wait_for(read: Callable[[], Snapshot], done: Callable[[Snapshot], bool]) -> Snapshot:
    deadline = time.monotonic() + 15
    while True:
        snap = read()
        if done(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["python -m gpuctl", "console script"])
def test_installed_cli_serves_the_sim_gpu(tmp_path: Path, how: str) -> None:
    exe = [sys.executable, "-m", "gpuctl"] if how == "python -m gpuctl" else [gpuctl_exe()]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "GPUCTL_AGENT_TOKEN": TOKEN,
        "GPUCTL_STATE_DIR": str(tmp_path / "state"),
        "GPUCTL_CONFIG": str(tmp_path / "config.toml"),
        "XDG_STATE_HOME": str(tmp_path / "xdg-state"),
    }
    env.pop("GPUCTL_SIM_DIR", None)
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()  # named with --sim-dir, it must exist (a missing one is refused)
    proc = subprocess.Popen(
        [
            *exe,
            "agent",
            "--probe",
            "sim",
            "--listen",
            f"127.0.0.1:{port}",
            "--sim-dir",
            str(sim_dir),
            "--cache-ttl",
            "100ms",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(url, proc)
        assert httpx.get(f"{url}/status").status_code == 401
        r = httpx.get(f"{url}/status", headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["probe"] == "sim"
        assert body["is_idle"] is True
        assert body["processes"] == []
        assert body["state_dir"] == str(tmp_path / "state")
        assert body["host"]["hostname"] == socket.gethostname()
        with AgentClient(url, TOKEN) as client:
            assert client.status().probe == "sim"
            assert client.healthz()["ok"] is True
            # A real process that holds simulated GPU memory shows up with its real pid.
            name = f"e2e-{uuid.uuid4().hex[:8]}"
            hold = subprocess.Popen(
                [sys.executable, "-m", "gpuctl.sim.hold", "--name", name, "--memory", "2GiB"],
                env={**env, "GPUCTL_SIM_DIR": str(sim_dir)},
                stdout=subprocess.DEVNULL,
            )
            try:
                snap = _wait_for(lambda: client.status([name]), lambda s: not s.is_idle)
            finally:
                hold.terminate()
                hold.wait(10)
            [held] = snap.processes
            assert (held.pid, held.memory_mib) == (hold.pid, 2048)
            assert held.command is not None and name in held.command
            assert snap.starting == ()  # on the GPU, so not "starting"
            assert _wait_for(client.status, lambda s: s.is_idle).processes == ()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert out == ""  # data on stdout only; the agent has none
    assert f"gpuctl agent: listening on {url} (probe sim, token required)" in err
    assert "Traceback" not in err
    json.dumps(body)  # plain JSON all the way


@pytest.mark.e2e
def test_a_missing_sim_dir_is_refused_never_an_empty_gpu(tmp_path: Path) -> None:
    """`agent --sim-dir` naming a folder that is not there is a typo: the agent refuses to
    start (exit 4, naming the folder and the fix) rather than serve an empty, free GPU.
    A folder removed under a running agent makes /status 503 and `gpuctl status` UNKNOWN."""
    missing = tmp_path / "no-such-sim"
    env = {**os.environ, "GPUCTL_AGENT_TOKEN": TOKEN, "GPUCTL_STATE_DIR": str(tmp_path / "st")}
    env.pop("GPUCTL_SIM_DIR", None)
    port = free_port()
    base = [gpuctl_exe(), "agent", "--probe", "sim", "--listen", f"127.0.0.1:{port}"]
    r = subprocess.run(
        [*base, "--sim-dir", str(missing)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 4, r.stderr
    assert f"gpuctl: error: the simulated GPU's folder {missing} does not exist" in r.stderr
    assert f"hint: check the path; for an empty simulated GPU there: mkdir -p {missing}" in r.stderr
    assert "Traceback" not in r.stderr and not missing.exists()

    there = tmp_path / "sim"
    there.mkdir()
    proc = subprocess.Popen(
        [*base, "--sim-dir", str(there), "--cache-ttl", "100ms"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        assert httpx.get(f"{url}/status", headers=AUTH).json()["is_idle"] is True
        there.rmdir()
        r2 = httpx.get(f"{url}/status", params={"fresh": "1"}, headers=AUTH)
        assert r2.status_code == 503, r2.text
        assert f"folder {there} does not exist" in r2.text
        cfg = tmp_path / "config.toml"
        cfg.write_text(f'[hosts.sim]\nagent = "{url}"\ntoken_env = "GPUCTL_AGENT_TOKEN"\n')
        st = subprocess.run(
            [gpuctl_exe(), "status", "--json"],
            env={**env, "GPUCTL_CONFIG": str(cfg)}, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert st.returncode == 4, st.stderr
        (host,) = json.loads(st.stdout)["hosts"]
        assert host["ok"] is False and host["is_idle"] is None
        assert f"folder {there} does not exist" in host["error"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def test_exclude_leaves_out_the_callers_own_tree_on_the_same_host(
    keyword: str, sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
) -> None:
    loading, _ = sleepers
    probe = FakeProbe(reading_of())
    boot_id = host_identity().boot_id
    with serve_in_thread(create_app(AgentSettings(token=TOKEN, cache_ttl_s=0.0), probe)) as url:

        def starting(**params: str) -> list[int]:
            body = httpx.get(f"{url}/status", params={"match": keyword, **params}, headers=AUTH)
            return [s["pid"] for s in body.json()["starting"]]

        assert loading.pid in starting()
        assert loading.pid not in starting(exclude=str(loading.pid), boot_id=boot_id)
        # pids from another machine mean nothing here: ignored.
        assert loading.pid in starting(exclude=str(loading.pid), boot_id="another-host")
        bad = httpx.get(
            f"{url}/status",
            params={"match": keyword, "exclude": "x", "boot_id": boot_id},
            headers=AUTH,
        )
        assert bad.status_code == 400


def test_recorded_servers_are_reported_whatever_their_command(tmp_path: Path) -> None:
    """A record names its server's pid: the agent lists it under `starting` even when its
    command line carries none of the keywords (`services.chat` running `vllm serve`)."""
    from gpuctl.adapters.store import holder_here
    from gpuctl.adapters.store.direct import DirectStore

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store = DirectStore(tmp_path)
        holder = holder_here("test")
        store.acquire("chat", holder, 60)
        store.release(
            "chat",
            holder.id,
            RecordUpdate.from_wire(
                {"phase": "starting", "handle": {"kind": "process", "pid": server.pid}}
            ),
        )
        app = create_app(
            AgentSettings(token=TOKEN, cache_ttl_s=0.0, state_dir=str(tmp_path)),
            FakeProbe(reading_of()),
        )
        with serve_in_thread(app) as url:
            body = httpx.get(f"{url}/status", params={"match": "chat"}, headers=AUTH).json()
        assert server.pid in [s["pid"] for s in body["starting"]]
    finally:
        server.kill()
        server.wait()
