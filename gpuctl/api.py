"""The Python API for applications that need a model server per request.

::

    from gpuctl.api import ensure_ready, in_use

    async with in_use("vllm"):                   # or: with in_use("vllm"):
        result = await ensure_ready("vllm")      # or ensure_ready_sync("vllm")
        if not result.ready:
            log.warning("translation skipped: %s", result.reason)
        else:
            ...                                  # the request: reclaim will not cut it

While an ``in_use`` block runs, the service counts as in use (``gpuctl reclaim`` never
stops it). The process keeps its own count; the store is written only when that count
moves between 0 and 1, and renewed every few seconds while busy, so a busy app takes
no file lock per request.

When the service is already healthy this costs one health request: no agent call, no
lock, and no file write beyond a touch at most every ``TOUCH_EVERY_S`` per service and
process. A service over a pool of hosts (``hosts = [...]``) is asked where this process
last found it, then on each other host of the pool; the result's ``host`` says where it
answers, and ``in_use(..., host=...)`` counts it there (the store whose reclaim it keeps
off). Like the original, it does not raise for BUSY, UNKNOWN, FAILED or a timeout:
it returns a result that says READY or why not, for the app to log and skip. It raises
only for misuse: an unknown service, or a broken config (``gpuctl.errors.UsageError``,
``ConfigError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gpuctl.config import Config, ServiceConfig, load_config
from gpuctl.core.record import INFLIGHT_TTL_MAX_S, stopping
from gpuctl.errors import ConfigError, ExitCode, GpuctlError, UsageError

TOUCH_EVERY_S = 30.0
HEALTH_TIMEOUT_S = 2.0


class ReadyResult(msgspec.Struct, frozen=True):
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
    # Where it answers (READY) or loads (LOADING): one host of its pool
    # (``hosts = [...]``), else its ``host``; empty for any other decision.
    host: str = ""


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
# (config path, service) -> the host of its pool where this process last found it
# ready: the fast path asks that host's health first, and ``in_use`` counts there.
_where: dict[tuple[str, str], str] = {}
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


def _found(conf: Config, name: str, host: str) -> None:
    if host:
        with _lock:
            _where[(str(conf.path), name)] = host


def where(service: str, *, config: Config | Path | str | None = None) -> str:
    """The host where ``service`` was last found ready by this process (``ensure_ready``):
    for a pooled service (``hosts = [...]``) the host of its pool that runs the copy,
    else (or before the first ``ensure_ready``) its first host."""
    conf = _config(config)
    svc = conf.service(service)
    with _lock:
        host = _where.get((str(conf.path), service))
    return host if host is not None and host in svc.hosts else svc.host


def _placements(conf: Config, svc: ServiceConfig) -> list[ServiceConfig]:
    """The service on each host of its pool, where it was last found first, then the rest
    in the config's order (a service of one host: itself)."""
    if not svc.pooled:
        return [svc]
    last = where(svc.name, config=conf)
    order = [last, *(h for h in svc.hosts if h != last)]
    return [conf.placed(svc.name, h) for h in order]


def _touch_due(conf: Config, svc: ServiceConfig) -> bool:
    key = (str(conf.path), f"{svc.name}@{svc.host}")
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
            store.touch(svc.name, ready=True, promise=svc.promise())
        finally:
            store.close()
    except GpuctlError:
        pass


def _slow_path(conf: Config, name: str, timeout: float | None, wait: bool) -> ReadyResult:
    from gpuctl.flows.deps import EnsureRequest
    from gpuctl.wiring.build import ensure_runner

    try:
        deps, ensure = ensure_runner(conf, name)
    except (UsageError, ConfigError):
        raise
    except GpuctlError as e:
        return ReadyResult(
            name, False, "UNKNOWN" if e.exit_code == ExitCode.UNKNOWN else "FAILED", e.message
        )
    try:
        r = ensure(EnsureRequest(entry="api", timeout_s=timeout, wait=wait))
    except (UsageError, ConfigError):
        raise
    except GpuctlError as e:
        return ReadyResult(
            name, False, "UNKNOWN" if e.exit_code == ExitCode.UNKNOWN else "FAILED", e.message
        )
    finally:
        deps.close()
    decision = _OUTCOME_DECISION[r.outcome]
    ready = decision == "READY"
    if ready:
        _found(conf, name, r.host)
    host = r.host if decision in ("READY", "LOADING") else ""
    return ReadyResult(name, ready, decision, r.reason, r.waited_s, r.launched, host)


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
    if not svc.health_means_ready:
        return _slow_path(conf, service, timeout, wait)
    with _lock:
        client = _sync_clients.get("")
        if client is None:
            client = _sync_clients[""] = httpx.Client(timeout=HEALTH_TIMEOUT_S)
    for placed in _placements(conf, svc):
        assert placed.health is not None
        try:
            healthy = client.get(placed.health).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            _found(conf, service, placed.host)
            if _touch_due(conf, placed):
                _touch(conf, placed)
            return ReadyResult(service, True, "READY", "answers its health check", host=placed.host)
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
    if not svc.health_means_ready:
        return await asyncio.to_thread(_slow_path, conf, service, timeout, wait)
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        _async_clients[loop] = client
    # A pooled service: where it was last found, then each other host of its pool in
    # order; only when none answers, the pool's ensure (which may start it).
    for placed in _placements(conf, svc):
        assert placed.health is not None
        try:
            healthy = (await client.get(placed.health)).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            _found(conf, service, placed.host)
            if _touch_due(conf, placed):
                await asyncio.to_thread(_touch, conf, placed)
            return ReadyResult(service, True, "READY", "answers its health check", host=placed.host)
    # The slow path is the sync flow (locks, waits) in a worker thread: one core, no
    # second async implementation of the same rules.
    return await asyncio.to_thread(_slow_path, conf, service, timeout, wait)


