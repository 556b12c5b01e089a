"""The proxy's httpx client, for its cold paths: health checks and model cards.

Requests themselves go through ``gpuctl.proxy.h1`` (a lean keep-alive client): httpx's
per-request cost was most of the proxy's own.
"""

from __future__ import annotations

import httpx


def make_client(
    read_timeout_s: float, connect_timeout_s: float, *, https: bool
) -> httpx.AsyncClient:
    """``https``: some upstream speaks it: verify as the requests' client does
    (``h1.tls_context``); without it, this client ignored ``SSL_CERT_FILE`` (no
    ``trust_env``), so an https server the requests reached failed every health check."""
    from gpuctl.proxy.h1 import tls_context

    return httpx.AsyncClient(
        verify=tls_context() if https else True,
        timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
        follow_redirects=False,
        trust_env=False,  # loopback upstreams: never through an HTTP(S)_PROXY
    )
