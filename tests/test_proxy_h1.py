"""The proxy's upstream clients (``gpuctl.proxy.upstream``'s interface) against real
loopback servers: the contract, run against each implementation (``aio``, aiohttp's
client, and ``h1``, the lean one), so a difference between them shows as a failure.

Each test runs an asyncio server on 127.0.0.1 that answers as the test scripts it, byte
for byte, and counts its connections: framing, reuse, backpressure, the retry rule,
truncation and cancellation are seen on the wire, not assumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from gpuctl.proxy import aio, h1, upstream
from gpuctl.proxy.upstream import (
    ConnectFailed,
    Response,
    UpstreamClient,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from gpuctl.sim.host import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A scripted HTTP/1.1 server: ``handler(reader, writer, n)`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []  # every request as received, head and body
        self.closed_by_peer: list[int] = []  # connections whose client closed them
        self.origin = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.origin = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        try:
            await self.handler(reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer.append(n)
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (None at EOF), recorded."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        req = head + await reader.readexactly(length)
        self.requests.append(req)
        return req


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def serve_each(server_of: Callable[[], Server], answer: Callable[[int, int], bytes]) -> Handler:
    """A handler answering every request on a connection with ``answer(conn, i)``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        i = 0
        while await server_of().read_request(reader) is not None:
            writer.write(answer(n, i))
            await writer.drain()
            i += 1

    return handler


@dataclass(frozen=True)
class Impl:
    """One implementation and the few inside views the backpressure cases need."""

    client: Callable[[float, float], UpstreamClient]
    paused: Callable[[Response], bool]  # the socket is not being read
    buffered: Callable[[Response], int]  # body bytes held, not yet taken
    closed: Callable[[Response], bool]  # its connection is gone
    high_water: int
    head_too_large: str  # what an answer head over the limit is called


def _aio_resp(r: Response) -> aiohttp.ClientResponse:
    assert isinstance(r, aio.Response) and r._resp is not None
    return r._resp


def _aio_paused(r: Response) -> bool:
    conn = _aio_resp(r).connection
    return conn is not None and conn.protocol is not None and conn.protocol._reading_paused


def _aio_closed(r: Response) -> bool:
    conn = _aio_resp(r).connection
    return conn is None or conn.protocol is None or not conn.protocol.is_connected()


def _h1_conn(r: Response) -> h1._Conn:
    assert isinstance(r, h1.Response) and r._conn is not None
    return r._conn


IMPLS = {
    "aiohttp": Impl(
        aio.Client,
        _aio_paused,
        lambda r: _aio_resp(r).content._size,
        _aio_closed,
        2 * aio.READ_BUFSIZE,
        "an answer head over (the limit|64 KiB)",
    ),
    "h1": Impl(
        h1.Client,
        lambda r: _h1_conn(r).paused,
        lambda r: _h1_conn(r).buffered,
        lambda r: _h1_conn(r).closed,
        h1.HIGH_WATER,
        "an answer head over 64 KiB",
    ),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request: pytest.FixtureRequest) -> Impl:
    return IMPLS[request.param]


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def post(client: UpstreamClient, origin: str, body: bytes = b"{}", **kw: bool) -> Response:
    headers = [(b"content-type", b"application/json"), (b"expect", b"100-continue")]
    return await client.pool(origin).request(
        "POST", b"/v1/chat/completions", headers, body, idempotent=kw.get("idempotent", True)
    )


# --------------------------------------------------------------------------- framing


def test_content_length_answers_reuse_one_connection_and_the_request_is_whole(impl: Impl) -> None:
    async def main() -> None:
        srv: Server
        async with Server(serve_each(lambda: srv, lambda n, i: ok(b"answer %d" % i))) as srv:
            c = impl.client(5, 5)
            for i in range(3):
                r = await post(c, srv.origin, b'{"model":"m"}')
                assert (r.status, await r.read()) == (200, b"answer %d" % i)
                assert r.header(b"content-length") == b"8"
                r.aclose()
            assert srv.connections == 1  # kept alive and reused
            head = srv.requests[0]
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            low = head.lower()  # header names are not case-sensitive (RFC 9110 §5.1)
            assert b"\r\nhost: " + srv.origin[7:].encode() + b"\r\n" in low
            assert b"content-length: 13\r\n" in low and head.endswith(b'{"model":"m"}')
            assert low.count(b"\r\n") == 5  # request line, host, type, length, end
            assert b"expect" not in low  # the body goes at once: no 100-continue dance
            await c.aclose()

    run(main())


