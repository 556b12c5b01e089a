"""The proxy's upstream client (``upstream.UpstreamClient``) on aiohttp's client.

aiohttp parses answers with llhttp (as uvicorn does the proxy's requests) and costs a
fraction of httpx's Python per request (LiteLLM moved its proxy to it for that, PR
#11097). What the proxy needs of it, and why:

- Bytes go through as they are: no decompression (``auto_decompress=False``), no
  headers of aiohttp's own (``skip_auto_headers``), the target as the client escaped it
  (``encoded=True``), no cookies kept between requests, no redirects followed, no
  ``HTTP(S)_PROXY`` (``trust_env=False``).
- Backpressure is aiohttp's: its reader pauses the socket past twice ``read_bufsize``
  buffered, so a slow client slows the upstream.
- ``aclose`` of an answer not read to the end closes its connection: that is how an
  OpenAI-compatible server learns the client went away.
- An idle connection is kept ``upstream.IDLE_S`` (under uvicorn's 5 s keep-alive).
- Retry: aiohttp's own (GET, HEAD, OPTIONS, TRACE, PUT, DELETE, once, when a
  connection is closed before an answer) is turned off; the proxy's rule replaces it:
  once, when the request is safe to repeat (``idempotent``) and the server closed the
  connection before a byte of an answer. A request not safe to repeat is never sent
  twice.
- Head limits: llhttp's, as aiohttp sets them: a line (or one header) up to
  ``MAX_FIELD`` bytes and at most ``MAX_HEADERS`` headers; past either the answer is
  ``UpstreamTooLarge``.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
from aiohttp import client_exceptions as ce
from yarl import URL

from gpuctl.proxy import upstream as _up
from gpuctl.proxy.upstream import (
    ConnectFailed,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUntrusted,
    has_line_break,
    tls_context,
    untrusted_text,
)

MAX_FIELD = 16 * 1024
MAX_HEADERS = 256
# Per read from the socket; the reader pauses it past twice this much unread.
READ_BUFSIZE = 128 * 1024
# Request headers the client writes itself or must not forward (hop-by-hop ones are
# dropped by the caller); ``expect`` is, here, since the body goes out at once.
_OWN = frozenset({b"host", b"content-length", b"transfer-encoding", b"expect", b"connection"})
_NO_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _translate(e: BaseException, timeout_s: float) -> UpstreamError:
    """aiohttp's error as one of ours (``upstream``'s tree)."""
    if isinstance(e, UpstreamError):
        return e
    if isinstance(e, ce.ClientConnectorCertificateError):
        cert = e.certificate_error
        why = getattr(cert, "verify_message", None) or str(cert)
        return UpstreamUntrusted(untrusted_text(why))
    if isinstance(e, ce.ClientConnectorSSLError):
        return UpstreamError(f"the TLS handshake failed: {e}")
    if isinstance(e, ce.ConnectionTimeoutError):
        return UpstreamTimeout(f"no connection within {timeout_s:g} s")
    if isinstance(e, (ce.ServerTimeoutError, asyncio.TimeoutError)):
        return UpstreamTimeout(f"no answer within {timeout_s:g} s")
    if isinstance(e, ce.ClientConnectorError):
        return ConnectFailed(e.os_error.strerror or str(e.os_error))
    if isinstance(e, ce.ServerDisconnectedError):
        return UpstreamClosed("the server closed the connection before answering")
    if isinstance(e, ce.ClientPayloadError):
        return UpstreamClosed(f"the server closed the connection mid-answer: {e}")
    if isinstance(e, ce.ClientResponseError):
        # llhttp's refusals reach us as text only (the cause is not kept).
        if e.message.startswith(("Too many headers", "Got more than")):
            return UpstreamTooLarge(f"an answer head over the limit ({e.message[:80]})")
        return UpstreamError(f"a malformed answer: {e.message[:200]}")
    if isinstance(e, ce.ClientOSError):
        return UpstreamClosed(f"the server closed the connection: {e}")
    return UpstreamError(f"{type(e).__name__}: {e}")


class Response:
    __slots__ = ("_resp", "_timeout_s", "head_only", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, head_only: bool, timeout_s: float) -> None:
        self._resp: aiohttp.ClientResponse | None = resp
        self._timeout_s = timeout_s
        self.status = resp.status
        self.head_only = head_only
        self.headers = [(k.lower(), v) for k, v in resp.raw_headers]

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def _live(self) -> aiohttp.ClientResponse:
        r = self._resp
        assert r is not None, "read after aclose"
        return r

    async def read(self) -> bytes:
        r = self._live()
        chunks: list[bytes] = []
        size = 0
        while chunk := await self.next():
            chunks.append(chunk)
            size += len(chunk)
            if size > _up.MAX_BODY:
                r.close()
                raise UpstreamTooLarge(f"an answer over {_up.MAX_BODY // 2**20} MiB")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def complete_body(self) -> bytes | None:
        content = self._live().content
        if content.exception() is not None:
            raise _translate(content.exception(), self._timeout_s)  # type: ignore[arg-type]
        if not content.is_eof():
            return None
        return content.read_nowait()

    async def next(self) -> bytes:
        try:
            return await self._live().content.readany()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _translate(e, self._timeout_s) from None

    def aclose(self) -> None:
        r, self._resp = self._resp, None
        if r is None:
            return
        if r.content.at_eof() and r.content.exception() is None:
            r.release()  # back to the pool when the server keeps it alive
        else:
            r.close()  # not read to the end: the connection ends (the upstream's cancel)


class Origin:
    __slots__ = ("_client", "_origin", "_ssl")

    def __init__(self, client: Client, origin: str) -> None:
        self._client = client
        self._origin = origin
        # Loaded for an https upstream only: a bundle that cannot be loaded must not
        # stop a proxy whose upstreams are all http.
        self._ssl: ssl.SSLContext | bool = tls_context() if origin.startswith("https:") else True

    def idle_count(self) -> int:
        conns: dict[Any, Any] = getattr(self._client._session.connector, "_conns", {})
        return sum(p.is_connected() and not p.should_close for v in conns.values() for p, _ in v)

    async def request(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        idempotent: bool,
    ) -> Response:
        if has_line_break(headers):
            raise UpstreamError("a header value with a line break")
        c = self._client
        url = URL(self._origin + target.decode("ascii"), encoded=True)
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers if k not in _OWN]
        data = body if body or method not in ("GET", "HEAD", "OPTIONS", "DELETE", "TRACE") else None
        retried = False
        while True:
            try:
                resp = await c._session.request(
                    method, url, headers=hdrs, data=data, allow_redirects=False, ssl=self._ssl
                )
            except (TimeoutError, aiohttp.ClientError) as e:
                err = _translate(e, c.read_timeout_s if not _connecting(e) else c.connect_timeout_s)
                if isinstance(e, ce.ServerDisconnectedError) and idempotent and not retried:
                    retried = True
                    continue
                raise err from None
            if sum(len(k) + len(v) + 4 for k, v in resp.raw_headers) > _up.MAX_HEAD:
                # aiohttp bounds each line and the count, not the whole head.
                resp.close()
                raise UpstreamTooLarge(f"an answer head over {_up.MAX_HEAD // 1024} KiB")
            return Response(resp, method == "HEAD", c.read_timeout_s)


def _connecting(e: BaseException) -> bool:
    return isinstance(e, (ce.ClientConnectorError, ce.ConnectionTimeoutError))


class _Connector(aiohttp.TCPConnector):
    """aiohttp's pool, which also drops a connection that received bytes while idle.

    aiohttp reuses any idle connection still open; one on which the server sent more
    (an answer nobody asked for) would hand those bytes to the next request as its
    answer. Such a connection says ``should_close``; it is closed here instead.
    """

    async def _get(self, key: Any, traces: list[Any]) -> Any:
        while True:
            conn = await super()._get(key, traces)
            if conn is None or conn.protocol is None or not conn.protocol.should_close:
                return conn
            conn.close()


class Client:
    """One aiohttp session (one connector: a pool per origin) for every upstream."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._origins: dict[str, Origin] = {}
        self._s: aiohttp.ClientSession | None = None

    @property
    def _session(self) -> aiohttp.ClientSession:
        # Made on the first request: a session belongs to the loop it was made on.
        if self._s is None:
            connector = _Connector(
                limit=0,
                keepalive_timeout=_up.IDLE_S,
                ttl_dns_cache=None,
            )
            self._s = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.connect_timeout_s,
                    sock_read=self.read_timeout_s,
                ),
                auto_decompress=False,
                skip_auto_headers=_NO_AUTO,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                read_bufsize=READ_BUFSIZE,
                max_line_size=MAX_FIELD,
                max_field_size=MAX_FIELD,
                max_headers=MAX_HEADERS,
            )
            self._s._retry_connection = False  # the proxy's retry rule instead (above)
        return self._s

    def pool(self, origin: str) -> Origin:
        o = self._origins.get(origin)
        if o is None:
            if not origin.startswith(("http://", "https://")):
                raise ValueError(f"not an http(s) origin: {origin!r}")
            o = self._origins[origin] = Origin(self, origin.rstrip("/"))
        return o

    async def aclose(self) -> None:
        if self._s is not None:
            await self._s.close()
            self._s = None
