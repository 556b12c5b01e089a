"""Nobody without a token can take the agent or the proxy down with connections (issue 17;
``gpuctl.agent.connections``): the real agent and proxy on loopback, flooded by idle and
slowloris sockets, every loop bounded in count and in time.

The flood servers run under a descriptor limit of 256 (soft and hard, as a service
manager sets it), below the 300 sockets of the flood: without the bounds the flood took
every descriptor and a real client could not get in.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.core.conn_limits import ConnectionLimits
from gpuctl.sim.host import SimHost
from tests.proxy_helpers import Proxy, serve_raw

FLOOD = 300  # idle sockets: over the servers' descriptor limit and their per-peer bound
NOFILE = 256
PER_PEER = 64  # the floor the issue sets (and the flood servers' bound)
SHORT = 1.0  # the timeouts of the servers the timeout tests use, in seconds


@dataclass
class Target:
    name: str
    port: int
    url: str


def _upstream(conn: socket.socket) -> None:
    """The service the proxies front: /health, and /stream, an answer that trickles out
    over three times the short timeouts (six events, 0.5 s apart)."""
    buf = b""
    with conn:
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                path = head.split(b" ")[1]
                if path == b"/health":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for i in range(6):
                    event = b"data: %d\n\n" % i
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                    time.sleep(0.5)
                conn.sendall(b"0\r\n\r\n")
        except OSError:
            return


def _start(
    base: Path, up_port: int, agent_args: list[str], proxy_toml: str, nofile: int | None
) -> tuple[SimHost, Proxy]:
    host = SimHost(gpu_memory="10GiB", root=base).__enter__()
    host.start_agent(args=agent_args, nofile=nofile)
    conf = host.write_config(
        f'[services.svc]\nhealth = "http://127.0.0.1:{up_port}/health"\nmodels = ["m"]\n\n'
        f"[proxy]\n{proxy_toml}"
    )
    return host, Proxy(host, conf, nofile=nofile)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    """``agent`` and ``proxy`` with the default timeouts, a per-peer bound of 64 and 256
    descriptors; ``agent-short`` and ``proxy-short`` with timeouts of 1 s."""
    srv, up_port = serve_raw(_upstream)
    hosts: list[SimHost] = []
    proxies: list[Proxy] = []
    try:
        flood = _start(
            tmp_path_factory.mktemp("flood"),
            up_port,
            ["--max-connections-per-peer", str(PER_PEER)],
            f"max_connections_per_peer = {PER_PEER}\n",
            NOFILE,
        )
        short = _start(
            tmp_path_factory.mktemp("short"),
            up_port,
            ["--header-timeout", f"{SHORT}s", "--idle-timeout", f"{SHORT}s"],
            f'header_timeout = "{SHORT}s"\nidle_timeout = "{SHORT}s"\n',
            None,
        )
        out: dict[str, Target] = {}
        for suffix, (host, proxy) in (("", flood), ("-short", short)):
            hosts.append(host)
            proxies.append(proxy)
            out["agent" + suffix] = Target("agent", host.agent_port, host.agent_url)
            out["proxy" + suffix] = Target("proxy", proxy.port, proxy.url)
        yield out
    finally:
        for p in proxies:
            p.stop()
        for h in hosts:
            h.close()
        srv.close()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def closed_by_server(s: socket.socket) -> bool:
    """The server has closed ``s`` (EOF or a reset), seen without waiting."""
    s.setblocking(False)
    try:
        data = s.recv(4096)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return data == b""


def wait_closed(s: socket.socket, within_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``s`` (at most ``within_s``: else the test fails);
    with ``trickle``, one byte of it every 0.2 s meanwhile, as a slowloris sends."""
    t0 = time.monotonic()
    sent = 0
    while not closed_by_server(s):
        assert time.monotonic() - t0 < within_s, f"still open after {within_s} s"
        if sent < len(trickle):
            try:
                s.send(trickle[sent : sent + 1])
            except OSError:
                break
            sent += 1
        time.sleep(0.2)
    return time.monotonic() - t0


