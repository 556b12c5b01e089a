"""The wait queue of a GPU host (``gpuctl run --wait``): who goes first, as pure rules.

A caller that does not fit and asks to wait joins the host's queue in the store
(``gpuctl.adapters.store.queue``). Each entry (a ``Waiter``) has the job's name, priority
and memory, its arrival number on that host (``seq``, given by the store under the
queue's lock, so it is a total order whatever the clocks say), when it joined, and its
holder: pid, start time, boot id and host, like a lease, with an expiry the waiter
renews as it waits. An entry whose holder is dead on the GPU host, or whose expiry
passed, is void: it is skipped and deleted, so a waiter killed with ``kill -9`` leaves
nothing behind.

**The order.** Higher priority first; among equal priorities, earlier arrival first.

**The rule: strict head of line, no backfill.** Only the head of the queue (the first
live waiter in that order) may be admitted, and only once it fits. Every other waiter
waits, even one small enough to fit in the memory that is free now: running it would
take memory the head is waiting for, and nothing says how long it would keep it, so a
big high-priority head could starve behind a stream of small jobs. A caller that does not
queue (``gpuctl run`` without ``--wait``) counts as arriving now: it is admitted only when
no live waiter of its priority or higher is queued (it would be the head). The price: a
head that waits for memory held by something that never ends holds up the rest until
their own timeouts; ``gpuctl locks`` shows it at position 1.

**What no entry may do** (an entry is a file in the store: hostile until read). An
entry lives at most ``QUEUE_TTL_MAX_S`` after its grant (its last renewal): one whose
term is longer, or that expires further ahead than that from now, was not written by
gpuctl (a waiter renews for 15 s at a time) and is lapsed at once (``overlived``). A
head that can never fit (larger than the GPU's largest device: a run job uses one GPU,
any of them) is skipped, not waited on: gpuctl never queues such a job, so it is a
forgery or a leftover from a larger GPU, and waiting on it would stop the queue for good.
**Services are not queued, but do not jump it.** ``ensure`` (and ``resume``, and the
proxy's ensure: one admission) does not wait in the queue; under the admission lock it
starts a service only if no live head of strictly higher priority is queued whose
memory it would take (the room left after it, on its GPU, less than the head needs):
then it is BUSY, naming the head (``held_back``). A service of equal or higher priority
than the head goes ahead, as a ``gpuctl run`` of that priority without ``--wait`` would.

Priorities are the services' range (``PRIORITY_MAX`` either way); the store refuses
an entry outside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from gpuctl.core.jobs import PRIORITY_MAX
from gpuctl.core.record import Lease, overlong
from gpuctl.core.units import format_mib

__all__ = [
    "PRIORITY_MAX",
    "QUEUE_TTL_MAX_S",
    "Waiter",
    "ahead",
    "can_fit",
    "held_back",
    "in_order",
    "overlived",
    "queued_reason",
    "waiter_reason",
]

# A waiter renews its entry as it waits (15 s at a time, about twice a second): an entry
# that outlives its holder from another host (kill -9 there) blocks the queue this long
# at most, and no entry lives longer than this after its grant, whatever its file says.
QUEUE_TTL_MAX_S = 300.0


class Waiter(msgspec.Struct, frozen=True):
    """One caller waiting in a host's queue. ``holder.expires`` is its heartbeat's term."""

    name: str  # the job's record name (``run.<name>``)
    priority: int
    memory_mib: int
    seq: int  # arrival order on this host's queue (the store gives it)
    since: float  # when it joined (epoch seconds)
    holder: Lease

    @property
    def id(self) -> str:
        return self.holder.id

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "priority": self.priority,
            "memory_mib": self.memory_mib,
            "seq": self.seq,
            "since": self.since,
            "holder": self.holder.to_dict(),
        }


def overlived(w: Waiter, now: float) -> bool:
    """An entry whose term is longer than any waiter may ask (``QUEUE_TTL_MAX_S`` after its
    grant), or that expires further ahead than that from ``now`` (a grant in the future):
    it counts as lapsed, whoever its holder is."""
    return overlong(w.holder, now, QUEUE_TTL_MAX_S)


def can_fit(w: Waiter, largest_mib: int | None) -> bool:
    """Whether the waiter could ever fit on one GPU of ``largest_mib`` (None: unknown, so
    it may)."""
    return largest_mib is None or w.memory_mib <= largest_mib


def order_key(w: Waiter) -> tuple[int, int, float, str]:
    """Higher priority first, then arrival (``seq``; ``since`` and the id only break ties
    a sound store never makes)."""
    return (-w.priority, w.seq, w.since, w.id)


def in_order(waiters: Iterable[Waiter]) -> list[Waiter]:
    """The live waiters as they will be served."""
    return sorted(waiters, key=order_key)


def ahead(
    waiters: Iterable[Waiter],
    *,
    priority: int,
    me: str | None = None,
    largest_mib: int | None = None,
) -> list[Waiter]:
    """The live waiters that go before a caller, in order; it may be admitted only when
    there are none.

    ``largest_mib``: the GPU's largest device; a waiter larger than it can never fit and
    is skipped (None: unknown, none is skipped).

    ``me``: the caller's own holder id when it is queued: the waiters ordered before its
    entry. A caller with no entry among ``waiters`` (one that does not queue, or whose
    entry has lapsed) arrives now: every waiter of its priority or higher is ahead.
    """
    ordered = in_order(w for w in waiters if can_fit(w, largest_mib))
    for i, w in enumerate(ordered):
        if me is not None and w.id == me:
            return ordered[:i]
    return [w for w in ordered if w.priority >= priority]


def queued_reason(before: list[Waiter]) -> str:
    """Why a caller waits: the head of the queue, and how many more are ahead."""
    head = before[0]
    more = f" and {len(before) - 1} more" if len(before) > 1 else ""
    return (
        f"queued behind {head.name} (priority {head.priority}, "
        f"{format_mib(head.memory_mib)}){more}: the queue is served by priority, then arrival"
    )


def held_back(
    waiters: Iterable[Waiter],
    *,
    priority: int,
    need_mib: int | None,
    free_mib: int | None,
    largest_mib: int | None,
) -> Waiter | None:
    """The queue's head that a service of ``priority`` must not pass, or None.

    A service taking ``need_mib`` out of ``free_mib`` (on the GPU it would use) passes a
    head of strictly higher priority only when what is left still holds the head. Unknown
    figures (None) count as taking its room: gpuctl does not guess in a service's favour.
    """
    queue = in_order(w for w in waiters if can_fit(w, largest_mib))
    if not queue or queue[0].priority <= priority:
        return None
    head = queue[0]
    if need_mib is not None and free_mib is not None and free_mib - need_mib >= head.memory_mib:
        return None
    return head


def waiter_reason(w: Waiter, since: str) -> str:
    """Why a service is held back by ``w`` (``since``: when it joined, in words)."""
    return (
        f"queued: {w.name}, priority {w.priority}, {format_mib(w.memory_mib)} — waiting since "
        f"{since}; it would take the room this job waits for (`gpuctl locks` shows the queue)"
    )
