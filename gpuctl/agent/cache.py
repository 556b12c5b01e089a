"""The agent's reading cache: many pollers, one scan.

A ``TtlCell`` computes its value in a worker thread (probes block: NVML, an
``nvidia-smi`` subprocess), reuses it for a TTL, and lets callers that arrive during a
computation await that one instead of starting another.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")


class Outcome(msgspec.Struct, Generic[T], frozen=True, eq=False):
    """One computation's result or error, and until when it may be reused.

    Compared by identity: a new outcome means a new scan, so whatever was derived from
    the old one (an encoded body) is stale.
    """

    value: T | None
    error: Exception | None
    expires: float
    started: float = 0.0


class TtlCell(Generic[T]):
    """A value computed in a worker thread, reused for ``ttl_s``, one computation at a time.

    Callers that arrive while a computation runs await that one instead of starting
    another. Errors are cached like values, so a failing probe is not hammered either.
    """

    def __init__(
        self,
        compute: Callable[[], T],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self._ttl_s = ttl_s
        self._clock = clock
        self._outcome: Outcome[T] | None = None
        self._inflight: asyncio.Future[Outcome[T]] | None = None
        # Outcomes of computations started before this moment are stale (see invalidate).
        self._valid_from = -math.inf

    @property
    def latest(self) -> Outcome[T] | None:
        return self._outcome

    def invalidate(self) -> None:
        """Forget what was computed so far: the next ``get`` computes anew.

        A computation under way when this is called does not count either: it may have
        read the state from before the change that made us call.
        """
        self._valid_from = self._clock()

    async def get(self, fresh: bool = False) -> Outcome[T]:
        """The cached outcome, or a new one; ``fresh``: one computed after this call began."""
        need = self._clock() if fresh else self._valid_from
        while True:
            outcome = self._outcome
            if outcome is not None and outcome.started >= need and self._clock() < outcome.expires:
                return outcome
            inflight = self._inflight
            if inflight is None:
                inflight = self._inflight = asyncio.ensure_future(self._refresh())
            # shield: a client that hangs up must not cancel the scan the others wait for.
            outcome = await asyncio.shield(inflight)
            if outcome.started >= need:
                return outcome
            # It began before what we need (an invalidation, a fresh read): one more round,
            # still one computation at a time.

    async def _refresh(self) -> Outcome[T]:
        started = self._clock()
        try:
            try:
                value = await asyncio.to_thread(self._compute)
            except Exception as err:  # kept and re-delivered to every waiter
                outcome: Outcome[T] = Outcome(None, err, self._clock() + self._ttl_s, started)
            else:
                outcome = Outcome(value, None, self._clock() + self._ttl_s, started)
            self._outcome = outcome
            return outcome
        finally:
            self._inflight = None


# How long a folder's fresh stamp counts as "changed" (a coarse mtime tick is 1-10 ms).
SETTLE_NS = 50_000_000


class FolderStamp:
    """Notices writes made to a folder behind the agent's back.

    The agent's own store writes invalidate its caches; a ``DirectStore`` on the same
    host (cron, a user without the agent) writes the files directly. Every record write
    is a rename into ``records/``, so the folder's (inode, mtime) changes with it: one
    ``stat`` per read tells. The kernel stamps mtime from a coarse clock (a tick of
    1-10 ms), so a second write in the tick of the first leaves it as it was: while the
    stamp is younger than ``settle_ns`` it counts as changed on every look.
    """

    def __init__(self, path: Path, settle_ns: int = SETTLE_NS) -> None:
        self._path = path
        self._settle_ns = settle_ns
        self._last: tuple[int, int] | None = None

    def changed(self) -> bool:
        try:
            st = os.stat(self._path)
        except OSError:  # not made yet, or gone: nothing to compare until it is there
            stamp = None
        else:
            stamp = (st.st_ino, st.st_mtime_ns)
        if stamp != self._last:
            self._last = stamp
            return True
        return stamp is not None and time.time_ns() - stamp[1] < self._settle_ns