def test_the_default_limits_are_the_issues() -> None:
    """10 s for a request head, 5 s idle, room for 64 connections from one address: the
    dataclass, ``gpuctl agent``'s options and the ``[proxy]`` keys all default to them."""
    import typer.main

    from gpuctl.cli.app import create_app
    from gpuctl.config.proxy_fields import parse_proxy

    d = ConnectionLimits()
    assert (d.head_timeout_s, d.idle_timeout_s) == (10.0, 5.0)
    assert d.max_per_peer >= PER_PEER and d.max_total >= d.max_per_peer
    assert d.check() == []
    assert ConnectionLimits(max_per_peer=63).check()  # below the issue's floor
    assert parse_proxy(None, None).connections == d
    agent = typer.main.get_command(create_app()).commands["agent"]  # type: ignore[attr-defined]
    defaults = {p.name: p.default for p in agent.params}
    assert defaults["header_timeout"] == d.head_timeout_s
    assert defaults["idle_timeout"] == d.idle_timeout_s
    assert defaults["max_per_peer"] == d.max_per_peer
    assert defaults["max_connections"] == d.max_total


@pytest.mark.parametrize("name", ["agent", "proxy"])
def test_a_client_is_served_during_a_flood_of_idle_sockets(
    servers: dict[str, Target], name: str
) -> None:
    """300 idle sockets from loopback (over the server's 256 descriptors and its per-peer
    bound of 64), half of them part-way through a request head: a real client, from the
    same address and from another, is still served, and the server keeps no more than
    its per-peer bound of the flood open."""
    t = servers[name]
    flood: list[socket.socket] = []
    try:
        for i in range(FLOOD):
            s = connect(t.port)
            if i % 2:
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # and never the rest
            flood.append(s)
        r = httpx.get(t.url + "/healthz", timeout=10)
        assert r.status_code == 200, r.text
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=10) as other:
            assert other.get(t.url + "/healthz").status_code == 200
        deadline = time.monotonic() + 10
        while sum(not closed_by_server(s) for s in flood) > PER_PEER:
            assert time.monotonic() < deadline, "the per-peer bound did not hold"
            time.sleep(0.1)
    finally:
        for s in flood:
            s.close()


@pytest.mark.parametrize("name", ["agent-short", "proxy-short"])
def test_a_silent_connection_is_closed_after_the_head_timeout(
    servers: dict[str, Target], name: str
) -> None:
    with connect(servers[name].port) as s:
        assert wait_closed(s, 10 * SHORT) >= SHORT * 0.9


@pytest.mark.parametrize("name", ["agent-short", "proxy-short"])
def test_a_slowloris_head_is_closed_after_the_head_timeout(
    servers: dict[str, Target], name: str
) -> None:
    """A byte every 0.2 s of a head that never ends: each byte is activity, but the head
    is not whole by the timeout, so the connection goes."""
    with connect(servers[name].port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        wait_closed(s, 10 * SHORT, trickle=b"x-slow: " + b"a" * 200)


@pytest.mark.parametrize("name", ["agent-short", "proxy-short"])
def test_a_kept_alive_connection_is_closed_idle_or_slowloris_after_an_answer(
    servers: dict[str, Target], name: str
) -> None:
    """After an answer: silence is closed after the idle timeout, and a next head sent a
    byte at a time after the head timeout (uvicorn's keep-alive timer stops at the first
    byte, and none was armed again)."""
    port = servers[name].port
    for trickle in (b"", b"GET /healthz HTTP/1.1\r\nx-slow: " + b"a" * 200):
        with connect(port) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                assert chunk, "closed before the answer"
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got
            wait_closed(s, 10 * SHORT, trickle=trickle)


def test_a_stream_being_sent_is_not_idle(servers: dict[str, Target]) -> None:
    """An answer that trickles out over 3 s (3x both timeouts) reaches the client whole:
    a connection with a request under way is never closed for time."""
    url = servers["proxy-short"].url + "/services/svc/stream"
    with httpx.stream("GET", url, timeout=10) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_bytes())
    assert body == b"".join(b"data: %d\n\n" % i for i in range(6))


# -- the guard's order of victims, in process (no server): a fake uvicorn protocol and loop


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.armed: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, fn: object) -> object:
        self.armed.append((self.now + delay, fn))
        return object()


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class _Cycle:
    def __init__(self) -> None:
        self.response_complete = False


class _State:
    total_requests = 0


class _Proto:
    """What the guard reads of uvicorn's HttpToolsProtocol."""

    def __init__(self, state: _State) -> None:
        self.server_state = state
        self.transport = _Transport()
        self.cycle: _Cycle | None = None
        self.scope: object = None

    def head(self) -> None:
        """A request's first byte, then its whole head: a request under way."""
        self.scope = object()
        self.cycle = _Cycle()

    def answer(self, guard: Any, c: Any, clock: _Clock) -> None:
        """The answer ends (what guarded_protocol's on_response_complete records)."""
        assert self.cycle is not None
        self.cycle.response_complete = True
        self.server_state.total_requests += 1
        c.since, c.scope = clock.time(), self.scope