def test_chunked_answer_arrives_chunk_by_chunk_as_the_server_sends_it(impl: Impl) -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )
        await writer.drain()
        await go_on.wait()  # the second chunk only once the first was seen
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await srv.read_request(reader)

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            assert r.header(b"transfer-encoding") == b"chunked"
            assert await r.next() == b"data: 1"  # before the server sent the rest
            go_on.set()
            assert await r.next() == b"data: 2"
            assert await r.next() == b""
            r.aclose()
            assert c.pool(s.origin).idle_count() == 1  # read to the end: back in the pool
            await c.aclose()

    srv: Server
    run(main())


def test_a_body_that_ends_with_the_connection_is_read_whole_and_not_reused(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            assert await r.read() == b"all of it"
            r.aclose()
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["same-segment", "later"])
def test_bytes_after_an_answer_end_the_connection_not_the_answer(pause: float, impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(ok(b"mine"))
        if pause:
            await writer.drain()
            await asyncio.sleep(pause)
        writer.write(ok(b"nobody asked"))  # would be taken for the next request's answer
        await writer.drain()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            await asyncio.sleep(pause * 2)
            assert await r.read() == b"mine"
            r.aclose()
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


def test_head_answer_has_no_body_whatever_its_length_says(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await c.pool(s.origin).request("HEAD", b"/x", [], b"", idempotent=True)
            assert (r.status, await r.read()) == (200, b"")
            assert b"content-length" not in srv.requests[0]  # a HEAD carries none
            r.aclose()
            await c.aclose()

    srv: Server
    run(main())


# --------------------------------------------------------------------------- reuse


@pytest.mark.parametrize("size", [100_000, 4 * 2**20], ids=["arrived", "arriving"])
def test_an_answer_not_read_to_the_end_ends_its_connection(size: int, impl: Impl) -> None:
    # aiohttp gives a connection back as soon as its answer has arrived whole, read or
    # not: there is nothing left to cancel then. One still arriving is always cut.
    reused = impl is IMPLS["aiohttp"] and size == 100_000

    async def main() -> None:
        srv: Server
        big = b"x" * size
        async with Server(serve_each(lambda: srv, lambda n, i: ok(big))) as srv:
            c = impl.client(5, 5)
            r = await post(c, srv.origin)
            r.aclose()  # not read: the connection cannot carry another request
            r = await post(c, srv.origin)
            assert await r.read() == big
            r.aclose()
            assert srv.connections == (1 if reused else 2)
            await c.aclose()

    run(main())


def test_an_idle_connection_the_server_closed_is_not_used_again(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(ok(b"once"))
        await writer.drain()
        # then closes the idle keep-alive connection, as uvicorn does after 5 s

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            assert await r.read() == b"once"
            r.aclose()
            pool = c.pool(s.origin)
            for _ in range(100):  # until the loop has seen the FIN
                if pool.idle_count() == 0:
                    break
                await asyncio.sleep(0.01)
            r = await post(c, s.origin, idempotent=False)  # no retry needed: a fresh one
            assert await r.read() == b"once"
            r.aclose()
            assert s.connections == 2 and len(s.requests) == 2
            await c.aclose()

    srv: Server
    run(main())


def test_idle_past_the_limit_is_not_reused(monkeypatch: pytest.MonkeyPatch, impl: Impl) -> None:
    monkeypatch.setattr(upstream, "IDLE_S", 0.05)

    async def main() -> None:
        srv: Server
        async with Server(serve_each(lambda: srv, lambda n, i: ok(b"hi"))) as srv:
            c = impl.client(5, 5)
            for _ in range(2):
                r = await post(c, srv.origin)
                await r.read()
                r.aclose()
                await asyncio.sleep(0.1)
            assert srv.connections == 2
            await c.aclose()

    run(main())


def _stale_then_answer() -> tuple[Handler, list[Server]]:
    """Connection 1 answers once, then reads the next request and closes without a
    byte (the keep-alive race); later connections answer."""
    box: list[Server] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        srv = box[0]
        await srv.read_request(reader)
        writer.write(ok(b"from %d" % n))
        await writer.drain()
        if n == 1:
            await srv.read_request(reader)
            writer.transport.abort()  # a reset, not even a FIN

    return handler, box


def test_a_stale_keep_alive_connection_is_retried_once_when_safe(impl: Impl) -> None:
    async def main() -> None:
        handler, box = _stale_then_answer()
        async with Server(handler) as srv:
            box.append(srv)
            c = impl.client(5, 5)
            r = await post(c, srv.origin)
            assert await r.read() == b"from 1"
            r.aclose()
            r = await post(c, srv.origin, idempotent=True)
            assert await r.read() == b"from 2"  # sent again, on a fresh connection
            r.aclose()
            assert len(srv.requests) == 3
            await c.aclose()

    run(main())


def test_a_stale_connection_is_never_retried_when_not_safe(impl: Impl) -> None:
    async def main() -> None:
        handler, box = _stale_then_answer()
        async with Server(handler) as srv:
            box.append(srv)
            c = impl.client(5, 5)
            r = await post(c, srv.origin)
            await r.read()
            r.aclose()
            with pytest.raises(UpstreamClosed, match="before answering"):
                await post(c, srv.origin, idempotent=False)
            assert len(srv.requests) == 2 and srv.connections == 1  # sent once only
            await c.aclose()

    run(main())


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-le",
    ],
    ids=["content-length", "chunked", "head"],
)
def test_a_truncated_answer_is_an_error_never_a_short_body(answer: bytes, impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(answer)
        await writer.drain()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            with pytest.raises(UpstreamClosed):
                r = await post(c, s.origin, idempotent=False)
                try:
                    while await r.next():
                        pass
                finally:
                    r.aclose()
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


def test_a_server_that_hangs_up_at_once_is_an_upstream_error(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.transport.abort()

    async def main() -> None:
        async with Server(handler) as s:
            c = impl.client(5, 5)
            for _ in range(5):  # before or after the request is written: the same error
                with pytest.raises(UpstreamClosed, match="before answering"):
                    await post(c, s.origin)
            await c.aclose()

    run(main())


def test_a_malformed_answer_is_an_error(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            with pytest.raises(UpstreamError, match="malformed"):
                await post(c, s.origin)
            await c.aclose()

    srv: Server
    run(main())


def test_refused_and_timeouts(impl: Impl) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.read()

    async def main() -> None:
        refused = impl.client(5, 5)
        try:
            with pytest.raises(ConnectFailed):
                await post(refused, f"http://127.0.0.1:{free_port()}")
        finally:
            await refused.aclose()
        async with Server(silent) as s:
            c = impl.client(5, 0.2)
            try:
                with pytest.raises(UpstreamTimeout, match=r"no answer within 0\.2 s"):
                    await post(c, s.origin)
                assert c.pool(s.origin).idle_count() == 0
            finally:
                await c.aclose()

    run(main())


def test_the_read_timeout_is_silence_not_the_length_of_a_stream(impl: Impl) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):  # 0.8 s of stream, a chunk every 0.1 s
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        await reader.read()  # then silence

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 0.3)
            r = await post(c, s.origin)
            got = b""
            with pytest.raises(UpstreamTimeout):
                while chunk := await r.next():
                    got += chunk
            assert got == b"x" * 8  # the whole stream came through before the silence
            r.aclose()
            await c.aclose()

    srv: Server
    run(main())


# --------------------------------------------------------------------------- streams


def test_closing_a_stream_mid_answer_closes_the_upstream_connection(impl: Impl) -> None:
    seen_close = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(1000):
                writer.write(b"5\r\ntoken\r\n")
                await writer.drain()
                await asyncio.sleep(0.005)
        except ConnectionError:
            seen_close.set()  # what an OpenAI server takes as "cancel the request"
            raise

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            assert (await r.next()).startswith(b"token")
            r.aclose()
            await asyncio.wait_for(seen_close.wait(), 10)
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


def test_a_reader_that_does_not_read_stops_the_socket_being_read(impl: Impl) -> None:
    size = 64 * 2**20
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        sent.set()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            r = await post(c, s.origin)
            await asyncio.sleep(0.5)
            assert impl.paused(r)
            # Paused at the high-water mark: the rest waits in the kernel and the
            # server's buffer, not in ours.
            assert impl.buffered(r) <= impl.high_water + 2**20
            assert not sent.is_set()
            got = 0
            while chunk := await r.next():
                got += len(chunk)
            assert got == size and sent.is_set()
            r.aclose()
            await c.aclose()

    srv: Server
    run(main())


# --------------------------------------------------------------------------- the request


def test_a_header_with_a_line_break_is_never_written(impl: Impl) -> None:
    async def main() -> None:
        srv: Server
        async with Server(serve_each(lambda: srv, lambda n, i: ok(b""))) as srv:
            c = impl.client(5, 5)
            with pytest.raises(UpstreamError, match="line break"):
                await c.pool(srv.origin).request(
                    "GET", b"/", [(b"x-a", b"1\r\nx-b: 2")], b"", idempotent=True
                )
            assert srv.requests == []
            await c.aclose()

    run(main())


# --------------------------------------------------------------------------- whole bodies


def _pattern(size: int) -> bytes:
    """``size`` bytes that are not all one byte, so a lost or repeated piece shows."""
    unit = bytes(range(256)) * 256
    return (unit * (size // len(unit) + 1))[:size]


@pytest.mark.parametrize("size", [2**20, 20 * 2**20], ids=["1MiB", "20MiB"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("when", ["at-once", "after-the-pause"])
def test_a_body_above_the_high_water_mark_is_read_whole(
    size: int, framing: str, when: str, impl: Impl
) -> None:
    # read() used to leave the socket paused at HIGH_WATER: the answer waited for the
    # read timeout (here 10 s, and the whole test has 30).
    body = _pattern(size)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await srv.read_request(reader) is not None:
            if framing == "content-length":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
                writer.write(body)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for i in range(0, size, 65536):
                    piece = body[i : i + 65536]
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 10)
            for _ in range(2):  # and the connection is reused after a whole read
                r = await post(c, s.origin)
                if when == "after-the-pause":
                    while not impl.paused(r):  # the body came with the head and filled us
                        await asyncio.sleep(0.01)
                got = await r.read()
                assert len(got) == size and got == body
                r.aclose()
            assert s.connections == 1
            await c.aclose()

    srv: Server
    run(main())


def test_a_body_read_whole_over_max_body_is_an_error_and_ends_the_connection(
    monkeypatch: pytest.MonkeyPatch, impl: Impl
) -> None:
    monkeypatch.setattr(upstream, "MAX_BODY", 2**20)
    size = 8 * 2**20

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 10)
            r = await post(c, s.origin)
            with pytest.raises(UpstreamTooLarge, match="an answer over 1 MiB"):
                await r.read()
            assert impl.closed(r)
            r.aclose()
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


# --------------------------------------------------------------------------- the answer head


def _head_of(shape: str) -> bytes:
    filler = b"v" * 1000
    if shape == "many-headers":  # 2,000 headers of about 1 KB
        return b"".join(b"x-filler-%04d: %s\r\n" % (i, filler) for i in range(2000))
    if shape == "one-huge-header":  # one header of 1 MB, never ended within the limit
        return b"x-huge: " + b"v" * 2**20 + b"\r\n"
    if shape == "behind-100-continue":  # 1xx heads count towards the same limit
        return b"".join(b"x-filler-%04d: %s\r\n" % (i, filler) for i in range(40)) + (
            b"\r\nHTTP/1.1 200 OK\r\n"
            + b"".join(b"x-more-%04d: %s\r\n" % (i, filler) for i in range(40))
        )
    raise AssertionError(shape)


@pytest.mark.parametrize("shape", ["many-headers", "one-huge-header", "behind-100-continue"])
def test_an_answer_head_over_max_head_is_an_error_and_ends_the_connection(
    shape: str, impl: Impl
) -> None:
    if shape == "behind-100-continue" and impl is IMPLS["aiohttp"]:
        # aiohttp drops 1xx heads unseen; each is bounded by its line and count limits
        # (aio.MAX_FIELD, aio.MAX_HEADERS), not summed with the answer's.
        pytest.skip("aiohttp bounds each head on its own")
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        first = b"HTTP/1.1 100 Continue\r\n" if shape == "behind-100-continue" else b""
        writer.write(
            (first or b"HTTP/1.1 200 OK\r\n") + _head_of(shape) + b"content-length: 2\r\n\r\n{}"
        )
        try:
            await writer.drain()
            await reader.read()  # EOF once the client has dropped the connection
        except ConnectionError:
            pass
        hung_up.set()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 10)
            with pytest.raises(UpstreamTooLarge, match=impl.head_too_large):
                await post(c, s.origin)
            await hung_up.wait()  # the connection was dropped, not left to the server
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


def test_an_answer_head_just_under_max_head_is_taken_whole(impl: Impl) -> None:
    filler = b"v" * 1000
    head = b"".join(b"x-filler-%02d: %s\r\n" % (i, filler) for i in range(60))  # ~61 KB

    async def main() -> None:
        srv: Server
        async with Server(serve_each(lambda: srv, lambda n, i: ok(b"{}", head))) as srv:
            c = impl.client(5, 10)
            r = await post(c, srv.origin)
            assert (r.status, await r.read()) == (200, b"{}")
            assert len(r.headers) == 61 and r.header(b"x-filler-59") == filler
            r.aclose()
            await c.aclose()

    run(main())


# --------------------------------------------------------------------------- strictness


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}x",
        b"HTTP/1.1 200 OK\r\ncontent-length: -2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}",
    ],
    ids=["cl-and-te", "two-lengths", "negative-length", "bare-lf"],
)
def test_an_ambiguous_answer_is_refused_never_guessed(head: bytes, impl: Impl) -> None:
    if head.startswith(b"HTTP/1.1 200 OK\n") and impl is IMPLS["aiohttp"]:
        # aiohttp's llhttp takes a bare LF as a line end in answers (lenient there, as
        # browsers are); the lean client refuses it. Strict: this fails once it does not.
        pytest.xfail("aiohttp takes a bare LF in an answer head")

    # Each of these lets two parsers disagree on where the answer ends (response
    # smuggling, RFC 9112 §6.3 and §2.2): llhttp in strict mode refuses them, and so do
    # both clients, before any byte of a body is handed on.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(head)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            with pytest.raises(UpstreamError):
                r = await post(c, s.origin)
                try:
                    await r.read()
                finally:
                    r.aclose()
            assert c.pool(s.origin).idle_count() == 0
            await c.aclose()

    srv: Server
    run(main())


