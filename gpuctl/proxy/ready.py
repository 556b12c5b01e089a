"""Making a service ready for the proxy: one check or start per service at a time.

Requests for a service that is not known to be ready join one asyncio task per service
(single flight in this process); the task asks the server's health URL, and only when
that fails runs the CLI's own ensure flow (``gpuctl.flows.ensure.rounds``) in a worker thread.
Across proxy processes (and ``gpuctl ensure`` callers) the store's lease already
serialises starts: only the lease holder launches, the others wait for its server.

A service is trusted as ready only while the proxy has requests in flight on it (the
store's in-flight count keeps reclaim off it meanwhile). When its last request ends it
is checked again on the next one, since reclaim or ``gpuctl stop`` may act in between:
by the record its count's write returns when that says nothing came between
(``use.ServiceUse.again``), else here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import msgspec
from msgspec.structs import replace

from gpuctl.config import Config, ServiceConfig
from gpuctl.config.slurm_fields import NODE
from gpuctl.core.units import format_duration
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.flows.op_results import EnsureResult, Outcome
from gpuctl.flows.results import Progress

if TYPE_CHECKING:
    from gpuctl.core.snapshot import Snapshot
    from gpuctl.flows.deps import EnsureDeps

log = logging.getLogger("gpuctl.proxy")

HEALTH_TIMEOUT_S = 2.0
# Readiness.outcome of an https server whose certificate does not verify: a start would
# not help (something answers there), so the flow is not run.
UNTRUSTED = "untrusted"


class Readiness(msgspec.Struct, frozen=True):
    """How one check or start ended: ``ok`` means forward the request."""

    ok: bool
    outcome: str  # an Outcome value
    reason: str
    hint: str = ""
    launched: bool = False
    cold: bool = False  # it went through the ensure flow: the server was not answering
    # The host of its pool where it answers (or was picked): the proxy forwards there.
    # Empty when the flow could not say (it failed before a pick).
    host: str = ""


def run_ensure(
    conf: Config,
    name: str,
    timeout_s: float,
    progress: Callable[[Progress], None],
    host: str | None = None,
) -> Readiness:
    """The CLI's ensure flow, blocking (call it in a worker thread). ``host``: a pooled
    service is started there alone, as ``gpuctl ensure --host``."""
    from gpuctl.flows.deps import EnsureDeps, EnsureRequest
    from gpuctl.flows.ports import Tell
    from gpuctl.wiring.build import ensure_runner

    try:
        deps, ensure = ensure_runner(conf, name, host, tell=Tell(progress=progress))
    except GpuctlError as e:
        out = Outcome.UNKNOWN if e.exit_code == ExitCode.UNKNOWN else Outcome.FAILED
        return Readiness(False, out.value, e.message, e.hint or "", cold=True)
    if isinstance(deps, EnsureDeps):
        _first_look_fresh(deps)
    try:
        r: EnsureResult = ensure(EnsureRequest(entry="proxy", timeout_s=timeout_s))
    except GpuctlError as e:
        out = Outcome.UNKNOWN if e.exit_code == ExitCode.UNKNOWN else Outcome.FAILED
        return Readiness(False, out.value, e.message, e.hint or "", cold=True)
    finally:
        deps.close()
    ok = r.outcome is Outcome.READY
    return Readiness(ok, r.outcome.value, r.reason, r.hint, r.launched, cold=True, host=r.host)


def _in_daemon_thread(fn: Callable[[], Readiness], *, name: str) -> asyncio.Future[Readiness]:
    """``fn()`` in a thread of its own that does not hold up the proxy's exit.

    Not ``asyncio.to_thread``: the loop's executor is joined when the proxy stops, and an
    ensure waits for its server's health for up to its ``health_timeout`` (minutes), so a
    stopped proxy hung on. Left behind at exit, the ensure is what a caller killed
    mid-wait is: its lease dies with this process and the server goes on loading.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Readiness] = loop.create_future()

    def settle(result: Readiness | None, err: BaseException | None) -> None:
        if fut.done():  # its waiter was cancelled
            return
        if err is not None:
            fut.set_exception(err)
        else:
            assert result is not None
            fut.set_result(result)

    def work() -> None:
        try:
            result, err = fn(), None
        except BaseException as e:  # handed to the awaiting task, whatever it is
            result, err = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(settle, result, err)

    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


def _first_look_fresh(deps: EnsureDeps) -> None:
    """The flow's first look at the GPU reads it fresh; its later polls (a start's wait)
    may come from the agent's reading cache.

    The proxy runs the flow only when the service did not answer its health check, and
    a request that comes just after the GPU was freed must not be refused on a reading
    taken before (the agent keeps one for a moment; only its own store writes drop it,
    and the proxy writes nothing before a request is served: see ``ProxyApp._serve``).
    """
    cached, fresh = deps.probe.read, deps.probe.fresh()
    if fresh is cached:
        return  # a local probe reads fresh anyway
    first = [True]

    def read(match: Sequence[str], pids: Sequence[int]) -> Snapshot:
        if first:
            first.clear()
            return fresh(match, pids)
        return cached(match, pids)

    deps.probe = replace(deps.probe, read=read)


def _unverified(e: BaseException) -> str | None:
    """Why a certificate did not verify, when that is what failed (httpx wraps ssl's)."""
    seen: BaseException | None = e
    for _ in range(8):  # the cause chain, a few links deep
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    return None


def _tell_cold(conf: Config, svc: ServiceConfig, host: str, held: int, seconds: float) -> None:
    """Journal a cold start through the proxy (``flows.story``) on ``host``, where it
    started; never raises."""
    from gpuctl.adapters.store import store_for
    from gpuctl.flows import story

    try:
        store = store_for(conf.host(host))
    except GpuctlError:
        return
    try:
        event = story.ev("proxy", svc.name, "proxy", requests_held=held, waited_s=seconds)
        story.tell(store, event)
    finally:
        store.close()