def _guard(per_peer: int = 64, total: int = 128) -> tuple[Any, _Clock, _State]:
    from gpuctl.agent.connections import ConnectionGuard

    limits = ConnectionLimits(max_total=total, max_per_peer=per_peer)
    return ConnectionGuard(limits, b"{}"), _Clock(), _State()


def _open(guard: Any, clock: _Clock, state: _State, peer: str = "a") -> tuple[_Proto, Any]:
    clock.now += 1
    p = _Proto(state)
    return p, guard.admit(peer, p, clock)


def test_a_full_bound_closes_the_connection_that_waited_longest() -> None:
    """The victim is the one waiting longest since its opening or its last answer; one
    with a request under way is never chosen; when all are busy the new one is refused;
    and an answer after a scan makes its connection the youngest again."""
    g, clock, state = _guard()
    conns = [_open(g, clock, state) for _ in range(64)]
    # The oldest three are busy; the fourth answers late, so it waited the least.
    for p, _ in conns[:3]:
        p.head()
    p3, c3 = conns[3]
    p3.head()
    clock.now += 1
    p3.answer(g, c3, clock)
    order = [p for p, _ in conns[4:]] + [p3]
    for want in order[:10]:  # a flood from the same peer: each new one takes one's place
        p, c = _open(g, clock, state)
        assert c is not None and want.transport.closed
        assert not any(q.transport.closed for q, _ in conns[:3])
    # After the scan, one of the queued ones answers: it goes to the back of the line.
    p_mid, c_mid = conns[20]
    p_mid.head()
    clock.now += 1
    p_mid.answer(g, c_mid, clock)
    for _ in range(7):
        assert _open(g, clock, state)[1] is not None
    assert all(p.transport.closed for p, _ in conns[14:20])
    assert conns[21][0].transport.closed and not p_mid.transport.closed
    assert g.closed_for_room == 17 and g.total == 64


def test_a_full_bound_of_busy_connections_refuses_until_one_answers() -> None:
    g, clock, state = _guard(per_peer=64, total=64)
    conns = [_open(g, clock, state, peer=f"p{i % 2}") for i in range(64)]
    for p, _ in conns:
        p.head()
    for _ in range(3):
        assert _open(g, clock, state, peer="new")[1] is None
    assert g.refused_total == 3 and g.total == 64
    p, c = conns[40]
    clock.now += 1
    p.answer(g, c, clock)  # now waiting: the next one over the bound takes its place
    assert _open(g, clock, state, peer="new")[1] is not None
    assert p.transport.closed and g.total == 64


def test_the_sweep_closes_by_the_head_and_idle_deadlines_only_when_waiting() -> None:
    g, clock, state = _guard()
    head, idle = g.limits.head_timeout_s, g.limits.idle_timeout_s
    silent, _ = _open(g, clock, state)  # no byte: the head timeout from its opening
    opened = clock.now
    streaming, _ = _open(g, clock, state)  # a request under way: never timed
    streaming.head()
    idle_p, idle_c = _open(g, clock, state)  # answered, then nothing: the idle timeout
    next_p, next_c = _open(g, clock, state)  # answered, then a head begun: head timeout
    clock.now += 1
    t0 = clock.now
    idle_p.head()
    idle_p.answer(g, idle_c, clock)
    next_p.head()
    next_p.answer(g, next_c, clock)
    next_p.scope = object()
    assert len(clock.armed) == 1  # one sweep for the server, none per connection

    def sweep_at(t: float) -> None:
        clock.now = t
        _, fn = clock.armed.pop()
        fn()  # type: ignore[operator]

    sweep_at(t0 + idle - 0.01)
    assert not any(p.transport.closed for p in (silent, streaming, idle_p, next_p))
    sweep_at(t0 + idle)
    assert idle_p.transport.closed and not silent.transport.closed
    sweep_at(opened + head)
    assert silent.transport.closed and not next_p.transport.closed
    sweep_at(t0 + head)
    assert next_p.transport.closed
    sweep_at(t0 + 100 * head)
    assert not streaming.transport.closed and g.total == 1 and g.closed_idle == 3
    assert clock.armed  # a connection is left: the sweep goes on