async def aclose() -> None:
    """Close this event loop's health-check client (call it when the app shuts down)."""
    client = _async_clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


class in_use:  # lower case: used like contextlib's context managers
    """While the block runs, ``service`` counts as in use: ``gpuctl reclaim`` (and any
    stop) never stops it. A sync and an async context manager::

        with in_use("vllm"): ...
        async with in_use("vllm"): ...

    Entering when this process already has a block open on the service costs a lock
    and a counter (no I/O). The first block writes an entry to the host's store (tied to
    this process like a lease, so a crash leaves nothing behind), the last one removes
    it; meanwhile a thread renews it, and marks the service used, every
    ``INFLIGHT_RENEW_S``. When a stop of the service is under way, entering waits for it
    to end (then ``ensure_ready`` starts the service again).

    The count is written to the store of the host where the service runs: ``host``,
    else for a pooled service (``hosts = [...]``) where this process's ``ensure_ready``
    last found it (``where``), else its host. That host's reclaim and preemption are
    the ones it keeps off.

    A store that cannot be reached does not fail the app: the block runs uncounted and
    the failure is logged (``gpuctl`` logger). Raises only for misuse (an unknown
    service or host, or a broken config).
    """

    __slots__ = ("_use",)

    def __init__(
        self,
        service: str,
        *,
        config: Config | Path | str | None = None,
        host: str | None = None,
    ) -> None:
        conf = _config(config)
        if host is None:
            host = where(service, config=conf)  # UsageError for an unknown service
        key = (str(conf.path), service, host)
        use = _uses.get(key)
        if use is None:
            svc = conf.placed(service, host)  # UsageError for a host not of its pool
            with _lock:
                use = _uses.setdefault(key, _Use(conf, svc))
        self._use = use

    @property
    def host(self) -> str:
        """The host whose store holds this count."""
        return str(self._use.svc.host)

    def __enter__(self) -> None:
        self._use.enter()

    def __exit__(self, *exc: object) -> None:
        self._use.exit()

    async def __aenter__(self) -> None:
        if not self._use.enter_fast():
            await asyncio.to_thread(self._use.enter)

    async def __aexit__(self, *exc: object) -> None:
        if not self._use.exit_fast():
            await asyncio.to_thread(self._use.exit)

    async def aexit_lingering(self, seconds: float) -> bool:
        """Leave the block as ``async with`` does, but when it was this process's last
        use of the service, the store keeps its entry ``seconds`` longer (at most
        ``INFLIGHT_TTL_S``) as a *lingering* one (``gpuctl.core.record.LINGER_ENTRY``):
        no request in flight, but reclaim keeps the service and a preemption waits until
        it lapses. So until then this process may send the service its next request
        before entering again (which counts it even while a stop holds the service's
        lease). Returns whether the entry lingers (False: it ended as usual, as it does
        while a stop holds the service's lease)."""
        if self._use.exit_fast():
            return False
        return await asyncio.to_thread(self._use.exit, seconds)

    async def aextend_lingering(self, seconds: float) -> bool:
        """Start the term of the entry the last ``aexit_lingering`` left lingering again:
        ``seconds`` from now (no block of this process may be open on the service; call
        it well before the entry lapses, which the store does not undo). Returns whether
        the store took it (False: it was not asked, could not be reached, or a stop holds
        the service: the entry then lapses as it stood)."""
        return await asyncio.to_thread(self._use.extend_lingering, seconds)

    async def aend_lingering(self) -> None:
        """End the entry the last ``aexit_lingering`` left lingering, now (no block of
        this process may be open on the service)."""
        await asyncio.to_thread(self._use.end_lingering)

    @property
    def record(self) -> Any:
        """The service's record (a ``gpuctl.core.record.Record``) as the store returned
        it when this process's use last began or ended; None before the first, or when
        the store could not be reached. A caller that saw the server ready compares two
        of them: the same phase ``since`` means no stop, sleep or start came between."""
        return self._use.record


INFLIGHT_TTL_S = INFLIGHT_TTL_MAX_S
INFLIGHT_RENEW_S = 5.0
INFLIGHT_WAIT_S = 120.0


