"""Heal the phases a host's records say (``gpuctl.core.heal``), whoever reads them.

``ensure`` (and ``resume``), ``reclaim``, ``locks``, ``status`` on a host without an
agent (its store is this machine's), and the agent's loop on the GPU host call ``heal``
with the records they read (a read-only client's attempt is refused by the agent and
skipped: the agent heals there). For each record
that could be lying about its server (``needs_look``), it reads the server's truth;
when the rule says the phase is wrong it takes the service's lease without waiting (a
lease held means a real start, stop or wake is under way: its holder owns the record,
and this is skipped), reads the truth again under the lease with the record the lease
came with, and writes the true phase with a note (``outcome = "repaired"`` in the
record's attempts, which ``gpuctl locks`` shows). So a repair never races a start or a
stop, and two healers never both write one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from msgspec.structs import replace

from gpuctl.adapters.store.base import Store
from gpuctl.config import Config
from gpuctl.core.heal import ABANDONED_AFTER_S, Repair, ServerTruth, diagnose, needs_look
from gpuctl.core.record import Holder, Phase, Record
from gpuctl.errors import GpuctlError
from gpuctl.flows import story

# The heal's lease: long enough for one pid look-up and one health request.
HEAL_LEASE_S = 30.0


def heal(
    store: Store,
    records: Iterable[Record],
    look: Callable[[Record], ServerTruth],
    entry: str,
    *,
    new_holder: Callable[[str], Holder],
    clock: Callable[[], float] = time.time,
    abandoned_after: Callable[[str], float] | None = None,
) -> list[Repair]:
    """Repair the records whose phase their server's truth contradicts; the repairs done.

    ``abandoned_after``: service -> its health timeout, where the caller's config names
    it (``core.heal.diagnose``); else ``ABANDONED_AFTER_S``.

    Never raises for one record: a store error skips it (the next reader tries again).
    """
    done: list[Repair] = []
    for record in records:
        if not needs_look(record):
            continue
        # The record's own promise says how long its start may take; else the config's.
        if record.promise is not None:
            after = record.promise.health_timeout_s
        else:
            after = abandoned_after(record.service) if abandoned_after else ABANDONED_AFTER_S

        def judge(r: Record, after: float = after) -> Repair | None:
            return diagnose(r, look(r), lease_live=False, now=clock(), abandoned_after_s=after)

        # A lease on a listed record is in force (the store drops dead ones as it reads):
        # its holder is mid-way (a preemptor between marking and signalling its victim).
        if record.lease is not None or judge(record) is None:
            continue
        holder = new_holder(entry)
        try:
            granted, fresh = store.acquire(record.service, holder, HEAL_LEASE_S)
        except GpuctlError:
            continue
        if not granted:
            continue  # a start, stop or wake holds it: the record is theirs
        released = False
        try:
            # Under our lease: the lease it replaced was not in force (else acquire
            # refused), and the record is judged again as it is now.
            repair = judge(replace(fresh, lease=None))
            if repair is not None:
                now = clock()
                # A start whose server now answers is a start that became ready (its
                # caller did not wait): told as ``ready``, with its cold start, as the
                # agent's check or a caller's touch would tell it.
                ready = repair.was is Phase.STARTING and repair.phase is Phase.RUNNING
                store.release(
                    record.service,
                    holder.id,
                    repair.update(now, entry),
                    event=story.ev(
                        "ready" if ready else "repair",
                        record.service,
                        entry,
                        before=repair.was,
                        after="failed" if repair.failed else repair.phase,
                        reason=repair.why,
                        cold_start_s=round(now - fresh.since, 3)
                        if ready and fresh.since > 0
                        else None,
                    ),
                )
                released = True
                done.append(repair)
        except GpuctlError:
            pass
        finally:
            if not released:
                with contextlib.suppress(GpuctlError):
                    store.release(record.service, holder.id)
    return done


def health_timeouts(config: Config) -> Callable[[str], float]:
    """service -> its health timeout in ``config`` (``ABANDONED_AFTER_S`` for another's)."""

    def of(service: str) -> float:
        svc = config.services.get(service)
        return svc.health_timeout_s if svc is not None else ABANDONED_AFTER_S

    return of


def repair_lines(host: str, repairs: Iterable[Repair]) -> list[str]:
    """One stderr line per repair: ``repaired chat on dgx: preempted -> running: …``."""
    return [f"repaired {r.service} on {host}: {r.line}" for r in repairs]
