"""vLLM's own endpoints beyond ``/health``: sleep mode, and the requests it is serving.

::

    curl -X POST 'http://dgx:8000/sleep?level=1&mode=wait'
    curl http://dgx:8000/is_sleeping
    curl -X POST 'http://dgx:8000/wake_up'              # level 1
    curl -X POST 'http://dgx:8000/wake_up?tags=weights'  # level 2: weights,
    curl -X POST http://dgx:8000/collective_rpc -d '{"method": "reload_weights"}'
    curl -X POST 'http://dgx:8000/wake_up?tags=kv_cache' #   reload, then the KV cache
    curl http://dgx:8000/metrics | grep -E 'vllm:num_requests_(running|waiting)'

The sleep endpoints exist only on a server started with ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1``. Sleep asks for ``mode=wait``: vLLM's default, ``abort``,
cuts the requests in flight, and gpuctl never cuts a request.

The base URL of all of these is the origin of the service's ``health`` URL.
"""

from __future__ import annotations

import math
import re
from urllib.parse import urlsplit

import httpx

from gpuctl.core.redact import redact_text, show_url
from gpuctl.errors import LauncherError

# vllm:num_requests_running{model_name="m"} 2.0  (one line per model / engine)
_METRIC = re.compile(
    r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)\s*$",
    re.MULTILINE,
)


def origin(url: str) -> str:
    """``http://dgx:8000/health`` → ``http://dgx:8000``."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def metrics_url(health: str | None, metrics: str | None) -> str | None:
    """Where a service's in-flight requests are read: its ``metrics`` URL, else
    ``/metrics`` at the origin of its ``health`` URL (None: neither is configured)."""
    if metrics:
        return metrics
    if health:
        return origin(health) + "/metrics"
    return None


def parse_in_flight(text: str) -> int:
    """Running plus waiting requests from Prometheus text.

    "Nothing in flight" is only ever read from a page that carries both of vLLM's
    gauges with whole, finite, non-negative values: a page without them (another
    server's metrics, ``vllm_num_requests_running``, an empty page) or with 0.5 says
    nothing about the requests, and reclaim must then keep the server.

    Raises:
        ValueError: a gauge missing, or a value that is not a whole non-negative number.
    """
    total = 0
    seen: set[str] = set()
    for name, value in _METRIC.findall(text):
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"bad metric value {value!r}") from None
        if not math.isfinite(v) or v < 0 or v != int(v):
            raise ValueError(f"bad metric value {value!r}")
        total += int(v)
        seen.add(name)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        if name not in seen:
            raise ValueError(f"no {name} gauge on the page")
    return total


def in_flight(url: str, client: httpx.Client, timeout_s: float = 2.0) -> int | None:
    """The requests a vLLM server is running or has queued, from its ``/metrics``.

    Returns None when the server has no ``/metrics`` at all (404: not a vLLM).

    Raises:
        LauncherError: the metrics cannot be read, or the page lacks vLLM's two gauges
            (an error, not "nothing in flight": reclaim never stops a server it cannot
            read).
    """
    shown = show_url(url)
    try:
        r = client.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        # httpx's own words may repeat the URL: the password goes from those too.
        raise LauncherError(
            f"cannot read {shown}: {type(e).__name__}: {redact_text(str(e))}"
        ) from None
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise LauncherError(f"cannot read {shown}: HTTP {r.status_code}")
    try:
        return parse_in_flight(r.text)
    except ValueError as e:
        raise LauncherError(f"cannot read {shown}: {e}") from None


def is_sleeping(base: str, client: httpx.Client, timeout_s: float = 2.0) -> bool | None:
    """``GET /is_sleeping``; None when the server does not say (no sleep mode, no answer)."""
    try:
        r = client.get(base + "/is_sleeping", timeout=timeout_s)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    value = data.get("is_sleeping") if isinstance(data, dict) else None
    return value if isinstance(value, bool) else None


def _post(client: httpx.Client, url: str, timeout_s: float, **kw: object) -> None:
    try:
        r = client.post(url, timeout=timeout_s, **kw)  # type: ignore[arg-type]
    except httpx.HTTPError as e:
        raise LauncherError(f"POST {url} failed: {type(e).__name__}: {e}") from None
    if r.status_code == 404:
        raise LauncherError(
            f"POST {url}: 404, the server has no sleep mode",
            hint="start vLLM with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, "
            'or use stop = "stop"',
        )
    if r.status_code != 200:
        try:
            detail = str(r.json().get("message") or r.text)
        except (ValueError, AttributeError):
            detail = r.text
        raise LauncherError(f"POST {url}: HTTP {r.status_code}: {detail[:300]}")


def sleep(base: str, level: int, client: httpx.Client, timeout_s: float = 120.0) -> None:
    """Put the server to sleep at ``level`` once its requests in flight are done.

    Raises:
        LauncherError: the server refused or did not answer.
    """
    _post(client, f"{base}/sleep", timeout_s, params={"level": level, "mode": "wait"})


def wake(base: str, level: int, client: httpx.Client, timeout_s: float = 600.0) -> None:
    """Wake the server: level 1 in one call; level 2 in vLLM's documented three steps,
    since its weights were discarded and must be reloaded before the KV cache returns.

    Raises:
        LauncherError: the server refused (a wake that does not fit answers 500 with a
            CUDA out-of-memory error) or did not answer.
    """
    if level >= 2:
        _post(client, f"{base}/wake_up", timeout_s, params={"tags": "weights"})
        _post(client, f"{base}/collective_rpc", timeout_s, json={"method": "reload_weights"})
        _post(client, f"{base}/wake_up", timeout_s, params={"tags": "kv_cache"})
    else:
        _post(client, f"{base}/wake_up", timeout_s)
