"""The Python API for applications that need a model server per request.

::

    from gpuctl.api import ensure_ready

    result = await ensure_ready("vllm")          # or ensure_ready_sync("vllm")
    if not result.ready:
        log.warning("translation skipped: %s", result.reason)

When the service is already healthy this costs one health request: no agent call, no
lock, and no file write beyond a touch at most every ``TOUCH_EVERY_S`` per service and
process. Like the original, it does not raise for BUSY, UNKNOWN, FAILED or a timeout:
it returns a result that says READY or why not, for the app to log and skip. It raises
only for misuse: an unknown service, or a broken config (``gpuctl.errors.UsageError``,
``ConfigError``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gpuctl.config import Config, ServiceConfig, load_config
from gpuctl.errors import ConfigError, GpuctlError, UsageError

TOUCH_EVERY_S = 30.0
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class ReadyResult:
    """``ready`` is True exactly when ``decision == "READY"``.

    ``decision`` is READY, LOADING (with ``wait=False``), BUSY, UNKNOWN, FAILED or
    TIMEOUT; ``reason`` says why in words.
    """

    service: str
    ready: bool
    decision: str
    reason: str
    waited_s: float = 0.0
    launched: bool = False


_OUTCOME_DECISION = {
    "ready": "READY",
    "started": "LOADING",
    "loading": "LOADING",
    "busy": "BUSY",
    "unknown": "UNKNOWN",
    "failed": "FAILED",
    "timeout": "TIMEOUT",
    "interrupted": "UNKNOWN",
}

_lock = threading.Lock()
_configs: dict[str, Config] = {}
_last_touch: dict[tuple[str, str], float] = {}
_sync_clients: dict[str, httpx.Client] = {}  # one, shared by every thread
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _config(config: Config | Path | str | None) -> Config:
    if isinstance(config, Config):
        return config
    key = str(config) if config is not None else ""
    with _lock:
        cached = _configs.get(key)
    if cached is not None:
        return cached
    conf = load_config(Path(config) if config is not None else None)
    with _lock:
        _configs[key] = conf
    return conf


def _service(conf: Config, name: str) -> ServiceConfig:
    svc = conf.service(name)
    if not svc.health and svc.launcher != "ollama":  # an Ollama model: /api/ps
        raise ConfigError(
            f"services.{name}.health: missing; ensure_ready cannot tell when it is ready"
        )
    return svc


def _touch_due(conf: Config, svc: ServiceConfig) -> bool:
    key = (str(conf.path), svc.name)
    now = time.monotonic()
    with _lock:
        if now - _last_touch.get(key, -1e9) < TOUCH_EVERY_S:
            return False
        _last_touch[key] = now
        return True


def _touch(conf: Config, svc: ServiceConfig) -> None:
    """Mark it used through the host's store path; a failure here must not fail the app."""
    from gpuctl.adapters.store import store_for

    try:
        store = store_for(conf.host(svc.host))
        try:
            store.touch(svc.name, ready=True)
        finally:
            store.close()
    except GpuctlError:
        pass


def _slow_path(conf: Config, name: str, timeout: float | None, wait: bool) -> ReadyResult:
    from gpuctl.flows.ensure import ensure
    from gpuctl.flows.wiring import deps_for

    try:
        deps = deps_for(conf, name, entry="api")
    except (UsageError, ConfigError):
        raise
    except GpuctlError as e:
        return ReadyResult(name, False, "UNKNOWN" if e.exit_code == 4 else "FAILED", e.message)
    try:
        r = ensure(deps, timeout_s=timeout, wait=wait)
    except (UsageError, ConfigError):
        raise
    except GpuctlError as e:
        return ReadyResult(name, False, "UNKNOWN" if e.exit_code == 4 else "FAILED", e.message)
    finally:
        deps.close()
    decision = _OUTCOME_DECISION[r.outcome]
    return ReadyResult(name, decision == "READY", decision, r.reason, r.waited_s, r.launched)


def ensure_ready_sync(
    service: str,
    *,
    config: Config | Path | str | None = None,
    timeout: float | None = None,
    wait: bool = True,
) -> ReadyResult:
    """The synchronous twin of ``ensure_ready``."""
    conf = _config(config)
    svc = _service(conf, service)
    with _lock:
        client = _sync_clients.get("")
        if client is None:
            client = _sync_clients[""] = httpx.Client(timeout=HEALTH_TIMEOUT_S)
    assert svc.health is not None
    try:
        healthy = client.get(svc.health).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if healthy:
        if _touch_due(conf, svc):
            _touch(conf, svc)
        return ReadyResult(service, True, "READY", "answers its health check")
    return _slow_path(conf, service, timeout, wait)


async def ensure_ready(
    service: str,
    *,
    config: Config | Path | str | None = None,
    timeout: float | None = None,
    wait: bool = True,
) -> ReadyResult:
    """Make ``service`` ready (starting it if that is safe) and say whether it is.

    Args:
        service: a service name from the config.
        config: a loaded ``Config``, a path, or None for the usual lookup (cached).
        timeout: seconds to wait at most (default: the service's health_timeout).
        wait: False returns as soon as a start is under way.
    """
    conf = _config(config)
    svc = _service(conf, service)
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        _async_clients[loop] = client
    assert svc.health is not None
    try:
        healthy = (await client.get(svc.health)).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if healthy:
        if _touch_due(conf, svc):
            await asyncio.to_thread(_touch, conf, svc)
        return ReadyResult(service, True, "READY", "answers its health check")
    # The slow path is the sync flow (locks, waits) in a worker thread: one core, no
    # second async implementation of the same rules.
    return await asyncio.to_thread(_slow_path, conf, service, timeout, wait)


async def aclose() -> None:
    """Close this event loop's health-check client (call it when the app shuts down)."""
    client = _async_clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


def _reset_for_tests() -> Any:
    """Forget cached configs, clients and touch times (tests load many configs)."""
    with _lock:
        _configs.clear()
        _last_touch.clear()
        for c in _sync_clients.values():
            c.close()
        _sync_clients.clear()
    _async_clients.clear()
