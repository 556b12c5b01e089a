"""One keep-alive httpx client per command, with TLS set up only when a URL needs it.

``httpx.Client()`` builds a verifying TLS context (the CA bundle: about 24 ms of CPU) at
construction, even when every URL is ``http://``; ``gpuctl status --all`` over 16 hosts
built 48 of them. Here the plain-HTTP transport gets a context that never does TLS, and
the ``https://`` transport is made on its first request.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _plain_tls_context() -> ssl.SSLContext:
    """A TLS context that never does TLS: the transport for ``http://`` URLs needs one
    built, and httpx's default loads the CA bundle (about 24 ms of CPU) for nothing.
    ``https://`` URLs never reach it (see ``http_client``)."""
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class _LazyTransport(httpx.BaseTransport):
    """Builds the real (verifying) HTTPS transport on the first ``https://`` request."""

    def __init__(self) -> None:
        self._inner: httpx.HTTPTransport | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            self._inner = httpx.HTTPTransport()
        return self._inner.handle_request(request)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


class _AsyncLazyTransport(httpx.AsyncBaseTransport):
    """The async twin of ``_LazyTransport``."""

    def __init__(self) -> None:
        self._inner: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            self._inner = httpx.AsyncHTTPTransport()
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()


def http_client(
    timeout_s: float = 3.0, *, transport: httpx.BaseTransport | None = None
) -> httpx.Client:
    """One keep-alive client for every call of a command: agent, records, health checks.

    TLS (certificate verification, the CA bundle) is set up only when an ``https://`` URL
    is asked. The client carries no credentials: each call sends its own headers, so a
    server's health URL never sees the agent's token.
    """
    if transport is not None:
        return httpx.Client(timeout=httpx.Timeout(timeout_s), transport=transport)
    return httpx.Client(
        timeout=httpx.Timeout(timeout_s),
        transport=httpx.HTTPTransport(verify=_plain_tls_context()),
        mounts={"https://": _LazyTransport()},
    )


def async_http_client(
    timeout_s: float = 3.0, *, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The async twin of ``http_client``."""
    if transport is not None:
        return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), transport=transport)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        transport=httpx.AsyncHTTPTransport(verify=_plain_tls_context()),
        mounts={"https://": _AsyncLazyTransport()},
    )
