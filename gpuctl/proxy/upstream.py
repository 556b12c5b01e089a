"""The proxy's clients of its upstreams: one interface for requests, httpx for the rest.

Requests (the OpenAI routes and ``/services/``) go through an ``UpstreamClient``: a
small interface (``Client.pool(origin).request(...)`` gives a ``Response`` whose head
has arrived; its body is read with ``read``, ``complete_body`` or ``next``; ``aclose``
always) with two implementations, held to the same cases by tests/test_proxy_h1.py:

- ``gpuctl.proxy.h1``: a lean HTTP/1.1 client of our own over httptools, the default;
- ``gpuctl.proxy.aio``: aiohttp's client (llhttp, as uvicorn's parser), with
  ``GPUCTL_PROXY_CLIENT=aiohttp``. Not the default: each request leaves reference cycles
  (tests/test_proxy_garbage.py: 135 objects for the collector in 300 requests, the limit
  is 30), and those collections pause the event loop for every request in flight.

Both keep the same rules (a connection reused only when its answer was read to the
end; backpressure; an unread answer aborts its connection, which is how an
OpenAI-compatible server learns the client left; one retry of a request safe to
repeat that met a keep-alive connection closed under it, never of any other) and raise
the same errors::

    UpstreamError                 the upstream gave no (whole) answer: 502
    ├── ConnectFailed             refused, unreachable: the service is started again
    ├── UpstreamTimeout           no connection, or silence past the read timeout: 504
    ├── UpstreamTooLarge          an answer head, or a body read whole, over the limit
    ├── UpstreamClosed            closed before the answer ended
    └── UpstreamUntrusted         an https certificate that does not verify

The cold paths (health checks, model cards) use httpx (``make_client``).
"""

from __future__ import annotations

import functools
import ssl
from typing import Protocol

import httpx

# A body read whole (``Response.read``; the proxy itself streams every answer) is held
# in memory: one above this is refused. 512 MiB is far above any OpenAI-style JSON
# answer (2,048 embeddings of 4,096 floats are about 170 MB as JSON) and still bounds
# a hostile one.
MAX_BODY = 512 * 1024 * 1024
# An answer's head (status line, headers, any 1xx heads before it): 64 KiB, as the
# proxy's own request limit (app.MAX_HEADER_BYTES, nginx's order).
MAX_HEAD = 64 * 1024
# A pooled connection idle for longer is closed rather than reused: uvicorn (vLLM's
# server) closes keep-alive connections after 5 s idle, and a request written as it
# closes one would be lost in the race.
IDLE_S = 4.0
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# Which implementation serves requests (see the module docstring).
CLIENT_ENV = "GPUCTL_PROXY_CLIENT"


class UpstreamError(Exception):
    """The upstream failed to give an answer (or a whole one)."""


class ConnectFailed(UpstreamError):
    """No connection to the upstream (refused, unreachable, no such host)."""


class UpstreamTimeout(UpstreamError):
    """No connection, or no byte of an awaited answer, within the timeout."""


class UpstreamTooLarge(UpstreamError):
    """An answer head over the limit, or a body read whole over ``MAX_BODY``."""


class UpstreamClosed(UpstreamError):
    """The server closed the connection before the answer ended."""


class UpstreamUntrusted(UpstreamError):
    """An https upstream whose certificate does not verify (``tls_context``)."""


class Response(Protocol):
    """An answer whose head has arrived. ``headers``: names lower-case, in order,
    repeats kept. ``aclose`` (always call it) gives the connection back, or aborts it
    when the body was not read to the end."""

    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def head_only(self) -> bool:
        """The answer to a HEAD: no body, whatever its length says."""
        ...

    def header(self, name: bytes) -> bytes | None: ...

    async def read(self) -> bytes:
        """The whole body (``UpstreamTooLarge`` past ``MAX_BODY``)."""
        ...

    def complete_body(self) -> bytes | None:
        """The whole body when all of it has arrived already, without waiting; else
        None. Raises the upstream's error when one is known already."""
        ...

    async def next(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some), or
        ``b""`` at its end."""
        ...

    def aclose(self) -> None: ...


class Origin(Protocol):
    """Keep-alive connections to one ``scheme://host:port``."""

    def idle_count(self) -> int:
        """Connections kept for reuse now (the tests' view of the pool)."""
        ...

    async def request(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        idempotent: bool,
    ) -> Response:
        """Send one request (``target``: the path and query as the client escaped
        them); its answer once the head has arrived. ``idempotent``: safe to send
        again (see the retry rule)."""
        ...


class UpstreamClient(Protocol):
    def pool(self, origin: str) -> Origin: ...

    async def aclose(self) -> None:
        """End every idle connection."""
        ...


@functools.cache
def tls_context() -> ssl.SSLContext:
    """What an https upstream's certificate is verified against, hostname included: the
    CA bundle that ``SSL_CERT_FILE`` names (or the folder ``SSL_CERT_DIR`` names), else
    certifi's. That is httpx's own choice, so gpuctl's health checks (the ensure flow's)
    and the proxy trust the same servers. Raises ``OSError`` (``ssl.SSLError``) for a
    bundle that cannot be loaded."""
    return httpx.create_ssl_context()


def untrusted_text(why: str) -> str:
    return (
        f"its TLS certificate is not trusted ({why}): set SSL_CERT_FILE to the CA bundle "
        "that signed it, for the proxy as for gpuctl"
    )


def is_idempotent(method: str) -> bool:
    return method in _SAFE_METHODS


def has_line_break(headers: list[tuple[bytes, bytes]]) -> bool:
    """A header with a CR or LF in it would smuggle a request (uvicorn refuses them
    already; this is the last guard)."""
    return any(b"\r" in k or b"\n" in k or b"\r" in v or b"\n" in v for k, v in headers)


def make_client(
    read_timeout_s: float, connect_timeout_s: float, *, https: bool
) -> httpx.AsyncClient:
    """httpx for the cold paths. ``https``: some upstream speaks it: verify as the
    requests' client does (``tls_context``); without it, this client ignored
    ``SSL_CERT_FILE`` (no ``trust_env``), so an https server the requests reached failed
    every health check."""
    return httpx.AsyncClient(
        verify=tls_context() if https else True,
        timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
        follow_redirects=False,
        trust_env=False,  # loopback upstreams: never through an HTTP(S)_PROXY
    )