def test_chunk_trailers_end_the_answer_and_the_connection_is_reused(impl: Impl) -> None:
    # Trailers are not relayed (the proxy's client gets its own framing), but they end
    # the body where the last chunk says and leave the connection fit for the next.
    async def main() -> None:
        srv: Server

        def answer(n: int, i: int) -> bytes:
            return (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n"
                b"5\r\nhello\r\n0\r\nx-sum: 42\r\nx-more: 1\r\n\r\n"
            )

        async with Server(serve_each(lambda: srv, answer)) as srv:
            c = impl.client(5, 5)
            for _ in range(2):
                r = await post(c, srv.origin)
                assert await r.read() == b"hello"
                r.aclose()
            assert srv.connections == 1
            await c.aclose()

    run(main())


def test_an_upstream_keep_alive_shorter_than_ours_costs_no_request(impl: Impl) -> None:
    # The server closes an idle connection after 0.2 s (uvicorn's is 5 s, ours 4 s; a
    # server may choose less). Requests 0.4 s apart each find theirs closed: a fresh
    # one is made, and every request is answered once, safe to repeat or not.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            try:
                req = await asyncio.wait_for(srv.read_request(reader), 0.2)
            except TimeoutError:
                return  # idle too long: close (the handler's finally)
            if req is None:
                return
            writer.write(ok(b"from %d" % n))
            await writer.drain()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            for i in range(3):
                r = await post(c, s.origin, idempotent=False)
                assert await r.read() == b"from %d" % (i + 1)
                r.aclose()
                await asyncio.sleep(0.4)
            assert s.connections == 3 and len(s.requests) == 3
            await c.aclose()

    srv: Server
    run(main())


@pytest.mark.parametrize("when", ["before-the-head", "mid-body"])
def test_a_post_not_safe_to_repeat_is_sent_once_whatever_fails(when: str, impl: Impl) -> None:
    # A fresh connection (no reuse race) that the server drops after reading the
    # request: the caller gets the error and the server has seen the POST once.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        if when == "mid-body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
            await writer.drain()
        writer.transport.abort()

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            c = impl.client(5, 5)
            with pytest.raises(UpstreamClosed):
                r = await c.pool(s.origin).request(
                    "POST", b"/services/x/jobs", [], b"{}", idempotent=False
                )
                try:
                    await r.read()
                finally:
                    r.aclose()
            await asyncio.sleep(0.1)
            assert len(s.requests) == 1 and s.connections == 1
            await c.aclose()

    srv: Server
    run(main())
