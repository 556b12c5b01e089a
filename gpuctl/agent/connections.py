"""Bounds on the connections a server holds: the agent's and the proxy's
(docs/reference/agent.md, "Limits on connections"). Anyone who can reach the port can open
connections, token or not; 1,100 idle ones once took every descriptor of both servers
(systemd's default ``ulimit -n`` is 1024), and uvicorn alone arms no timer on a
connection until its first answer, so they stayed open for ever.

Rules (tests/test_connections.py):

- **Per peer and in all.** At most ``max_per_peer`` connections from one address (an
  IPv6 peer by its /64: one host holds a whole /64) and ``max_total`` in all. A
  connection over either bound makes room by closing the connection that has waited
  longest *without a request under way* (for the per-peer bound, one of that peer's):
  such a connection costs its client nothing but a reconnect, and a flood of idle
  sockets then cannot keep a real client out, wherever it comes from (the tests, the
  trials and the web view's pages all share loopback with any local attacker). When
  every connection has a request under way, the new one gets a 503 and is closed.
- **Head timeout.** A connection that has not sent a whole request head
  ``head_timeout_s`` after it opened, or after its last answer ended, is closed
  (slowloris: a byte now and then).
- **Idle timeout.** A kept-alive connection that sends no byte ``idle_timeout_s``
  after its last answer ended is closed.
- **A request under way is never timed here.** From its head to the end of its answer
  (a server-sent-events stream included) the connection is busy, whatever the time.

The guard hooks uvicorn's httptools protocol (``guarded_protocol``): a subclass's
``connection_made``, ``connection_lost`` and ``on_response_complete``, which is all a
request costs it (a clock read and two attribute writes). Nothing hooks
``data_received`` or ``on_headers_complete``, the hot path: a request under way is
uvicorn's cycle whose answer has not ended, and a head begun is uvicorn's new scope,
both read only when a bound is hit or a sweep runs. No timer per connection either: one
sweep per server closes the connections past their deadlines, and the victim of a full
bound is found by a scan (``_Pool``), when a bound is hit.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from gpuctl.core.conn_limits import ConnectionLimits

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("gpuctl.connections")

# Descriptors kept for everything but client connections: the listener, logs, the
# store's files and locks, a probe's pipes, a job stop's /proc reads.
_RESERVED_FDS = 64
# How far the soft descriptor limit is raised towards the hard one at start (Go's runtime
# does the same, to the hard limit).
_NOFILE_TARGET = 65536


def effective(limits: ConnectionLimits, fds_per_connection: int) -> ConnectionLimits:
    """``limits`` with ``max_total`` cut to what the descriptor limit allows, after
    raising the soft limit towards the hard one. ``fds_per_connection``: 2 for the proxy
    (a client's connection and its upstream one), 1 for the agent."""
    soft = raise_nofile()
    room = max((soft - _RESERVED_FDS) // fds_per_connection, 1)
    if room >= limits.max_total:
        return limits
    log.warning(
        "the descriptor limit (%d) allows %d connections, not %d: raise it "
        "(LimitNOFILE= in the unit, ulimit -n in a shell)",
        soft,
        room,
        limits.max_total,
    )
    return replace(limits, max_total=room, max_per_peer=min(limits.max_per_peer, room))


def raise_nofile() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` towards the hard one (up to 65,536); returns
    the soft limit now in force. A shell's 1024 would otherwise cap the server."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _NOFILE_TARGET if hard == resource.RLIM_INFINITY else min(hard, _NOFILE_TARGET)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return _NOFILE_TARGET if soft == resource.RLIM_INFINITY else soft


def peer_key(host: str) -> str:
    """The address a per-peer bound counts by: an IPv4 address (a mapped one too) as is,
    an IPv6 one by its /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def refusal(body: bytes) -> bytes:
    """A whole 503 answer with ``body`` (JSON): for a connection over a bound when none
    could be closed to make room."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


class _Conn:
    """What the guard keeps of one connection: the hot path writes ``since`` and
    ``scope`` once per answer, and nothing else.

    Whether a request is under way is read from uvicorn's own state when needed (a cycle
    whose answer has not ended), so a request's head costs the guard nothing."""

    __slots__ = ("peer", "proto", "scope", "since")

    def __init__(self, peer: str, proto: Any, since: float) -> None:
        self.peer = peer
        self.proto: Any = proto  # uvicorn's HttpToolsProtocol; None once forgotten
        # When it began waiting: its opening, then each answer's end.
        self.since = since
        # The protocol's request scope when it began waiting: uvicorn makes a new one at a
        # request's first byte, so another one there means the next head has begun.
        self.scope: object = _OPENED

    def busy(self) -> bool:
        """A request is under way: its head has arrived and its answer has not ended."""
        cycle = self.proto.cycle
        return cycle is not None and not cycle.response_complete


# ``_Conn.scope`` of a connection that has had no answer yet: never a protocol's scope, so
# the head timeout counts from the opening.
_OPENED = object()


class _Pool:
    """The connections counted against one bound (one peer's, or all), and the order in
    which the waiting ones go when the bound is hit.

    The order is found lazily: when a victim is needed and ``queue`` holds none, one scan
    sorts the waiting connections by how long they have waited and keeps them, longest
    last, each with its ``since`` then. A kept entry is still right while its connection
    counts, is waiting and has the same ``since``; and every connection that has begun
    waiting since the scan (new, or answered) waited less than any such entry. So a
    flood that hits the bound with every new connection costs one scan for as many
    victims as it found, and a request costs the order nothing."""

    __slots__ = ("conns", "none_at", "queue")

    def __init__(self) -> None:
        self.conns: dict[_Conn, None] = {}
        self.queue: list[tuple[float, _Conn]] = []
        # (answers, admissions) when a scan last found every connection busy: until one of
        # them moves, none can have begun waiting, so a refusal needs no scan.
        self.none_at: tuple[int, int] | None = None

    def victim(self, stamp: tuple[int, int]) -> _Conn | None:
        """The connection that has waited longest, or None when all are busy."""
        queue = self.queue
        while queue:
            since, c = queue.pop()
            if c.proto is not None and c.since == since and not c.busy():
                return c
        if self.none_at == stamp:
            return None
        queue.extend((c.since, c) for c in self.conns if not c.busy())
        if not queue:
            self.none_at = stamp
            return None
        queue.sort(key=_since, reverse=True)
        return queue.pop()[1]


def _since(entry: tuple[float, _Conn]) -> float:
    return entry[0]


class ConnectionGuard:
    """The bounds and timeouts of one server's connections (one event loop)."""

    def __init__(self, limits: ConnectionLimits, refused_body: bytes) -> None:
        self.limits = limits
        self.refused = refusal(refused_body)
        self.all = _Pool()
        self.by_peer: dict[str, _Pool] = {}
        self.admitted = 0
        # One sweep closes every connection past its deadline, every ``period`` seconds
        # while there are connections: a request arms no timer, and a deadline is kept
        # to within a tenth of the shorter timeout (half a second at most).
        self.period = min(0.5, min(limits.head_timeout_s, limits.idle_timeout_s) / 10)
        self.sweep: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed_idle = 0
        self.closed_for_room = 0
        self.refused_total = 0

    @property
    def total(self) -> int:
        return len(self.all.conns)

    # -- admission

    def admit(self, peer: str, proto: Any, loop: asyncio.AbstractEventLoop) -> _Conn | None:
        """A new connection from ``peer`` (``proto``: its uvicorn protocol): its handle, or
        None when it must be refused (the caller writes ``self.refused`` and closes it)."""
        self.loop = loop
        mine = self.by_peer.get(peer)
        pool: _Pool | None = None  # where to make room, when full
        if mine is not None and len(mine.conns) >= self.limits.max_per_peer:
            pool = mine
        elif len(self.all.conns) >= self.limits.max_total:
            pool = self.all
        if pool is not None:
            victim = pool.victim((proto.server_state.total_requests, self.admitted))
            if victim is None:
                self.refused_total += 1
                return None
            self.closed_for_room += 1
            self.close(victim)
        c = _Conn(peer, proto, loop.time())
        self.admitted += 1
        self.all.conns[c] = None
        if mine is None:
            mine = self.by_peer[peer] = _Pool()
        mine.conns[c] = None
        if self.sweep is None:
            self.sweep = loop.call_later(self.period, self._sweep)
        return c

    def forget(self, c: _Conn) -> None:
        """The connection ended (or is being closed): it counts no more. Idempotent."""
        if c.proto is None:
            return
        c.proto = None
        del self.all.conns[c]
        mine = self.by_peer[c.peer]
        del mine.conns[c]
        if not mine.conns:
            del self.by_peer[c.peer]

    def close(self, c: _Conn) -> None:
        """Forget ``c`` and close its connection."""
        transport = c.proto.transport
        self.forget(c)
        if not transport.is_closing():
            transport.close()

    # -- time

    def _sweep(self) -> None:
        """Close every waiting connection past its deadline: the head timeout from its
        opening or its last answer's end while a head is on its way (or none has come
        yet), the idle timeout from its last answer's end while nothing has come since."""
        assert self.loop is not None
        now = self.loop.time()
        head_by = now - self.limits.head_timeout_s
        idle_by = now - self.limits.idle_timeout_s
        late = [
            c
            for c in self.all.conns
            if c.since <= (head_by if c.proto.scope is not c.scope else idle_by) and not c.busy()
        ]
        for c in late:
            self.closed_idle += 1
            self.close(c)
        self.sweep = self.loop.call_later(self.period, self._sweep) if self.all.conns else None


def guarded_protocol(base: type[Any], guard: ConnectionGuard) -> type[Any]:
    """``base`` (uvicorn's ``HttpToolsProtocol`` or a subclass) with ``guard``'s bounds
    and timeouts: pass the result as ``uvicorn.Config(http=...)``."""

    # The base's methods called directly: zero-argument super() costs a lookup on each
    # call, and on_response_complete runs on every request.
    made, lost, response_complete = (
        base.connection_made,
        base.connection_lost,
        base.on_response_complete,
    )

    class Guarded(base):  # type: ignore[misc]
        _guarded: _Conn | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            made(self, transport)
            client = self.client
            peer = peer_key(str(client[0])) if client else "local"
            c = guard.admit(peer, self, self.loop)
            if c is None:
                transport.write(guard.refused)
                transport.close()
                return
            self._guarded = c

        def connection_lost(self, exc: Exception | None) -> None:
            c = self._guarded
            if c is not None:
                guard.forget(c)
            lost(self, exc)

        def on_response_complete(self) -> None:
            # The connection waits from now, unless a pipelined request already read
            # starts (then uvicorn's cycle is that request's, and it is busy).
            response_complete(self)
            c = self._guarded
            if c is not None:
                c.since = self.loop.time()
                c.scope = self.scope

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
