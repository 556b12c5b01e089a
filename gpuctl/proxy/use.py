"""The proxy's in-flight count on one service in the store (``gpuctl.api.in_use``).

The proxy holds one count on a service while any of its requests is in flight there.
The last one to end takes it off at once (before its last byte goes, so a client that
saw its answer end sees the count gone) unless the count was written less than
``LINGER_S`` ago; then it comes off ``LINGER_S`` after it was written, unless a request
came meanwhile. So the store's count moves on transitions and at most once per
``LINGER_S``, never per request, and a request that ends leaves nothing behind for long.

A service trusted as ready is checked again once its count is let go (reclaim or a stop
may act from then on). Two ways spare the next request that check:

- **Sporadic requests** (a chat UI's: one every few seconds). When the count of a ready
  service comes off, its store entry stays as a *lingering* one for ``TRUST_S`` (and a
  margin: ``core.record.LINGER_ENTRY``). It counts as no request in flight, but while
  it stands reclaim keeps the service and a preemption waits for it to lapse, and the
  proxy's next count turns it back into a counted entry even under a stop's lease. So
  a request that comes within ``TRUST_S`` goes at once; it is counted once it has run
  ``COUNT_AFTER_S`` (well within the margin), and one that ends sooner restarts the
  entry's term after its answer instead (``again``). No stop that waited for the
  entry can cut it, and a person's ``gpuctl stop`` (which waits for nobody) makes its
  connection fail, which starts the service again as for any request. ``TRUST_S`` is
  kept under the service's ``idle_timeout`` by the margin, so an idle service is
  reclaimed as before.
- **Later requests.** When the next request comes, the count's write returns the
  record: if it is still running since the moment it was let go, nothing stopped, slept
  or restarted it between, and the request goes on without a health check.
"""

from __future__ import annotations

import asyncio
import time

from gpuctl.api import in_use
from gpuctl.core.record import Phase

# Once written, the store's in-flight count of a service stays at least this long:
# requests that come and go faster move it once per LINGER_S at most (never per
# request), and a request that ends after it takes the count off before its last byte.
LINGER_S = 2.0
# After the count of a ready service comes off, a request within this long goes at once
# (its count written meanwhile): the store's entry lingers that long and a margin more.
TRUST_S = 10.0
# What the lingering entry outlasts the proxy's trust by: the count's write of a
# request sent at the trust's last moment lands within it.
TRUST_MARGIN_S = 2.0
# A request sent on the lingering entry's strength is counted once it has run this
# long (well within the margin); one that ends sooner is never counted: the entry's
# term starts again instead, after its answer. So a short request writes nothing
# while it runs.
COUNT_AFTER_S = 0.25


def trust_s(idle_timeout_s: float | None) -> float:
    """How long the proxy may send a ready service its next request without counting
    it first: ``TRUST_S``, kept under ``idle_timeout`` by the margin (0: never)."""
    if idle_timeout_s is None:
        return TRUST_S
    return max(0.0, min(TRUST_S, idle_timeout_s - 2 * TRUST_MARGIN_S))


