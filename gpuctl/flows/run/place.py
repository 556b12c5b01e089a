"""``gpuctl run --wait``: the caller's place in the host's wait queue, and its naps.

The queue itself is in the store (``gpuctl.adapters.store.queue``), its order in
``gpuctl.core.queue``; ``gpuctl.flows.run.job`` joins it when a job does not fit, renews its
entry on every look (``Place.refresh``), and leaves it once admitted and in a
``finally`` (a timeout, Ctrl-C, SIGTERM, an error). A waiter larger than the GPU's
largest device (a forgery, or a leftover) is skipped, never waited on.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuctl import failpoints
from gpuctl.adapters.store.base import Store
from gpuctl.core.jobs import JobSpec
from gpuctl.core.queue import Waiter, ahead
from gpuctl.core.record import Holder
from gpuctl.errors import GpuctlError
from gpuctl.flows import story
from gpuctl.flows.ports import Machine

# A waiter renews its entry on every look (about twice a second); one that stops renewing
# (stopped with Ctrl-Z, or killed on another machine than the GPU host, where nobody can
# see its pid die) lapses after this, and stops holding up the queue. A test shortens it
# with the failpoint ``run_queue.ttl=seconds:<s>`` (gpuctl.failpoints.seconds).
QUEUE_TTL_S = 15.0
# While it waits for the admission lock (another start holds it, up to a minute), the
# head renews its entry this often, so it does not lapse and lose its place.
BEAT_S = 2.0


def ahead_now(
    store: Store, spec: JobSpec, place: Place | None, largest_mib: int | None
) -> list[Waiter]:
    """Under the admission lock: the live waiters ahead of the caller (queued with
    ``place``, or arriving now), skipping those that can never fit."""
    me = place.id if place is not None else None
    return ahead(store.waiters(), priority=spec.priority, me=me, largest_mib=largest_mib)


class Place:
    """This caller's entry in the host's wait queue, and the signals that end its wait.

    From its creation until ``leave``, SIGTERM and SIGHUP are noted (``signum``), never
    fatal on the spot: by default they would end the process wherever it stands, leaving
    its entry to be found dead. ``nap`` ends at once on one, and the caller's ``finally``
    leaves the queue. Ctrl-C stays a KeyboardInterrupt, as everywhere.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)
    SLICE_S = 0.05

    def __init__(self, store: Store, spec: JobSpec, holder: Holder) -> None:
        self.store = store
        self.spec = spec
        self.holder = holder
        self.id = self.holder.id
        self.joined = False
        self._renewed = 0.0
        self.largest_mib: int | None = None
        self.signum = 0
        self._previous: dict[int, Any] = {}
        # Signal handlers belong to the main thread; elsewhere the defaults stay.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}

    def _note(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def nap(self, sleep: Callable[[float], None], seconds: float) -> int:
        """Sleep between looks, in short slices, so a SIGTERM or SIGHUP ends it at once;
        the signal's number (0: none)."""
        deadline = time.monotonic() + seconds
        while not self.signum and (left := deadline - time.monotonic()) > 0:
            sleep(min(self.SLICE_S, left))
        return self.signum

    def refresh(self, largest_mib: int | None = None) -> list[Waiter]:
        """Join, or renew the entry (its heartbeat); the live waiters ahead of it (those
        larger than ``largest_mib``, the GPU's largest device, never fit: skipped)."""
        s = self.spec
        assert s.memory_mib is not None
        if not self.joined:
            story.tell(
                self.store,
                story.ev(
                    "queue",
                    s.name,
                    "run",
                    job=True,
                    after="queued",
                    reason="joined the wait queue",
                    priority=s.priority,
                    budget_mib=s.memory_mib,
                ),
            )
        self.joined = True  # before the call: a join that lands and then fails is left too
        ttl_s = failpoints.seconds("run_queue.ttl", QUEUE_TTL_S)
        _, queue = self.store.queue_join(
            self.holder, ttl_s, name=s.name, priority=s.priority, memory_mib=s.memory_mib
        )
        self._renewed = time.monotonic()
        self.largest_mib = largest_mib
        return ahead(queue, priority=s.priority, me=self.id, largest_mib=largest_mib)

    def beat(self) -> None:
        """Renew the entry if it is due (while waiting for the admission lock)."""
        if self.joined and time.monotonic() - self._renewed >= BEAT_S:
            with contextlib.suppress(GpuctlError):
                self.refresh(self.largest_mib)

    def leave(self) -> None:
        """Out of the queue, and the signals' handlers back as they were (idempotent; a
        failure to leave is left to the entry's expiry)."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        if self.joined:
            self.joined = False
            with contextlib.suppress(GpuctlError):
                self.store.queue_leave(self.id)
            story.tell(
                self.store,
                story.ev(
                    "queue",
                    self.spec.name,
                    "run",
                    job=True,
                    before="queued",
                    reason="left the wait queue",
                ),
            )

    def admission_deps(
        self,
        store: Store,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        machine: Machine,
    ) -> QueuedAdmission:
        """What ``flows.admission`` needs, with naps that renew the entry."""
        return QueuedAdmission(store, clock, sleep, machine, self)


class QueuedAdmission:
    """The admission lock's deps (store, clock, sleep, machine) for a queued caller."""

    def __init__(
        self,
        store: Store,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        machine: Machine,
        place: Place,
    ) -> None:
        self.store, self.clock, self._sleep, self._place = store, clock, sleep, place
        self.machine = machine

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds)
        self._place.beat()
