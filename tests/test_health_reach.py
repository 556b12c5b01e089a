"""The agent fetches a record's health URL only on this machine, on ``--health-ports``.

Against the real agent on loopback and real record files: a health URL on a port the
agent was not given is never fetched (a loopback server counts zero requests), one off
this machine is refused before any connection (a guard at httpx's transports refuses
every request off loopback, so a broken rule shows as an attempt, never as traffic),
and neither changes the record's phase, on the start-completion loop or the heal loop.
The rule itself (``core.health_reach``) and the option's parsing are checked as units.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.core.health_reach import DEFAULT_HEALTH_PORTS, HealthReach, parse_ports
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread
from tests.ensure_helpers import LoopbackHealth

TOKEN = "reach-token"
# TEST-NET-1 (RFC 5737): documentation only, never routed. It is only ever a record's value.
FAR = "192.0.2.1"


@pytest.fixture
def off_loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every URL httpx was asked to fetch off loopback in this test; each is refused with
    a ConnectError before any socket opens, so a test never sends traffic off loopback."""
    asked: list[str] = []

    def off(request: httpx.Request) -> bool:
        host = request.url.host
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host != "localhost"

    sync_send = httpx.HTTPTransport.handle_request
    async_send = httpx.AsyncHTTPTransport.handle_async_request

    def guarded(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        if off(request):
            asked.append(str(request.url))
            raise httpx.ConnectError("off loopback (test guard)", request=request)
        return sync_send(self, request)

    async def aguarded(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        if off(request):
            asked.append(str(request.url))
            raise httpx.ConnectError("off loopback (test guard)", request=request)
        return await async_send(self, request)

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", guarded)
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", aguarded)
    yield asked


def port_of(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None
    return port


def agent(tmp_path: Path, ports: str) -> Any:
    settings = AgentSettings(
        token=TOKEN,
        cache_ttl_s=0.2,
        state_dir=str(tmp_path / "state"),
        health_ports=parse_ports(ports),
    )
    return serve_in_thread(create_app(settings, FakeProbe(reading_of())))


def write_record(state: Path, service: str, **update: Any) -> None:
    """A record as a caller that has gone left it (no lease)."""
    store = DirectStore(state)
    h = holder_here("test")
    assert store.acquire(service, h, 60)[0]
    store.release(service, h.id, RecordUpdate.from_wire(update))


def settle(store: DirectStore, service: str, timeout_s: float = 15.0) -> Phase:
    """Wait for ``service`` to run (the control record: the agent's loop has run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and store.get(service).phase is not Phase.RUNNING:
        time.sleep(0.1)
    return store.get(service).phase


# --------------------------------------------------------------------------- the real agent


def test_a_health_url_on_a_port_not_given_is_never_fetched(
    tmp_path: Path, off_loopback: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    allowed, refused = LoopbackHealth(), LoopbackHealth()
    store = DirectStore(tmp_path / "state")
    caplog.set_level(logging.WARNING, logger="gpuctl.agent")
    with (
        serve_in_thread(allowed) as ok_url,
        serve_in_thread(refused) as no_url,
        agent(tmp_path, str(port_of(ok_url))),
    ):
        # The heal loop's path: a preempted docker record, its process not
        # visible here, so only its health would speak (200 would mean running).
        write_record(
            store.state_dir,
            "victim",
            phase="preempted",
            handle={"kind": "docker", "container_id": "c0ffee"},
            health=f"{no_url}/health",
        )
        # The start-completion loop's path.
        write_record(store.state_dir, "chat", phase="starting", health=f"{no_url}/health")
        write_record(store.state_dir, "control", phase="starting", health=f"{ok_url}/health")
        assert settle(store, "control") is Phase.RUNNING
        time.sleep(1.5)  # more rounds of both loops
        assert store.get("chat").phase is Phase.STARTING
        assert store.get("victim").phase is Phase.PREEMPTED
    assert refused.requests == 0 and allowed.requests >= 1
    assert off_loopback == []
    lines = [r.getMessage() for r in caplog.records if "not fetching" in r.getMessage()]
    # Reported once per record, not every round.
    assert len(lines) == 2, lines
    assert all(f"port {port_of(no_url)} is not in the agent's --health-ports" in x for x in lines)


def test_a_health_url_off_this_machine_is_refused_unfetched(
    tmp_path: Path, off_loopback: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    allowed = LoopbackHealth()
    store = DirectStore(tmp_path / "state")
    caplog.set_level(logging.WARNING, logger="gpuctl.agent")
    # The far port is allowed: only the address refuses it.
    with serve_in_thread(allowed) as ok_url, agent(tmp_path, f"{port_of(ok_url)},8000"):
        write_record(store.state_dir, "far", phase="starting", health=f"http://{FAR}:8000/health")
        write_record(
            store.state_dir,
            "named",
            phase="starting",
            health="http://metadata.internal:8000/health",
        )
        write_record(store.state_dir, "control", phase="starting", health=f"{ok_url}/health")
        assert settle(store, "control") is Phase.RUNNING
        time.sleep(1.5)
        assert store.get("far").phase is Phase.STARTING
        assert store.get("named").phase is Phase.STARTING
    assert off_loopback == []
    text = caplog.text
    assert f"{FAR} is not an address of this machine" in text
    assert "'metadata.internal' is a name" in text


# --------------------------------------------------------------------------- the rule


LOCAL = frozenset({ipaddress.ip_address("10.1.2.3")})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/health",
        "http://127.9.9.9:8000/health",
        "http://[::1]:8000/health",
        "http://localhost:8000/health",
        "http://0.0.0.0:8000/health",
        "http://10.1.2.3:8000/health",  # an interface of this machine
        "http://[::ffff:127.0.0.1]:8000/health",
        "http://[::1%25lo]:8000/health",  # an IPv6 zone names an interface
        "http://user:pw@127.0.0.1:8000/health?token=x",
    ],
)
def test_this_machine_on_a_given_port_may_be_fetched(url: str) -> None:
    assert HealthReach(parse_ports("8000")).refusal(url, LOCAL) is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (f"http://{FAR}:8000/health", "not an address of this machine"),
        ("http://[::ffff:192.0.2.1]:8000/health", "not an address of this machine"),
        ("http://10.1.2.4:8000/health", "not an address of this machine"),
        ("http://gpu.example:8000/health", "is a name"),
        ("http://localhost.evil.example:8000/h", "is a name"),
        # A zone belongs to an IPv6 literal only: after an IPv4 one, "%" starts no zone.
        ("http://127.0.0.1%x.evil.com:8000/h", "is a name"),
        ("http://user@127.0.0.1%25eth0:8000/h", "is a name"),
        ("http://127.0.0.1:8001/health", "port 8001 is not in"),
        ("http://127.0.0.1/health", "port 80 is not in"),
        ("https://127.0.0.1/health", "port 443 is not in"),
        ("ftp://127.0.0.1:8000/x", "not an http(s) URL"),
        ("http://127.0.0.1:99999/x", "not a URL"),
        ("http://[::1/x", "not a URL"),
    ],
)
def test_anything_else_is_refused(url: str, why: str) -> None:
    refusal = HealthReach(parse_ports("8000")).refusal(url, LOCAL)
    assert refusal is not None and why in refusal


def test_ports_parse_and_print() -> None:
    assert str(parse_ports(" 9000, 8000-8100 ")) == "8000-8100,9000"
    assert 8050 in parse_ports("8000-8100") and 8101 not in parse_ports("8000-8100")
    assert str(parse_ports("none")) == "none" and 8000 not in parse_ports("none")
    assert 8000 in parse_ports(DEFAULT_HEALTH_PORTS) and 11434 in parse_ports(DEFAULT_HEALTH_PORTS)


@pytest.mark.parametrize("bad", ["", "0", "65536", "9000-8000", "80-", "x", "1,,2", "8000 9000"])
def test_bad_ports_are_refused_naming_the_option(bad: str) -> None:
    from gpuctl.cli.app import create_app as cli_app

    with pytest.raises(ValueError):
        parse_ports(bad)
    result = CliRunner().invoke(cli_app(["agent"]), ["agent", "--health-ports", bad])
    assert result.exit_code == 2, result.output
    assert "--health-ports:" in result.output