class ServiceUse:
    """The proxy's own view of one service: requests in flight, its count, readiness."""

    __slots__ = ("_count_at", "_count_task", "_extend_task", "_release_task", "_trusted",
                 "held", "held_since", "in_flight", "kept", "lingers", "lock", "ready",
                 "release", "trust_s", "trusted_until", "use")  # fmt: skip

    def __init__(self, use: in_use, idle_timeout_s: float | None = None) -> None:
        self.in_flight = 0
        self.held = False  # this proxy's in_use count is open (the store has our entry)
        self.held_since = 0.0  # monotonic: when the store's count was written
        self.ready = False  # trusted only while held (see ready.py)
        # The phase ``since`` of the running record the store returned when a ready
        # service was let go: the next use may trust it again by the record (``again``).
        self.kept: float | None = None
        # How long a let-go entry lingers for this service (``trust_s``), and until when
        # (monotonic) the next request may go before its count is written.
        self.trust_s = trust_s(idle_timeout_s)
        self.trusted_until = 0.0
        self.lingers = False  # the store holds a lingering entry of ours
        self.use = use
        self.lock = asyncio.Lock()  # one hold or release at a time
        self.release: asyncio.TimerHandle | None = None
        self._release_task: asyncio.Task[None] | None = None
        # Requests sent on the lingering entry's strength, not counted yet: the record's
        # ``since`` they were trusted by, when their count is due, and its write.
        self._trusted: float | None = None
        self._count_at: asyncio.TimerHandle | None = None
        self._count_task: asyncio.Task[None] | None = None
        self._extend_task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        """Count this proxy as using the service (in the store on its 0 -> 1); nothing
        to wait for while requests run on the lingering entry's strength (``again``)."""
        if self.release is not None:
            self.release.cancel()
            self.release = None
        if self.held or self._trusted is not None:
            return
        await self._hold()

    async def _hold(self) -> None:
        async with self.lock:
            if not self.held:
                await self.use.__aenter__()
                self.held = True
                self.held_since = time.monotonic()

    async def end(self) -> None:
        """One request ended: with the last, the store's count comes off (now, or once
        it has stood ``LINGER_S``)."""
        self.in_flight -= 1
        if not self.in_flight and self._count_at is not None:
            # Every request sent on the entry's strength ended before its count was due:
            # none is written; the entry's term starts again, after the answer.
            self._count_at.cancel()
            self._count_at = None
            self.kept, self._trusted = self._trusted, None
            self.ready = False
            kept = self.kept
            assert kept is not None
            self._extend_task = asyncio.get_running_loop().create_task(self._extend(kept))
            return
        await self._idle()

    async def _idle(self) -> None:
        if self.in_flight or not self.held or self.release is not None:
            return
        due = self.held_since + LINGER_S - time.monotonic()
        if due > 0:
            self.release = asyncio.get_running_loop().call_later(due, self._start_release)
        else:
            await asyncio.shield(self.let_go())  # a cancelled request still lets go

    async def let_go(self, *, closing: bool = False, linger: bool = True) -> None:
        """Take the count off now if no request is in flight (a lingering one too); when
        ``closing`` (the proxy stops), whatever is in flight: those requests were cut,
        and their own ends may come after this process has let its store go. A ready
        service's entry lingers (``TRUST_S``) unless ``closing`` or not ``linger``."""
        if self.release is not None:
            self.release.cancel()
            self.release = None
        async with self.lock:
            if (self.in_flight and not closing) or not self.held:
                return
            self.held = False
            was_ready, self.ready = self.ready, False  # reclaim may act from now on
            trust = self.trust_s if was_ready and linger and not closing else 0.0
            t0 = time.monotonic()
            if trust > 0:
                self.lingers = await self.use.aexit_lingering(trust + TRUST_MARGIN_S)
            else:
                await self.use.__aexit__(None, None, None)
                self.lingers = False
            rec = self.use.record
            running = rec is not None and rec.phase is Phase.RUNNING
            self.kept = rec.since if was_ready and running and not closing else None
            self.trusted_until = t0 + trust if self.lingers and self.kept is not None else 0.0

    async def unlinger(self) -> None:
        """End our lingering entry now: the proxy is about to start a service (a
        preemption it makes must not wait for its own entries), or to stop."""
        async with self.lock:
            if self.held or not self.lingers or self._trusted is not None:
                return
            self.lingers = False
            self.trusted_until = 0.0
            await self.use.aend_lingering()

    async def again(self) -> bool:
        """A service that was ready when let go: trust it ready again. Within its trust
        (its entry lingers in the store) at once: its count is written once it has run
        ``COUNT_AFTER_S``, or never if it ends sooner (the entry's term starts again
        then, after the answer). Else hold the count (which no stop can pass), and trust
        it if the record the store returns is still in the phase it was then, since the
        same moment: no stop, sleep or start came between. Costs the count's write, not
        a health check. False: check it (the count held or not)."""
        kept = self.kept
        self.kept = None
        if kept is None:
            return False
        if time.monotonic() < self.trusted_until:
            self.ready = True
            self._trusted = kept
            self._count_at = asyncio.get_running_loop().call_later(COUNT_AFTER_S, self._count)
            return True
        self.trusted_until = 0.0
        self.lingers = False  # lapsed, or replaced by the count written now
        await self.hold()
        return self._still(kept)

    def _still(self, kept: float) -> bool:
        """Whether the store's record says the service has run since ``kept`` (then it
        is trusted ready again)."""
        rec = self.use.record
        if self.held and rec is not None and rec.phase is Phase.RUNNING and rec.since == kept:
            self.ready = True
            return True
        # Checked (or started) as on a first request; the count stays: a service's own
        # count weighs nothing in its start (only a victim's does).
        self.ready = False
        return False

    def _count(self) -> None:
        self._count_at = None
        self._count_task = asyncio.get_running_loop().create_task(self._recount())

    async def _recount(self) -> None:
        """The count of requests sent on the lingering entry's strength that still run
        (it replaces the entry, even under a stop's lease). If the record moved
        meanwhile (a person's stop), the next request checks the service; these go on
        or fail as any request to a stopped server does."""
        kept = self._trusted
        try:
            await self._hold()
        finally:
            self._count_task = None
            self._trusted = None
        self.lingers = False
        self.trusted_until = 0.0
        if kept is not None:
            self._still(kept)
        await self._idle()  # they may have ended while it was written

    async def _extend(self, kept: float) -> None:
        """The entry's term starts again (the proxy's trust too) if the store takes it
        before the entry lapses, and the record still runs since ``kept``."""
        t0 = time.monotonic()
        # The entry lapses no sooner than this (it was written after the trust began).
        lapses = self.trusted_until + TRUST_MARGIN_S
        if t0 >= lapses - TRUST_MARGIN_S / 2:
            return  # it may lapse before the write lands: the trust ends as it stood
        async with self.lock:
            if self.held or not await self.use.aextend_lingering(self.trust_s + TRUST_MARGIN_S):
                return
        if time.monotonic() >= lapses:
            # Answered late (a slow store): it may have landed after the entry lapsed,
            # which the store does not bring back. The trust ends as it stood.
            return
        rec = self.use.record
        if rec is not None and rec.phase is Phase.RUNNING and rec.since == kept:
            self.trusted_until = max(self.trusted_until, t0 + self.trust_s)
        else:  # stopped, slept or restarted meanwhile: the next request checks
            self.trusted_until = 0.0
            self.kept = None

    def _start_release(self) -> None:
        self.release = None
        # Kept referenced until done (the event loop holds tasks only weakly).
        self._release_task = asyncio.get_running_loop().create_task(self.let_go())
