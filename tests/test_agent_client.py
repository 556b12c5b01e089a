"""The agent client against real loopback servers that misbehave, and against the real app.

Every case runs through both clients (sync and async): they share the parsing, and a
difference between them would be a bug.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gpuctl.adapters.agent_client import AgentClient, AsyncAgentClient
from gpuctl.adapters.http_clients import http_client
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.core.snapshot import GpuProcess, Snapshot
from gpuctl.errors import AgentAuthError, AgentUnavailable, ExitCode
from gpuctl.sim.host import free_port
from tests.agent_helpers import (
    FakeProbe,
    canned,
    raw_server,
    read_request,
    reading_of,
    serve_in_thread,
)

TOKEN = "tok-123"
StatusCall = Callable[..., Snapshot]


@pytest.fixture(params=["sync", "async"])
def status(request: pytest.FixtureRequest) -> StatusCall:
    """``status(url, token=..., timeout_s=..., host_name=..., match=...)`` with one client kind."""

    def sync(
        url: str, token: str | None = TOKEN, match: tuple[str, ...] = (), **kw: Any
    ) -> Snapshot:
        with AgentClient(url, token, **kw) as client:
            return client.status(match)

    def run_async(
        url: str, token: str | None = TOKEN, match: tuple[str, ...] = (), **kw: Any
    ) -> Snapshot:
        async def go() -> Snapshot:
            async with AsyncAgentClient(url, token, **kw) as client:
                return await client.status(match)

        return asyncio.run(go())

    return sync if request.param == "sync" else run_async


def failure(call: Callable[[], object]) -> AgentUnavailable:
    with pytest.raises(AgentUnavailable) as exc:
        call()
    assert exc.value.exit_code == ExitCode.UNKNOWN
    assert "\n" not in exc.value.message  # one clear line
    return exc.value


# --------------------------------------------------------------------------- transport failures


def test_connection_refused(status: StatusCall) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    err = failure(lambda: status(url))
    assert err.message == f"connection refused by {url}"
    assert "is `gpuctl agent` running on that host" in err.hint


def test_server_that_never_answers_times_out(status: StatusCall) -> None:
    stop = threading.Event()

    def hang(conn: socket.socket) -> None:
        read_request(conn)
        stop.wait(10)

    with raw_server(hang) as url:
        try:
            err = failure(lambda: status(url, timeout_s=0.3))
        finally:
            stop.set()
    assert err.message == f"the agent at {url} did not answer within 0.3s"
    assert "gpuctl agent" in err.hint


def test_dns_failure(status: StatusCall) -> None:
    url = "http://no-such-host.invalid:9400"
    err = failure(lambda: status(url))
    assert "cannot resolve the agent's host name 'no-such-host.invalid'" in err.message
    assert "`agent` URL" in err.hint


def test_garbage_bytes(status: StatusCall) -> None:
    def garbage(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"\x00\x01\x02 SSH-2.0-OpenSSH_9.6\r\n\r\n")
        conn.close()

    with raw_server(garbage) as url:
        err = failure(lambda: status(url))
    assert err.message.startswith(f"the agent at {url} broke off or did not speak HTTP")
    assert "right host and port" in err.hint


def test_server_that_closes_at_once(status: StatusCall) -> None:
    def slam(conn: socket.socket) -> None:
        read_request(conn)
        conn.close()

    with raw_server(slam) as url:
        err = failure(lambda: status(url))
    assert url in err.message


# --------------------------------------------------------------------------- off-contract answers


def test_401_is_an_auth_error_naming_the_host(status: StatusCall) -> None:
    probe = FakeProbe(reading_of())
    with serve_in_thread(create_app(AgentSettings(token=TOKEN), probe)) as url:
        with pytest.raises(AgentAuthError) as exc:
            status(url, token="wrong", host_name="dgx")
        assert exc.value.message == f"the agent at {url} refused our token (HTTP 401)"
        assert exc.value.hint == "check hosts.dgx.token_env / token_file"
        with pytest.raises(AgentAuthError) as exc:
            status(url, token=None)
        assert "requires a token and we have none" in exc.value.message
        assert "token_env / token_file" in exc.value.hint
    assert probe.calls == 0


def test_403_is_an_auth_error_too(status: StatusCall) -> None:
    body = json.dumps({"error": "forbidden", "hint": ""}).encode()
    with (
        raw_server(canned("403 Forbidden", body, "application/json")) as url,
        pytest.raises(AgentAuthError) as exc,
    ):
        status(url)
    assert "HTTP 403" in exc.value.message


def test_html_error_page(status: StatusCall) -> None:
    page = b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1><hr>nginx</body></html>"
    with raw_server(canned("502 Bad Gateway", page, "text/html")) as url:
        err = failure(lambda: status(url))
    assert err.message == f"{url} answered with HTML (HTTP 502), not the gpuctl agent API"
    assert "right host and port" in err.hint


def test_html_without_a_content_type(status: StatusCall) -> None:
    page = b"\n<html><head><title>Jupyter</title></head></html>"
    with raw_server(canned("200 OK", page, "application/octet-stream")) as url:
        err = failure(lambda: status(url))
    assert "answered with HTML (HTTP 200)" in err.message


def test_5xx_passes_the_agents_error_through(status: StatusCall) -> None:
    body = json.dumps(
        {"error": "the GPU probe failed: NVML lost the GPU", "hint": "reboot"}
    ).encode()
    with raw_server(canned("503 Service Unavailable", body, "application/json")) as url:
        err = failure(lambda: status(url))
    assert (
        err.message
        == f"the agent at {url} answered HTTP 503: the GPU probe failed: NVML lost the GPU"
    )
    assert err.hint == "reboot"


def test_5xx_without_the_agents_json(status: StatusCall) -> None:
    with raw_server(canned("500 Internal Server Error", b"oops", "text/plain")) as url:
        err = failure(lambda: status(url))
    assert err.message == f"{url} answered HTTP 500 without the agent's JSON error"


def test_a_body_that_is_not_json(status: StatusCall) -> None:
    with raw_server(canned("200 OK", b"\xff\xfe not json {", "application/json")) as url:
        err = failure(lambda: status(url))
    assert err.message == f"{url} answered something that is not JSON (HTTP 200)"


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"is_idle": True}, "Object missing required field `processes`"),
        ([1, 2, 3], "Expected `object`, got `array`"),
        ({"is_idle": "yes", "processes": []}, "is_idle: Expected `bool`, got `str`"),
        (
            {"is_idle": False, "processes": [{"command": "x"}]},
            "processes[0]: Object missing required field `pid`",
        ),
        # The seed's bug in reverse: "idle" while a process holds the GPU.
        (
            {"is_idle": True, "processes": [{"pid": 1, "command": "vllm", "memory_mib": 80000}]},
            "is_idle disagrees with processes",
        ),
    ],
)
def test_json_that_breaks_the_contract(status: StatusCall, payload: object, problem: str) -> None:
    with raw_server(canned("200 OK", json.dumps(payload).encode(), "application/json")) as url:
        err = failure(lambda: status(url))
    assert (
        err.message == f"{url} answered something that is not the gpuctl status contract: {problem}"
    )


def test_not_idle_with_no_process_is_the_agents_word(status: StatusCall) -> None:
    """A lease held before its server exists, or memory no listed process accounts for:
    the agent says is_idle false with no process, and a client takes it as not idle
    (it refused such an answer while is_idle meant exactly "no process")."""
    payload = {"is_idle": False, "processes": []}
    with raw_server(canned("200 OK", json.dumps(payload).encode(), "application/json")) as url:
        snap = status(url)
    assert snap.is_idle is False and snap.processes == ()


# --------------------------------------------------------------------------- the happy path


@pytest.fixture
def real_agent() -> Iterator[tuple[str, FakeProbe]]:
    vllm = GpuProcess(pid=4242, command="vllm serve Qwen", memory_mib=80000, user="me")
    probe = FakeProbe(reading_of(vllm, used=None, total=None))
    settings = AgentSettings(token=TOKEN, state_dir="/srv/gpuctl", gpu_memory_mib=131072)
    with serve_in_thread(create_app(settings, probe)) as url:
        yield url, probe


def test_happy_path_against_the_real_app(
    status: StatusCall, real_agent: tuple[str, FakeProbe]
) -> None:
    url, _ = real_agent
    snap = status(url + "/", match=("zz-no-such-process-kw",))
    assert not snap.is_idle
    assert snap.processes == (
        GpuProcess(pid=4242, command="vllm serve Qwen", memory_mib=80000, user="me"),
    )
    assert (snap.memory_used_mib, snap.memory_total_mib) == (80000, 131072)
    assert snap.probe == "fake"
    assert snap.state_dir == "/srv/gpuctl"
    assert snap.starting == ()
    assert snap.host is not None and snap.host.hostname == socket.gethostname()


def test_sync_client_keeps_the_connection_alive() -> None:
    body = json.dumps({"is_idle": True, "processes": []}).encode()
    connections: list[int] = []
    requests: list[int] = []

    def keep_alive(conn: socket.socket) -> None:
        connections.append(1)
        while read_request(conn):
            requests.append(1)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )

    with raw_server(keep_alive) as url, AgentClient(url, TOKEN) as client:
        for _ in range(5):
            client.status()
    assert (len(connections), len(requests)) == (1, 5)


def test_healthz(real_agent: tuple[str, FakeProbe]) -> None:
    url, _ = real_agent
    with AgentClient(url, None) as client:
        assert client.healthz() == {"ok": True, "version": "0.1.0"}

    async def go() -> dict[str, Any]:
        async with AsyncAgentClient(url, None) as client:
            return await client.healthz()

    assert asyncio.run(go())["ok"] is True


def test_healthz_of_something_else() -> None:
    with raw_server(canned("200 OK", b'{"status": "ok"}', "application/json")) as url:
        err = failure(lambda: AgentClient(url, None).healthz())
    assert "not the gpuctl agent's" in err.message


def test_client_sends_the_bearer_token_and_match() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"is_idle": True, "processes": [], "starting": []})

    client = AgentClient("http://dgx:9400", TOKEN, transport=httpx.MockTransport(handler))
    snap = client.status(["vllm", "", "translategemma"])
    assert snap.is_idle and snap.starting == ()
    assert seen[0].headers["authorization"] == f"Bearer {TOKEN}"
    url = seen[0].url
    assert url.path == "/status"
    assert url.params["match"] == "vllm,translategemma"
    # The caller names its own process tree and its pipeline, for the agent to leave out
    # when it runs on this same machine (the boot id says which machine). Not its pipes:
    # a background job writing into the same pipe is a server.
    from gpuctl.adapters.pipeline import own_pipeline
    from gpuctl.adapters.procinfo import host_identity, own_lineage

    mine = dict.fromkeys([*own_lineage(), *own_pipeline()])
    assert url.params["exclude"] == ",".join(map(str, mine))
    assert "pipes" not in url.params
    assert url.params["boot_id"] == host_identity().boot_id


# --------------------------------------------------------------------------- one client per command


def test_plain_http_sets_up_no_tls_and_https_does(
    real_agent: tuple[str, FakeProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ssl

    made: list[object] = []
    real = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    url, _ = real_agent
    shared = http_client(3.0)
    try:
        AgentClient(url, TOKEN, client=shared).status()
        assert made == []  # http:// loaded no CA bundle
        # The same client, asked an https:// URL, verifies: it sets TLS up then, and
        # the plain-HTTP agent cannot pass for a TLS server.
        err = failure(
            lambda: AgentClient(url.replace("http:", "https:"), TOKEN, client=shared).status()
        )
        assert "https://" in err.message
        assert len(made) == 1
    finally:
        shared.close()


def test_a_shared_client_keeps_the_token_to_the_agent() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"is_idle": True, "processes": []})

    shared = http_client(3.0, transport=httpx.MockTransport(handler))
    with AgentClient("http://dgx:9400", TOKEN, client=shared) as client:
        client.status()
    shared.get("http://dgx:8000/health")  # a health check through the same client
    assert seen[0].headers["authorization"] == f"Bearer {TOKEN}"
    assert "authorization" not in seen[1].headers
    assert not shared.is_closed  # the command owns it, not the agent client
    shared.close()


def test_the_read_token_serves_gets_when_there_is_no_write_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"is_idle": True, "processes": []})

    mock = httpx.MockTransport(handler)
    AgentClient("http://dgx:9400", None, read_token="ro", transport=mock).status()
    AgentClient("http://dgx:9400", "rw", read_token="ro", transport=mock).status()
    assert [r.headers["authorization"] for r in seen] == ["Bearer ro", "Bearer rw"]