class SingleFlight:
    """One readiness task per service; every request for it awaits the same one."""

    def __init__(
        self,
        conf: Config,
        client: httpx.AsyncClient,
        ensure: Callable[
            [Config, str, float, Callable[[Progress], None], str | None], Readiness
        ] = run_ensure,
        cold_starts: dict[str, int] | None = None,
        only: str | None = None,
    ) -> None:
        self.conf = conf
        # ``gpuctl proxy --host``: a pooled service is asked, and started, on this host
        # alone (its copy elsewhere is another proxy's to front).
        self.only = only
        # service -> cold starts: one per readiness task that went through the ensure
        # flow, however many requests it held (the proxy's metrics)
        self.cold_starts: dict[str, int] = {} if cold_starts is None else cold_starts
        self.client = client
        self.ensure = ensure
        self.tasks: dict[str, asyncio.Task[Readiness]] = {}
        self.progress: dict[str, tuple[float, Progress | None]] = {}
        self.launches = 0  # starts this proxy's ensure launched (for tests and metrics)
        self.held: dict[str, int] = {}  # requests waiting on the readiness task under way

    def get(self, svc: ServiceConfig) -> asyncio.Task[Readiness]:
        """The service's task under way, or a new one."""
        task = self.tasks.get(svc.name)
        self.held[svc.name] = self.held.get(svc.name, 0) + 1 if task is not None else 1
        if task is None:
            task = asyncio.create_task(self._run(svc), name=f"gpuctl-proxy-ready-{svc.name}")
            self.tasks[svc.name] = task
            name = svc.name
            task.add_done_callback(lambda t: self._done(name, t))
        return task

    def _done(self, name: str, task: asyncio.Task[Readiness]) -> None:
        if self.tasks.get(name) is task:
            del self.tasks[name]
        self.progress.pop(name, None)
        if task.cancelled() or task.exception() is not None:
            return
        if task.result().launched:
            self.launches += 1
        if task.result().cold:
            self.cold_starts[name] = self.cold_starts.get(name, 0) + 1

    async def _check(self, svc: ServiceConfig) -> Readiness | None:
        """READY when ``svc``'s health URL answers 200 (on its host), UNTRUSTED when its
        certificate does not verify; None: the flow must tell."""
        assert svc.health is not None
        try:
            r = await self.client.get(svc.health, timeout=HEALTH_TIMEOUT_S)
            if r.status_code == 200:
                text = "answers its health check"
                return Readiness(True, Outcome.READY.value, text, host=svc.host)
        except httpx.HTTPError as e:
            why = _unverified(e)
            if why is not None:
                from gpuctl.proxy.upstream import untrusted_text

                u = urlsplit(svc.health)  # its origin: no credentials shown
                where = f"https://{u.netloc.rpartition('@')[2]}"
                text = f"{svc.name}'s server at {where}: {untrusted_text(why)}"
                return Readiness(False, UNTRUSTED, text, host=svc.host)
        return None

    def loading_text(self, name: str) -> str:
        """``loading 2m10s of ~5m40s``: how long this start has run (and is expected to)."""
        started, p = self.progress.get(name, (time.monotonic(), None))
        elapsed = time.monotonic() - started
        text = f"loading {format_duration(elapsed)}"
        if p is not None and p.expected_s:
            text += f" of ~{format_duration(p.expected_s)}"
        return text

    def retry_after_s(self, name: str, fallback_s: float) -> float:
        """When a client refused for a start under way should come back: what is left of
        the start by its ETA (the median of its recent starts), at least 1 s; one past
        its ETA, a tenth of it; without an ETA (a first start, none under way),
        ``fallback_s`` (the proxy's ``retry_after``)."""
        started, p = self.progress.get(name, (0.0, None))
        if p is None or not p.expected_s:
            return fallback_s
        left = p.expected_s - (time.monotonic() - started)
        if left <= 0:
            return min(fallback_s, max(1.0, p.expected_s / 10))
        return min(fallback_s, max(1.0, left))

    async def _run(self, svc: ServiceConfig) -> Readiness:
        # ``svc`` is placed where the proxy last found it; a pooled service's other hosts
        # are asked after it, in the config's order: a 200 is READY there. Only when none
        # answers does the flow run (it picks the host anew, and may start it).
        # A Slurm job's `{node}` is known only to the ensure flow (it asks squeue), whose
        # first step is this same health check.
        if svc.health_means_ready and NODE not in (svc.health or ""):
            others = [
                self.conf.placed(svc.name, h)
                for h in svc.hosts
                if h != svc.host and self.only is None
            ]
            for placed in (svc, *others):
                answer = await self._check(placed)
                if answer is not None:
                    return answer
        self.progress[svc.name] = (time.monotonic(), None)

        def progress(p: Progress) -> None:  # from the worker thread: one assignment
            self.progress[svc.name] = (self.progress.get(svc.name, (time.monotonic(),))[0], p)

        started = time.monotonic()
        try:
            got = await _in_daemon_thread(
                lambda: self.ensure(self.conf, svc.name, svc.health_timeout_s, progress, self.only),
                name=f"gpuctl-proxy-ensure-{svc.name}",
            )
            if got.launched:  # a cold start: the journal says how many requests it held
                held, secs = self.held.pop(svc.name, 1), time.monotonic() - started
                where = got.host or svc.host
                await asyncio.to_thread(_tell_cold, self.conf, svc, where, held, secs)
            return got
        except Exception as e:  # a bug must not leave every waiter hanging
            log.exception("ensure of %s failed", svc.name)
            return Readiness(False, Outcome.FAILED.value, f"ensure failed: {e}", cold=True)
