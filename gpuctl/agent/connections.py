"""Bounds on the connections a server holds: the agent's and the proxy's (README: "Limits
on connections"). Anyone who can reach the port can open connections, token or not;
1,100 idle ones once took every descriptor of both servers (systemd's default
``ulimit -n`` is 1024), and uvicorn alone arms no timer on a connection until its first
answer, so they stayed open for ever.

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
``connection_made``, ``on_headers_complete`` and ``on_response_complete`` (never
``data_received``: a request's first byte is seen by uvicorn's new scope). A request costs two dict updates and a clock read; the one
timer per connection is moved by writing its deadline, and is re-armed only when it
fires early.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

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
    """What the guard keeps of one connection."""

    __slots__ = ("begun", "busy", "close", "deadline", "head_by", "peer", "scope", "timer")

    def __init__(
        self, peer: str, close: Callable[[], None], begun: Callable[[object], bool]
    ) -> None:
        self.peer = peer
        self.close = close
        self.begun = begun  # whether a request has begun since the answer (``scope``)
        self.scope: object = None
        self.busy = False
        self.deadline = 0.0  # when the timer closes it (while not busy)
        self.head_by = 0.0  # the head's deadline, once a first byte has arrived
        self.timer: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """The bounds and timers of one server's connections (one event loop)."""

    def __init__(self, limits: ConnectionLimits, refused_body: bytes) -> None:
        self.limits = limits
        self.refused = refusal(refused_body)
        self.total = 0
        self.per_peer: dict[str, int] = {}
        # Connections without a request under way, longest waiting first (dicts keep
        # insertion order); in all and by peer.
        self.waiting: dict[_Conn, None] = {}
        self.waiting_by_peer: dict[str, dict[_Conn, None]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed_idle = 0
        self.closed_for_room = 0
        self.refused_total = 0

    # -- admission

    def admit(
        self,
        peer: str,
        close: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
        begun: Callable[[object], bool],
    ) -> _Conn | None:
        """A new connection from ``peer``: its handle, or None when it must be refused
        (the caller writes ``self.refused`` and closes it)."""
        self.loop = loop
        pool: dict[_Conn, None] | None = None  # where to make room, when full
        if self.per_peer.get(peer, 0) >= self.limits.max_per_peer:
            pool = self.waiting_by_peer.get(peer, {})
        elif self.total >= self.limits.max_total:
            pool = self.waiting
        if pool is not None:
            if not pool:
                self.refused_total += 1
                return None
            victim = next(iter(pool))
            self.closed_for_room += 1
            self.forget(victim)
            victim.close()
        c = _Conn(peer, close, begun)
        self.total += 1
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        self._wait(c, loop.time(), self.limits.head_timeout_s, loop)
        return c

    def forget(self, c: _Conn) -> None:
        """The connection ended (or is being closed): it counts no more. Idempotent."""
        if c.peer == "":
            return
        peer, c.peer = c.peer, ""
        self.total -= 1
        left = self.per_peer[peer] - 1
        if left:
            self.per_peer[peer] = left
        else:
            del self.per_peer[peer]
        self._unwait(c, peer)
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None

    # -- the request cycle

    def request(self, c: _Conn) -> None:
        """A whole request head arrived: the connection is busy until its answer ends."""
        if not c.busy and c.peer:
            c.busy = True
            self._unwait(c, c.peer)

    def answered(self, c: _Conn, loop: asyncio.AbstractEventLoop, scope: object) -> None:
        """The answer ended and the connection is kept alive: it waits for the next
        request, idle until its first byte (``scope``: the request just answered)."""
        if c.busy and c.peer:
            c.busy = False
            now = loop.time()
            self._wait(c, now, self.limits.idle_timeout_s, loop)
            c.head_by = now + self.limits.head_timeout_s
            c.scope = scope

    def _wait(self, c: _Conn, now: float, within: float, loop: asyncio.AbstractEventLoop) -> None:
        c.deadline = now + within
        c.head_by = 0.0
        self.waiting[c] = None
        self.waiting_by_peer.setdefault(c.peer, {})[c] = None
        t = c.timer
        if t is not None and t.when() > c.deadline:
            t.cancel()  # due later than now needed (a head's 10 s, where 5 s idle count)
            t = None
        if t is None:
            c.timer = loop.call_at(c.deadline, self._expire, c, loop)

    def _unwait(self, c: _Conn, peer: str) -> None:
        self.waiting.pop(c, None)
        mine = self.waiting_by_peer.get(peer)
        if mine is not None:
            mine.pop(c, None)
            if not mine:
                del self.waiting_by_peer[peer]

    def _expire(self, c: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        c.timer = None
        if not c.peer:
            return
        if c.busy:
            return  # re-armed by `answered`
        if c.head_by and c.begun(c.scope):
            # Idle no more: the next head has begun, and has until its own deadline.
            c.deadline, c.head_by = c.head_by, 0.0
        if loop.time() < c.deadline:
            c.timer = loop.call_at(c.deadline, self._expire, c, loop)
            return
        self.closed_idle += 1
        self.forget(c)
        c.close()


def guarded_protocol(base: type[Any], guard: ConnectionGuard) -> type[Any]:
    """``base`` (uvicorn's ``HttpToolsProtocol`` or a subclass) with ``guard``'s bounds
    and timers: pass the result as ``uvicorn.Config(http=...)``."""

    # The base's methods called directly: zero-argument super() costs a lookup on each
    # call, and these run on every request.
    made, lost = base.connection_made, base.connection_lost
    headers_complete, response_complete = base.on_headers_complete, base.on_response_complete

    class Guarded(base):  # type: ignore[misc]
        _guarded: _Conn | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            made(self, transport)
            client = self.client
            peer = peer_key(str(client[0])) if client else "local"
            c = guard.admit(peer, self._close_now, self.loop, self._head_begun)
            if c is None:
                transport.write(guard.refused)
                transport.close()
                return
            self._guarded = c

        def _close_now(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _head_begun(self, since: object) -> bool:
            # uvicorn's on_message_begin makes a new scope at a request's first byte: no
            # hook of ours runs on the bytes themselves (data_received is the hot path).
            return self.scope is not since

        def connection_lost(self, exc: Exception | None) -> None:
            c = self._guarded
            if c is not None:
                guard.forget(c)
            lost(self, exc)

        def on_headers_complete(self) -> None:
            c = self._guarded
            if c is not None:
                guard.request(c)
            headers_complete(self)

        def on_response_complete(self) -> None:
            # A pipelined request already read starts now: the connection stays busy.
            pipelined = bool(self.pipeline)
            response_complete(self)
            c = self._guarded
            if c is not None and not pipelined and not self.transport.is_closing():
                guard.answered(c, self.loop, self.scope)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
