"""Health checks of model servers (vLLM semantics: ``/health`` answers 200 once ready).

``curl -s -o /dev/null -w '%{http_code}' http://dgx:8000/health``

Connection refused is not a failure by itself: vLLM binds its port before loading
the weights and listens only once the model is loaded. Whether that means
"loading" or "dead" is the decision's job, with the process list in hand.
"""

from __future__ import annotations

import ipaddress

import httpx

from gpuctl.adapters import vllm
from gpuctl.core.decision import NO_HEALTH, Health
from gpuctl.core.health_reach import IpAddress
from gpuctl.core.redact import mask_url_passwords, show_url


def _from_response(url: str, status: int) -> Health:
    url = show_url(url)
    if status == 200:
        return Health("ready", url, 200)
    if status == 503:
        return Health("error", f"HTTP 503 from {url}: engine dead", 503)
    return Health("error", f"HTTP {status} from {url}", status)


def _from_exception(url: str, err: Exception) -> Health:
    url = show_url(url)
    if isinstance(err, httpx.ConnectError):
        return Health("refused", f"connection refused at {url}")
    if isinstance(err, httpx.TimeoutException):
        return Health("timeout", f"no answer from {url}")
    if isinstance(err, httpx.RemoteProtocolError | httpx.ReadError):
        # A Docker userland proxy accepts and then resets while the server loads.
        return Health("refused", f"connection reset at {url}")
    return Health("error", f"{type(err).__name__} from {url}: {mask_url_passwords(str(err))}")


def check(url: str | None, timeout_s: float = 2.0, client: httpx.Client | None = None) -> Health:
    """GET ``url`` once; never raises."""
    if not url:
        return NO_HEALTH
    try:
        if client is not None:
            r = client.get(url, timeout=timeout_s)
        else:
            r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        return _from_exception(url, e)
    return _from_response(url, r.status_code)


def check_sleeping(
    url: str, health: Health, client: httpx.Client, timeout_s: float = 2.0
) -> Health:
    """For a server with vLLM sleep mode: a 200 from a sleeping server is ``sleeping``.

    vLLM answers ``/health`` while asleep, so ``/is_sleeping`` (at the same origin) tells
    a ready server from a sleeping one. Never raises.
    """
    if not health.ok:
        return health

    if vllm.is_sleeping(vllm.origin(url), client, timeout_s):
        return Health("sleeping", f"vLLM sleep mode at {vllm.origin(url)}", 200)
    return health


async def check_async(url: str | None, client: httpx.AsyncClient, timeout_s: float = 2.0) -> Health:
    """The async twin of ``check``."""
    if not url:
        return NO_HEALTH
    try:
        r = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        return _from_exception(url, e)
    return _from_response(url, r.status_code)


def local_addresses() -> frozenset[IpAddress]:
    """This machine's interface addresses (``ip -brief addr``), read afresh each call (an
    interface can come up while the agent runs); empty when they cannot be read."""
    import psutil

    out: set[IpAddress] = set()
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        return frozenset()
    for addrs in interfaces.values():
        for a in addrs:
            try:
                out.add(ipaddress.ip_address(a.address.split("%", 1)[0]))
            except ValueError:
                continue  # a link-layer (MAC) address
    return frozenset(out)
