"""A lean upstream client (``upstream.UpstreamClient``): HTTP/1.1 over pooled keep-alive
connections, answers parsed by httptools. The default; aiohttp's (``aio``) runs with
``GPUCTL_PROXY_CLIENT=aiohttp``, and tests/test_proxy_h1.py holds both to one contract.

Why not httpx here: under ``wrk`` with 64 clients the proxy spent 0.87 ms of CPU per
request where the server it fronts spent 0.31, and a profile put three quarters of the
proxy's time in httpx, httpcore, anyio and h11 (their per-request objects, cancel
scopes, header validation, the pool's scan). This client does one request with a few
Python calls: a connection from a per-upstream LIFO list, the request head and body in
one write, the response parsed by ``httptools`` (C, llhttp; uvicorn's own parser). The
cold paths (health checks, model cards) keep httpx.

Rules it keeps (tests/test_proxy_h1.py pins them):

- A connection goes back to the pool only when its response was read to the end, the
  server kept it alive, and nothing else arrived on it; any other ends it.
- Streams flow with backpressure: past ``HIGH_WATER`` buffered bytes it stops reading
  the socket until the consumer has taken them, so a slow client slows the upstream.
  The proxy relays every answer so (``relay``); an answer already whole when its head
  is seen (a small one, in one read) is taken at once with ``complete_body``. A
  whole-body ``read`` takes every byte as it comes (it resumes a paused socket), up
  to ``MAX_BODY``: past that the answer is an error, not the memory's.
- An answer head (with any 1xx heads before it) over ``MAX_HEAD`` bytes is an error
  and ends the connection, as the proxy's own 431 does for a request head.
- Closing a response not read to the end aborts its connection: that is how an
  OpenAI-compatible server learns that the client went away (it cancels the request).
- An idle connection the server closed is dropped when the pool sees it; one idle
  longer than ``IDLE_S`` (under uvicorn's 5 s keep-alive) is not reused at all.
- **Retry.** A request is sent again, once, on a fresh connection only when it went
  out on a *reused* connection, the server closed or reset that connection before a
  single byte of an answer, and the caller says the request is safe to repeat
  (``idempotent``: the proxy says so for the OpenAI inference paths, which change no
  state, and for GET/HEAD/OPTIONS/PUT/DELETE; a ``/services/`` POST is never sent
  twice). That is the race of a keep-alive connection closed by the server as the
  request was written; anything else is the caller's error to report.
- Connection failures raise ``ConnectFailed``; timeouts (connect, or no byte for
  ``read_timeout_s`` while an answer is awaited) ``UpstreamTimeout``; an https
  server whose certificate does not verify ``UpstreamUntrusted``; anything else
  ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import cast
from urllib.parse import urlsplit

import httptools

from gpuctl.proxy import upstream as _up
from gpuctl.proxy.upstream import (
    ConnectFailed,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUntrusted,
    tls_context,
    untrusted_text,
)

# Buffered response bytes above which the socket is not read until they are consumed.
HIGH_WATER = 256 * 1024
MAX_IDLE = 512  # idle connections kept per upstream (256 streams end together in the bench)
# Bodies up to this size are copied behind the head so that one write carries both.
_JOIN_BODY = 64 * 1024
# Request headers the client writes itself or must not forward: hop-by-hop ones are
# dropped by the caller; ``expect`` is, here, since the body goes out at once.
_OWN = frozenset({b"host", b"content-length", b"transfer-encoding", b"expect", b"connection"})


class _Conn(asyncio.Protocol):
    """One connection and the exchange on it (one request at a time)."""

    __slots__ = (
        "buffered",
        "busy",
        "chunks",
        "closed",
        "complete",
        "deadline",
        "error",
        "framed",
        "got_bytes",
        "head_bytes",
        "head_done",
        "head_only",
        "head_raw",
        "headers",
        "idle_since",
        "informational",
        "keep_alive",
        "loop",
        "parser",
        "paused",
        "reusable",
        "status",
        "timeout_s",
        "timer",
        "transport",
        "waiter",
        "whole",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s  # silence while an answer is awaited
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # an exchange is under way
        self.reusable = True  # nothing has happened that rules it out for the pool
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self._begin(False)

    def _begin(self, head_only: bool) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.whole = False  # the body is read whole (Response.read): never paused
        self.head_bytes = 0  # header names and values seen (on_header)
        self.head_raw = 0  # bytes received before the head ended
        self.head_done = False
        self.head_only = head_only
        self.complete = False
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked: its end is known without EOF
        self.informational = False
        self.got_bytes = False
        self.error: UpstreamError | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they behave as one.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # asyncio and uvloop set it already; a request is one write anyway.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            # Bytes nobody asked for (after the answer, or on an idle connection): the
            # next answer could not be told from them.
            self.reusable = False
            self.abort()
            return
        self.got_bytes = True
        head = not self.head_done
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the server switched protocols"))
        except httptools.HttpParserError as e:
            if self.complete:
                self.abort()  # bytes after a whole answer (on_message_begin): the answer stands
            else:
                self._fail(UpstreamError(f"a malformed answer: {e}"))
        if head and not self.head_done:
            # llhttp buffers a header it has not seen the end of: a head that does not
            # end within the limit is cut here, whatever on_header has seen of it.
            self.head_raw += len(data)
            if self.head_raw > _up.MAX_HEAD:
                self._fail(self._head_too_large())

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self.busy and not self.complete and self.error is None:
            if self.head_done and not self.framed and exc is None:
                self.complete = True  # a body that ends where the connection does
            else:
                where = "mid-answer" if self.head_done else "before answering"
                why = f": {exc}" if exc else ""
                self.error = UpstreamClosed(f"the server closed the connection {where}{why}")
        self._wake()

    def pause_writing(self) -> None:  # a large upload: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            raise UpstreamError("more after the answer")  # ends feed_data; see data_received

    def _head_too_large(self) -> UpstreamTooLarge:
        return UpstreamTooLarge(f"an answer head over {_up.MAX_HEAD // 1024} KiB")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted here too: a whole head can arrive in one read.
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > _up.MAX_HEAD:
            err = self._head_too_large()
            self._fail(err)
            raise err  # ends feed_data (data_received keeps the first error)
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value):
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.informational = True  # 100 Continue and kin: the answer follows
            self.headers = []
            self.framed = False
            return
        self.status = status
        self.head_done = True
        if self.head_only:
            # A HEAD answer has no body, whatever its Content-Length says; llhttp would
            # wait for one, so the connection is not used again.
            self.complete = True
            self.reusable = False
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.head_only:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.whole:
            if self.buffered > _up.MAX_BODY:
                self._fail(UpstreamTooLarge(f"an answer over {_up.MAX_BODY // 2**20} MiB"))
            else:
                # read() wakes at the end only, not per chunk; bytes still arriving are
                # not silence, so the read timeout moves on.
                self.deadline = self.loop.time() + self.timeout_s
            return
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- the exchange

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def abort(self) -> None:
        self.reusable = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Until something happens on the connection, or ``UpstreamTimeout`` after
        ``timeout_s`` without."""
        fut = self.loop.create_future()
        self.waiter = fut
        # One timer per connection, pushed back by each wait rather than made anew
        # (a stream waits once per token).
        self.deadline = self.loop.time() + self.timeout_s
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self._expire)
        try:
            await fut
        except UpstreamTimeout:
            self.abort()
            raise
        finally:
            self.waiter = None

    def _expire(self) -> None:
        self.timer = None
        w = self.waiter
        if w is None or w.done():
            return  # not waiting: the next wait arms a timer again
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._expire)
            return
        w.set_exception(UpstreamTimeout(f"no answer within {self.timeout_s:g} s"))


