"""The host-wide admission lock of ``ensure``: re-check and spawn, one start at a time
per host, so two services never each re-check before the other spawned and start into
the same memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from gpuctl.adapters.store.base import Store
from gpuctl.core.record import ADMISSION_TTL_MAX_S
from gpuctl.errors import GpuctlError
from gpuctl.flows.ports import Machine

ADMISSION = "_admission"
# A few seconds, not renewed: the lock covers a re-check and the recorded spawn, and a
# start marks itself ``starting`` (its promise counted by every rival's re-check) before
# it spawns, so a spawn that outlasts the term stays counted after the lock lapses. A
# short term means a forged or stuck holder delays other starts for seconds, not minutes.
ADMISSION_TTL_S = ADMISSION_TTL_MAX_S


class AdmissionTimeout(Exception):
    """The caller's own deadline came while another start held the admission lock."""

    def __init__(self, who: str) -> None:
        super().__init__(who)
        self.who = who


class _Deps(Protocol):
    @property
    def store(self) -> Store: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def sleep(self) -> Callable[[float], None]: ...
    @property
    def machine(self) -> Machine: ...


class AdmissionCtx(Protocol):
    """What the lock needs of its caller (``ensure``, ``gpuctl run``): the store, the
    clock and the caller's deadline."""

    @property
    def deps(self) -> _Deps: ...
    @property
    def deadline(self) -> float: ...


@contextmanager
def admission(ctx: AdmissionCtx) -> Iterator[None]:
    """The host-wide admission lock: a lease on the pseudo-service ``_admission``, held
    only from the re-check to the recorded spawn (milliseconds to seconds). A holder that
    dies loses it at once on its own host, else at expiry.

    Waits no longer than the caller's own deadline (``--timeout`` bounds every wait):
    raises ``AdmissionTimeout`` then, naming the holder. No holder keeps it past its
    short term unless it renews it from a live process on this host (a longer lease in
    the file is void: ``core.record``), so a queue of starts taking their turns is never
    mistaken for a stuck one.
    """
    deps = ctx.deps
    holder = deps.machine.holder("admission")
    while True:
        granted, rec = deps.store.acquire(ADMISSION, holder, ADMISSION_TTL_S)
        if granted:
            break
        who = f"{rec.lease.entry} pid {rec.lease.pid} on {rec.lease.host}" if rec.lease else "?"
        now = deps.clock()
        if now >= ctx.deadline:
            raise AdmissionTimeout(who)
        deps.sleep(min(0.05, max(0.0, ctx.deadline - now)))
    try:
        yield
    finally:
        with contextlib.suppress(GpuctlError):
            deps.store.release(ADMISSION, holder.id)
