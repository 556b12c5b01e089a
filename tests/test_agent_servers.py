"""The servers the agent reports beyond the GPU's process list, against the real agent on
loopback, real processes and real record files.

- a start whose caller died before recording it is found by its start nonce;
- a ``starting`` record whose health URL answers moves to ``running`` by itself;
- clients of the original ``/status`` see loading servers (``on_gpu: false``) and
  ``is_idle: false`` while gpuctl's own accounting stays as it was;
- other processes' secrets never leave the agent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.core.health_reach import parse_ports
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.status_wire import parse_status
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread
from tests.ensure_helpers import LoopbackHealth

TOKEN = "servers-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLEEPER = "import time; time.sleep(120)"


@pytest.fixture
def procs() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", SLEEPER, *args], env=env)
        started.append(p)
        return p

    yield spawn
    for p in started:
        p.kill()
        p.wait()


def agent(tmp_path: Path, **settings: Any) -> Any:
    state = tmp_path / "state"
    return serve_in_thread(
        create_app(
            AgentSettings(token=TOKEN, cache_ttl_s=0.2, state_dir=str(state), **settings),
            FakeProbe(reading_of()),
        )
    )


def status(url: str, **params: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/status", params={**params, "fresh": "1"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def starting_record(state: Path, service: str, **update: Any) -> None:
    """A start under way whose caller is gone: phase starting, no lease, maybe no handle."""
    store = DirectStore(state)
    h = holder_here("test")
    assert store.acquire(service, h, 60)[0]
    store.release(service, h.id, RecordUpdate.from_wire({"phase": "starting", **update}))


# --------------------------------------------------------------------------- start nonce


def test_a_start_without_a_handle_is_found_by_its_nonce(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    nonce = uuid.uuid4().hex
    starting_record(tmp_path / "state", "chat", start_nonce=nonce)
    # Its command line names nothing a keyword would match.
    server = procs(env={**os.environ, "GPUCTL_START_NONCE": nonce})
    decoy = procs(env={**os.environ, "GPUCTL_START_NONCE": uuid.uuid4().hex})
    with agent(tmp_path) as url:
        assert wait_for(
            lambda: (
                server.pid in [s["pid"] for s in status(url, match="nothing-matches")["starting"]]
            )
        )
        body = status(url, match="nothing-matches")
        assert decoy.pid not in [s["pid"] for s in body["starting"]]
        # For the original API's clients it is in `processes`, off the GPU.
        plain = status(url)
        [entry] = [p for p in plain["processes"] if p["pid"] == server.pid]
        assert (entry["on_gpu"], entry["memory_mib"]) == (False, 0)
        assert plain["is_idle"] is False


def test_no_nonce_process_no_report(tmp_path: Path) -> None:
    starting_record(tmp_path / "state", "chat", start_nonce=uuid.uuid4().hex)
    with agent(tmp_path) as url:
        body = status(url, match="nothing-matches")
        assert body["starting"] == [] and body["processes"] == []
        # No process to report, but the record promises the GPU: not idle.
        assert body["is_idle"] is False


# --------------------------------------------------------------------------- starting -> running


def test_a_healthy_starting_server_becomes_running(tmp_path: Path) -> None:
    health = LoopbackHealth(503)
    store = DirectStore(tmp_path / "state")
    with (
        serve_in_thread(health) as server,
        agent(tmp_path, health_ports=parse_ports(server.rpartition(":")[2])) as _url,
    ):
        starting_record(tmp_path / "state", "chat", health=f"{server}/health")
        starting_record(tmp_path / "state", "silent")  # no health URL: left alone
        time.sleep(1.5)  # several rounds of the agent's loop while the server loads
        assert store.get("chat").phase is Phase.STARTING
        health.status = 200
        assert wait_for(lambda: store.get("chat").phase is Phase.RUNNING)
        assert store.get("silent").phase is Phase.STARTING


def test_a_stopped_record_is_never_revived(tmp_path: Path) -> None:
    health = LoopbackHealth(503)
    health.status = 200
    store = DirectStore(tmp_path / "state")
    h = holder_here("test")
    store.acquire("chat", h, 60)
    with serve_in_thread(health) as server:
        store.release(
            "chat", h.id, RecordUpdate.from_wire({"phase": "stopped", "health": f"{server}/health"})
        )
        with agent(tmp_path, health_ports=parse_ports(server.rpartition(":")[2])):
            time.sleep(1.5)
            assert store.get("chat").phase is Phase.STOPPED


# --------------------------------------------------------------------------- the original API


def test_original_clients_see_loading_servers(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    kw = f"legacykw{uuid.uuid4().hex[:8]}"
    loading = procs(kw)
    with agent(tmp_path, match=(kw,), match_max_age_s=900.0) as url:
        body = status(url)
        # What a client of the original contract does: keywords in processes[].command.
        mine = [p for p in body["processes"] if kw in (p["command"] or "")]
        assert [p["pid"] for p in mine] == [loading.pid]
        assert mine[0]["memory_mib"] == 0 and mine[0]["on_gpu"] is False
        assert body["is_idle"] is False
        # gpuctl's own reading: nothing holds the GPU; the server is only starting.
        snap = parse_status(status(url, match=kw))
        assert snap.gpu_processes == ()
        assert [s.pid for s in snap.starting or ()] == [loading.pid]
        loading.kill()
        loading.wait()
        assert wait_for(lambda: status(url)["is_idle"] is True)


def test_old_matches_are_not_loading(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    kw = f"legacykw{uuid.uuid4().hex[:8]}"
    with agent(tmp_path, match=(kw,), match_max_age_s=4.0) as url:
        procs(kw)
        # Young: loading. Past --match-max-age: a long-running process, not a start.
        assert wait_for(lambda: status(url)["is_idle"] is False, timeout_s=4.0)
        assert wait_for(lambda: status(url)["is_idle"] is True, timeout_s=30.0)


def test_without_match_keywords_nothing_is_added(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    kw = f"legacykw{uuid.uuid4().hex[:8]}"
    procs(kw)
    with agent(tmp_path) as url:
        assert status(url)["is_idle"] is True


# --------------------------------------------------------------------------- secrets


def test_other_processes_secrets_never_leave_the_agent(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    kw = f"secretkw{uuid.uuid4().hex[:8]}"
    secrets = [f"sk-{uuid.uuid4().hex}" for _ in range(4)]
    procs(
        kw,
        f"--ServerApp.token={secrets[0]}",
        "--api-key",
        secrets[1],
        "Authorization: Bearer " + secrets[2],
        f"HF_TOKEN={secrets[3]}",
    )
    with agent(tmp_path, match=(kw,)) as url:
        texts = [
            httpx.get(f"{url}/status", params={"match": kw}, headers=AUTH).text,
            httpx.get(f"{url}/status", headers=AUTH).text,
            httpx.get(f"{url}/metrics", headers=AUTH).text,
        ]
    assert kw in texts[0] and kw in texts[1]
    assert "--ServerApp.token=***" in texts[0]
    for text in texts:
        for secret in secrets:
            assert secret not in text


def test_the_read_token_sees_no_secret_of_any_process_a_few_letters_match(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """Issue 17: 12 forms leaked through ``/status?match=`` to the read-only token, and a
    few letters match unrelated processes too, so every listed process is redacted. Real
    processes carry each form on their command lines; each secret showed whole before.
    The 22 forms an attack review found after that (``-HX-Auth-Token:X``, ``-u user:X``,
    code, percent-encoded names) are here too: each showed whole before they were fixed."""
    from tests.test_redact import leaked_after_17, leaked_forms

    kw = f"leakkw{uuid.uuid4().hex[:8]}"
    secret = f"Se7{uuid.uuid4().hex[:12]}"
    forms = leaked_forms(secret) + leaked_after_17(secret)
    pids = [procs(kw, *form).pid for form in forms]
    read = {"Authorization": "Bearer read-only-token"}
    with agent(tmp_path, read_token="read-only-token") as url:
        for match in (kw, "leak", "py"):  # its own keyword; a few letters
            r = httpx.get(f"{url}/status", params={"match": match, "fresh": "1"}, headers=read)
            assert r.status_code == 200, r.text
            listed = {s["pid"]: s["command"] for s in r.json()["starting"]}
            assert set(pids) <= set(listed), match
            assert secret not in r.text
            for pid in pids:
                assert "***" in listed[pid] and kw in listed[pid], listed[pid]


# --------------------------------------------------------------------------- the installed CLI


@pytest.mark.e2e
def test_the_installed_agent_takes_match_and_a_read_token(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    from gpuctl.sim.host import free_port
    from tests.conftest import gpuctl_exe

    kw = f"clikw{uuid.uuid4().hex[:8]}"
    read_file = tmp_path / "read.token"
    read_file.write_text("read-only-secret\n")
    read_file.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "GPUCTL_AGENT_TOKEN": TOKEN,
        "GPUCTL_STATE_DIR": str(tmp_path / "state"),
        "GPUCTL_CONFIG": str(tmp_path / "config.toml"),
    }
    (tmp_path / "sim").mkdir()  # named with --sim-dir, it must exist
    agent_proc = subprocess.Popen(
        [gpuctl_exe(), "agent", "--probe", "sim", "--listen", f"127.0.0.1:{port}",
         "--sim-dir", str(tmp_path / "sim"), "--cache-ttl", "200ms",
         "--read-token-file", str(read_file), "--match", f"{kw},other", "--match-max-age", "10m"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert wait_for(lambda: _answers(url, agent_proc), timeout_s=30)
        loading = procs(kw)
        ro = {"Authorization": "Bearer read-only-secret"}
        assert wait_for(
            lambda: (
                loading.pid
                in [
                    p["pid"]
                    for p in httpx.get(f"{url}/status", headers=ro).json()["processes"]
                    if p["on_gpu"] is False
                ]
            )
        )
        assert httpx.get(f"{url}/metrics", headers=ro).status_code == 200
        write = httpx.post(f"{url}/records/chat/touch", headers=ro, json={})
        assert write.status_code == 403
        assert httpx.post(f"{url}/records/chat/touch", headers=AUTH, json={}).status_code == 200
    finally:
        agent_proc.terminate()
        agent_proc.communicate(timeout=10)


def _answers(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        err = proc.stderr.read().decode() if proc.stderr else ""
        pytest.fail(f"the agent exited with {proc.returncode}: {err}")
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_agent_log_keeps_secrets_out() -> None:
    import io
    import logging

    from gpuctl.agent.server import log_handler

    stream = io.StringIO()
    handler = log_handler(stream)
    logger = logging.getLogger("gpuctl.agent.test-redaction")
    logger.addHandler(handler)
    try:
        logger.warning(
            "the record of %r cannot be read: %s", "chat", "health https://u:pa55w0rd@h/x"
        )
        logger.warning("server: vllm serve m --api-key %s", "sk-live-123456")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "pa55w0rd" not in text and "sk-live-123456" not in text
    assert "https://u:***@h/x" in text and "--api-key ***" in text


# --------------------------------------------------------------------------- direct writes


def test_a_write_straight_to_the_files_is_seen_at_once(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """A ``DirectStore`` on the host (cron, a user without the agent) writes the record
    files itself: the agent's reading cache must not hide what it wrote. The cache lives
    a minute here, so only noticing the write can show it."""
    state = tmp_path / "state"
    server = procs()
    app = create_app(
        AgentSettings(token=TOKEN, cache_ttl_s=60.0, state_dir=str(state)),
        FakeProbe(reading_of()),
    )

    def cached(**params: str) -> dict[str, Any]:
        r = httpx.get(f"{url}/status", params=params, headers=AUTH)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    with serve_in_thread(app) as url:
        assert cached(match="nothing-matches")["starting"] == []  # now in the cache
        assert cached()["is_idle"] is True
        store = DirectStore(state)
        h = holder_here("cron")
        assert store.acquire("chat", h, 60)[0]
        handle = {"kind": "process", "pid": server.pid}
        store.release("chat", h.id, RecordUpdate.from_wire({"phase": "starting", "handle": handle}))
        body = cached(match="nothing-matches")
        assert [s["pid"] for s in body["starting"]] == [server.pid]
        plain = cached()
        assert server.pid in [p["pid"] for p in plain["processes"]]
        assert plain["is_idle"] is False
        # And a second write in the same moment (the folder's mtime may not move).
        store.acquire("chat", h, 60)
        store.release("chat", h.id, RecordUpdate.from_wire({"phase": "stopped", "handle": None}))
        assert cached(match="nothing-matches")["starting"] == []