class _Use:
    """This process's in-flight count for one service, and its entry in the store."""

    def __init__(self, conf: Config, svc: ServiceConfig) -> None:
        self.conf, self.svc = conf, svc
        self.count = 0
        self.lock = threading.Lock()  # held through a 0 <-> 1 transition's I/O
        self.store: Any = None
        self.holder: Any = None
        self.stop_renewing: threading.Event | None = None
        self.record: Any = None  # as the store returned it at the last begin or end
        self.lingering: Any = None  # the holder whose entry the last end left lingering

    def enter_fast(self) -> bool:
        """Count one more use when one is already open (no I/O); False otherwise."""
        with self.lock:
            if self.count > 0:
                self.count += 1
                return True
        return False

    def exit_fast(self) -> bool:
        with self.lock:
            if self.count > 1:
                self.count -= 1
                return True
        return False

    def enter(self) -> None:
        with self.lock:
            self.count += 1
            if self.count == 1:
                try:
                    self._begin()
                except BaseException:
                    self.count -= 1
                    raise

    def exit(self, linger_s: float = 0.0) -> bool:
        """One use less; with the last, its entry ends (or lingers ``linger_s``: True)."""
        with self.lock:
            self.count -= 1
            return self.count == 0 and self._end(linger_s)

    def _begin(self) -> None:
        from gpuctl.adapters.store import holder_here, store_for

        try:
            if self.store is None:
                self.store = store_for(self.conf.host(self.svc.host))
            # The holder whose entry lingers, if any: its begin counts even under a stop.
            self.holder = self.lingering or holder_here("in_use")
            self.lingering = None
            deadline = time.monotonic() + INFLIGHT_WAIT_S
            while True:
                granted, record = self.store.inflight_begin(
                    self.svc.name, self.holder, INFLIGHT_TTL_S
                )
                if granted:
                    self.record = record
                    break
                if time.monotonic() >= deadline:
                    raise GpuctlError(f"{self.svc.name} has been stopping for too long")
                time.sleep(0.25)  # a stop is under way: the use begins after it
        except GpuctlError as e:
            self.holder = None
            self.record = None
            _log.warning("gpuctl: %s is not counted as in use: %s", self.svc.name, e.message)
            return
        stop = self.stop_renewing = threading.Event()
        threading.Thread(
            target=self._renew, args=(self.store, self.holder, stop), daemon=True,
            name=f"gpuctl-in-use-{self.svc.name}",
        ).start()  # fmt: skip

    def _renew(self, store: Any, holder: Any, stop: threading.Event) -> None:
        while not stop.wait(INFLIGHT_RENEW_S):
            try:
                store.inflight_renew(self.svc.name, holder, INFLIGHT_TTL_S)
            except GpuctlError as e:
                _log.warning("gpuctl: cannot renew the use of %s: %s", self.svc.name, e.message)

    def extend_lingering(self, linger_s: float) -> bool:
        with self.lock:
            holder = self.lingering
            if holder is None or self.count:
                return False
            try:
                self.record = self.store.inflight_end(self.svc.name, holder.id, linger_s)
            except GpuctlError as e:
                _log.warning("gpuctl: cannot mark %s used: %s", self.svc.name, e.message)
                return False
            return not stopping(self.record)  # under a stop it stands as it was

    def end_lingering(self) -> None:
        with self.lock:
            holder, self.lingering = self.lingering, None
            if holder is None or self.count:
                return
            try:
                self.record = self.store.inflight_end(self.svc.name, holder.id)
            except GpuctlError as e:
                _log.warning("gpuctl: cannot end the use of %s: %s", self.svc.name, e.message)

    def _end(self, linger_s: float = 0.0) -> bool:
        if self.stop_renewing is not None:
            self.stop_renewing.set()
            self.stop_renewing = None
        if self.holder is None:
            return False
        holder, self.holder = self.holder, None
        try:
            if linger_s:
                try:
                    self.record = self.store.inflight_end(self.svc.name, holder.id, linger_s)
                    if stopping(self.record):
                        return False  # under a stop the store ends it: nothing lingers
                    self.lingering = holder
                    return True
                except UsageError:
                    pass  # an agent of a release before lingering entries: just end
            self.record = self.store.inflight_end(self.svc.name, holder.id)
        except GpuctlError as e:
            self.record = None
            # The entry expires (or is voided with this process) by itself.
            _log.warning("gpuctl: cannot end the use of %s: %s", self.svc.name, e.message)
        return False


_uses: dict[tuple[str, str, str], _Use] = {}
_log = logging.getLogger("gpuctl")


def _reset_for_tests() -> Any:
    """Forget cached configs, clients and touch times (tests load many configs)."""
    with _lock:
        _configs.clear()
        _last_touch.clear()
        _where.clear()
        for c in _sync_clients.values():
            c.close()
        _sync_clients.clear()
        for use in _uses.values():
            if use.store is not None:  # its client's connection, closed, not left to GC
                with contextlib.suppress(Exception):
                    use.store.close()
        _uses.clear()
    _async_clients.clear()