class Response:
    """An answer whose head has arrived; its body is read with ``read`` or ``next``.

    ``aclose`` (always call it) gives the connection back, or aborts it when the body
    was not read to the end.
    """

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, conn: _Conn, pool: Pool) -> None:
        self._conn: _Conn | None = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers  # names lower-case, in order, repeats kept

    @property
    def head_only(self) -> bool:
        """The answer to a HEAD: no body, whatever its length says."""
        return self._conn is not None and self._conn.head_only

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes:
        """The whole body (``UpstreamTooLarge`` past ``MAX_BODY``)."""
        c = self._conn
        assert c is not None, "read after aclose"
        # Taken whole, so nothing is held back: the socket may have been paused at
        # HIGH_WATER before this call (the body started with the head), and the answer
        # would otherwise wait there for the read timeout.
        c.whole = True
        if c.paused and not c.closed and c.transport is not None:
            c.paused = False
            c.transport.resume_reading()
        while not c.complete:
            if c.error is not None:
                raise c.error
            await c.wait()
        if c.error is not None:
            raise c.error
        chunks, c.chunks, c.buffered = c.chunks, [], 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def complete_body(self) -> bytes | None:
        """The whole body when all of it has arrived already (a small answer comes with
        its head, in one read), without waiting; else None (it is still arriving: relay
        it with ``next``). Raises the upstream's error when one is known already."""
        c = self._conn
        assert c is not None, "read after aclose"
        if c.error is not None:
            raise c.error
        if not c.complete:
            return None
        chunks, c.chunks, c.buffered = c.chunks, [], 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def next(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some), or
        ``b""`` at its end."""
        c = self._conn
        assert c is not None, "read after aclose"
        while True:
            if c.chunks:
                chunks, c.chunks, c.buffered = c.chunks, [], 0
                if c.paused and not c.closed and c.transport is not None:
                    c.paused = False
                    c.transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if c.error is not None:
                raise c.error
            if c.complete:
                return b""
            await c.wait()

    def aclose(self) -> None:
        c, self._conn = self._conn, None
        if c is None:
            return
        c.busy = False
        if c.complete and not c.chunks and c.keep_alive and c.reusable and c.error is None:
            self._pool.release(c)
        else:
            c.abort()


class Pool:
    """Keep-alive connections to one origin (``scheme://host:port``), newest reused first."""

    def __init__(self, origin: str, connect_timeout_s: float, read_timeout_s: float) -> None:
        u = urlsplit(origin)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) origin: {origin!r}")
        self.tls = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.tls else 80)
        self.host_header = u.netloc.rpartition("@")[2].encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle: list[_Conn] = []
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        if self.tls and self._ssl is None:
            self._ssl = tls_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self.read_timeout_s),
                    self.host,
                    self.port,
                    ssl=self._ssl if self.tls else None,
                )
        except TimeoutError:
            raise UpstreamTimeout(f"no connection within {self.connect_timeout_s:g} s") from None
        except ssl.SSLCertVerificationError as e:
            raise UpstreamUntrusted(untrusted_text(e.verify_message or str(e))) from None
        except ssl.SSLError as e:  # not a refusal: starting the server again would not help
            raise UpstreamError(f"the TLS handshake failed: {e.reason or e}") from None
        except OSError as e:
            raise ConnectFailed(e.strerror or str(e)) from None
        return conn

    def _take(self) -> _Conn | None:
        now = asyncio.get_running_loop().time()
        idle = self.idle
        while idle:
            c = idle.pop()
            if c.closed:
                continue
            if now - c.idle_since > _up.IDLE_S:
                c.abort()
                continue
            return c
        return None

    def release(self, c: _Conn) -> None:
        idle = self.idle
        if c.closed or len(idle) >= MAX_IDLE:
            c.abort()
            return
        now = c.loop.time()
        c.idle_since = now
        # The oldest sit at the bottom: drop the stale ones there while we are here.
        while idle and (idle[0].closed or now - idle[0].idle_since > _up.IDLE_S):
            idle.pop(0).abort()
        idle.append(c)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()

    def idle_count(self) -> int:
        return sum(not c.closed for c in self.idle)

    async def request(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        idempotent: bool,
    ) -> Response:
        """Send one request; its answer once the head has arrived."""
        lines = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", self.host_header]
        n = 0
        for k, v in headers:
            if k in _OWN:
                continue
            lines += (b"\r\n", k, b": ", v)
            n += 1
        if body or method not in ("GET", "HEAD", "OPTIONS", "DELETE", "TRACE"):
            lines += (b"\r\ncontent-length: ", str(len(body)).encode())
            n += 1
        lines.append(b"\r\n\r\n")
        head = b"".join(lines)
        # One CR LF per line and nothing else: a header with a line break in it would
        # smuggle a request (uvicorn refuses them already; this is the last guard).
        if head.count(b"\n") != n + 3 or head.count(b"\r") != n + 3:
            raise UpstreamError("a header value with a line break")
        payload = head + body if len(body) <= _JOIN_BODY else None
        retried = False
        while True:
            conn = self._take()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn._begin(method == "HEAD")
            conn.busy = True
            try:
                if conn.closed or conn.transport is None:
                    # Closed while it was being made (a server that accepts and hangs
                    # up): a closed transport would refuse the write with a RuntimeError.
                    raise UpstreamClosed("the server closed the connection before answering")
                if payload is not None:
                    conn.transport.write(payload)
                else:
                    conn.transport.writelines((head, body))
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except UpstreamClosed:
                conn.busy = False
                if reused and idempotent and not conn.got_bytes and not retried:
                    retried = True
                    continue
                raise
            except BaseException:
                conn.busy = False
                conn.abort()  # cancelled or failed while waiting: never reused
                raise
            return Response(conn, self)


class Client:
    """One ``Pool`` per origin; ``close`` ends every idle connection."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.pools: dict[str, Pool] = {}

    def pool(self, origin: str) -> Pool:
        p = self.pools.get(origin)
        if p is None:
            p = self.pools[origin] = Pool(origin, self.connect_timeout_s, self.read_timeout_s)
        return p

    def close(self) -> None:
        for p in self.pools.values():
            p.close()

    async def aclose(self) -> None:
        self.close()
