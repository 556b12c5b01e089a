"""The store's interface, shared by its two implementations, and the names it accepts."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Protocol

from gpuctl.adapters import procinfo
from gpuctl.core.names import NAME_RE
from gpuctl.core.promise import Promise
from gpuctl.core.queue import Waiter
from gpuctl.core.record import (
    Holder,
    Lease,
    LeaseState,
    Listing,
    Record,
    SetAside,
    Voided,
    lease_state,
    void_why,
)
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import UsageError

if TYPE_CHECKING:
    # Only its name: every command imports the store, few tell the journal anything.
    from gpuctl.core.events import Event

# The one rule for names, shared with the config and the agent's OpenAPI document.
_NAME = NAME_RE
LOCK_TIMEOUT_S = 10.0


class Store(Protocol):
    """The store's operations; every one raises ``StoreError`` when it cannot be done."""

    def get(self, service: str) -> Record:
        """The record as it stands: a lease that expired or whose holder died is shown as none."""
        ...

    def records(self) -> list[Record]:
        """Every service's record. A record file that fails validation is set aside and
        its service listed afresh, with ``recovered`` saying why and where the copy is."""
        ...

    def listing(self) -> Listing:
        """``records()`` and then ``set_aside()``, in one read where the store can (the
        agent's ``GET /records`` carries both)."""
        ...

    def set_aside(self) -> list[SetAside]:
        """The record files that failed validation and were kept (``gpuctl locks`` lists
        them until someone removes them)."""
        ...

    def voided(self) -> list[Voided]:
        """The leases and entries found forged (``core.record.void_why``) and kept for a
        person (``gpuctl locks`` shows them; ``adapters.store.voided``)."""
        ...

    def acquire(
        self,
        service: str,
        holder: Holder,
        ttl_s: float,
        promise: Promise | None = None,
        event: Event | None = None,
    ) -> tuple[bool, Record]:
        """Take the lease unless someone else holds a live one. Returns (granted, record).

        ``promise``: what the start this lease is for promises (its budget, devices,
        priority, kind, resumability), written with the lease in one write, so no client
        ever sees the lease without the figures it must count it at. ``event``: the
        journal's event for this write (``adapters.store.journal``), kept only if granted; it
        rides on the write (the same request to an agent)."""
        ...

    def renew(self, service: str, holder_id: str, ttl_s: float) -> Record: ...

    def release(
        self,
        service: str,
        holder_id: str,
        update: RecordUpdate | None = None,
        event: Event | None = None,
    ) -> Record:
        """Apply ``update`` and drop the lease, if ``holder_id`` still holds it (and then
        journal ``event``)."""
        ...

    def update(
        self, service: str, holder_id: str, update: RecordUpdate, event: Event | None = None
    ) -> Record:
        """Apply ``update`` as the lease holder (StoreError otherwise), and journal
        ``event`` with it."""
        ...

    def note(self, *events: Event) -> None:
        """Journal events that ride on no record write (a refusal, a queue join). Never
        raises: the journal is a witness, not a gate."""
        ...

    def touch(self, service: str, ready: bool = False, promise: Promise | None = None) -> Record:
        """last_used = now: every entry point marks a use the same way.

        ``ready``: the caller saw it answer its health check, so a record still saying
        ``starting`` (its launcher was interrupted) becomes ``running``. ``promise``: the
        caller's figures for the service, written only where the record has none (an
        older release wrote it): a host heals as it is used, and a start's own promise
        is never overwritten by another config's idea of it.
        """
        ...

    def inflight_begin(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        """Count ``holder`` as using ``service`` and mark it used; refused (False) while a
        stop holds the lease (see ``gpuctl.adapters.store.inflight``)."""
        ...

    def inflight_renew(self, service: str, holder: Holder, ttl_s: float) -> Record:
        """Keep ``holder``'s in-flight entry alive, and mark the service used."""
        ...

    def inflight_end(self, service: str, holder_id: str, linger_s: float = 0.0) -> Record:
        """``holder_id`` has nothing in flight on ``service`` any more; ``linger_s``: its
        entry stays that long as a lingering one (``core.record.LINGER_ENTRY``), unless a
        stop holds the lease (the record returned says so): then a counted entry ends
        and a lingering one stands as it is."""
        ...

    def inflight(self) -> dict[str, int]:
        """Live in-flight holders per service (only services that have some); lingering
        entries are none."""
        ...

    def lingering(self) -> dict[str, float]:
        """Per service with live lingering entries, the seconds until the last lapses."""
        ...

    def queue_join(
        self, holder: Holder, ttl_s: float, *, name: str, priority: int, memory_mib: int
    ) -> tuple[Waiter, list[Waiter]]:
        """Join the host's wait queue, or renew the caller's entry (it keeps its place).
        Returns (its entry, the live queue in order); see ``gpuctl.adapters.store.queue``."""
        ...

    def queue_leave(self, holder_id: str) -> bool:
        """Leave the queue; whether the entry was there."""
        ...

    def waiters(self) -> list[Waiter]:
        """The live waiters, in the order they will be served (``gpuctl.core.queue``)."""
        ...

    def close(self) -> None:
        """Free what the store holds (the agent store's connections). Idempotent."""
        ...


def check_name(service: str) -> str:
    # fullmatch: ``$`` alone also matches before a trailing newline ("vllm\n").
    if not isinstance(service, str) or not _NAME.fullmatch(service):
        raise UsageError(f"invalid service name {service!r}")
    return service


def judged_here(lease: Lease, now: float, longest: float | None) -> tuple[LeaseState, str | None]:
    """A lease (or in-flight or queue entry) as this host judges it: its state, its
    holder alive only if it runs here (``core.record.lease_state``), and why it is
    void if it is forged (``core.record.void_why``; None otherwise). ``longest``: its
    kind's documented term."""
    here = procinfo.host_identity()
    alive = None
    if lease.host == here.hostname and lease.boot_id == here.boot_id:
        alive = procinfo.is_same_process(lease.pid, lease.pid_start)
    where = {"here_host": here.hostname, "here_boot_id": here.boot_id}
    state = lease_state(lease, now, holder_alive=alive, longest=longest, **where)
    return state, void_why(lease, now, longest=longest, **where)


def holder_here(entry: str) -> Holder:
    """A fresh holder for this process on this host (a new id per call)."""
    ident = procinfo.host_identity()
    pid = os.getpid()
    return Holder(
        uuid.uuid4().hex, ident.hostname, ident.boot_id, pid, procinfo.start_time(pid), entry
    )
