"""The proxy's in-flight count on one service in the store (``gpuctl.api.in_use``).

The proxy holds one count on a service while any of its requests is in flight there.
The last one to end takes it off at once (before its last byte goes, so a client that
saw its answer end sees the count gone) unless the count was written less than
``LINGER_S`` ago; then it comes off ``LINGER_S`` after it was written, unless a request
came meanwhile. So the store's count moves on transitions and at most once per
``LINGER_S``, never per request, and a request that ends leaves nothing behind for long.

A service trusted as ready is checked again once its count is let go (reclaim or a stop
may act from then on). When the next request comes, the count's write returns the
record: if it is still running since the moment it was let go, nothing stopped, slept
or restarted it between, and the request goes on without a health check (``again``).
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


class ServiceUse:
    """The proxy's own view of one service: requests in flight, its count, readiness."""

    __slots__ = ("_release_task", "held", "held_since", "in_flight", "kept", "lock", "ready",
                 "release", "use")  # fmt: skip

    def __init__(self, use: in_use) -> None:
        self.in_flight = 0
        self.held = False  # this proxy's in_use count is open (the store has our entry)
        self.held_since = 0.0  # monotonic: when the store's count was written
        self.ready = False  # trusted only while held (see ready.py)
        # The phase ``since`` of the running record the store returned when a ready
        # service was let go: the next use may trust it again by the record (``again``).
        self.kept: float | None = None
        self.use = use
        self.lock = asyncio.Lock()  # one hold or release at a time
        self.release: asyncio.TimerHandle | None = None
        self._release_task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        """Count this proxy as using the service (in the store on its 0 -> 1)."""
        if self.release is not None:
            self.release.cancel()
            self.release = None
        if self.held:
            return
        async with self.lock:
            if not self.held:
                await self.use.__aenter__()
                self.held = True
                self.held_since = time.monotonic()

    async def end(self) -> None:
        """One request ended: with the last, the store's count comes off (now, or once
        it has stood ``LINGER_S``)."""
        self.in_flight -= 1
        if self.in_flight or not self.held or self.release is not None:
            return
        due = self.held_since + LINGER_S - time.monotonic()
        if due > 0:
            self.release = asyncio.get_running_loop().call_later(due, self._start_release)
        else:
            await asyncio.shield(self.let_go())  # a cancelled request still lets go

    async def let_go(self, *, closing: bool = False) -> None:
        """Take the count off now if no request is in flight (a lingering one too); when
        ``closing`` (the proxy stops), whatever is in flight: those requests were cut,
        and their own ends may come after this process has let its store go."""
        if self.release is not None:
            self.release.cancel()
            self.release = None
        async with self.lock:
            if (self.in_flight and not closing) or not self.held:
                return
            self.held = False
            was_ready, self.ready = self.ready, False  # reclaim may act from now on
            await self.use.__aexit__(None, None, None)
            rec = self.use.record
            running = rec is not None and rec.phase is Phase.RUNNING
            self.kept = rec.since if was_ready and running and not closing else None

    async def again(self) -> bool:
        """A service that was ready when let go: hold the count (which no stop can pass),
        and trust it ready again if the record the store returns is still in the phase it
        was then, since the same moment: no stop, sleep or start came between. Costs the
        count's write, not a health check. False: check it (the count held or not)."""
        kept = self.kept
        self.kept = None
        if kept is None:
            return False
        await self.hold()
        rec = self.use.record
        if self.held and rec is not None and rec.phase is Phase.RUNNING and rec.since == kept:
            self.ready = True
            return True
        # Checked (or started) as on a first request; the count stays: a service's own
        # count weighs nothing in its start (only a victim's does).
        return False

    def _start_release(self) -> None:
        self.release = None
        # Kept referenced until done (the event loop holds tasks only weakly).
        self._release_task = asyncio.get_running_loop().create_task(self.let_go())
