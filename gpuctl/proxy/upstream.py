"""The proxy's httpx client, for its cold paths: health checks and model cards.

Requests themselves go through ``gpuctl.proxy.h1`` (a lean keep-alive client): httpx's
per-request cost was most of the proxy's own.
"""

from __future__ import annotations

import httpx


def make_client(read_timeout_s: float, connect_timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=16),
        follow_redirects=False,
        trust_env=False,  # loopback upstreams: never through an HTTP(S)_PROXY
    )
