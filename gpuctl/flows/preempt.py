"""Preemption: make room for a service by stopping lower-priority work.

``ensure X --preempt`` (or X's ``preempt = true``) on a PREEMPTABLE verdict:

1. take X's own lease first: nobody else starts X while its room is being made; and
   mark X ``starting`` under it, so every other admission counts X at its budget and
   the room made for X is not taken before X's launch (its phase is put back if X is
   not launched);
2. take each victim's lease (without waiting: a lease held means a start, stop or wake
   of it is under way, and the plan is void), and judge again under them that each
   still runs its recorded server with nothing in flight (a use that began before the
   lease is in the counts; none can begin after it);
3. mark each ``preempted`` (before its stop: a preemptor killed mid-way leaves no
   ``running`` record with its server gone), stop it with its launcher (SIGTERM, grace,
   SIGKILL for a process; the container's stop; the terminal's process) and release its
   lease, so a ``resume = true`` service is brought back later;
4. wait until the agent shows the memory back: fresh reads about every 0.2 s, bounded by
   the caller's deadline;
5. start X as ``ensure`` does (``launch_under_lease``: the admission lock, the fresh
   re-check, the spawn), under the lease it took in step 1.

A victim is stopped only by the handle its record names, never by keywords: nothing
gpuctl did not start is ever stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuctl import failpoints
from gpuctl.adapters.jobs import JOB_GRACE_S, stop_job
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store import Holder, holder_here
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.jobs import is_job
from gpuctl.core.model import Snapshot
from gpuctl.core.record import LEASE_MARGIN_S, Phase, Record
from gpuctl.errors import GpuctlError
from gpuctl.flows.observe import look
from gpuctl.flows.results import EnsureResult, Outcome

if TYPE_CHECKING:
    from gpuctl.flows.ensure import Ctx

# How often the memory is looked for after the stops (the "about 0.2 s").
POLL_S = 0.2
STOP_LEASE_MARGIN_S = 60.0


@dataclass
class _Taken:
    name: str
    holder: Holder
    record: Record


# ensure's launch_under_lease, handed in by ensure (importing it here would make the two
# modules import each other).
Launch = Callable[["Ctx", Holder, float, Decision, bool], EnsureResult | None]


def preempt(
    ctx: Ctx, verdict: Verdict, snapshot: Snapshot | None, wait: bool, launch: Launch
) -> EnsureResult | None:
    """Carry out ``verdict.plan`` and start the service with ``launch`` (ensure's
    ``launch_under_lease``); None: look again (the plan went stale: a victim's lease was
    taken, or the service's own)."""
    deps, svc = ctx.deps, ctx.deps.service
    plan = verdict.plan
    assert plan is not None
    holder = holder_here(deps.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    granted, own = deps.store.acquire(svc.name, holder, ttl)
    if not granted:
        return None  # someone else is starting it: look again (a bystander waits)
    own_released = False
    restore: dict[str, Any] | None = None
    try:
        if own.phase is not Phase.STARTING:
            # Its memory is promised before the victims give theirs back: `starting`
            # under this lease counts it at its budget for every other admission (a
            # resume of a victim, a `gpuctl run` job), so the room made for it is still
            # there at its launch (a resume once took it, and it ended BUSY).
            # No start nonce: nothing is spawned yet, so if this caller is killed the
            # record is no orphaned start (whose memory would stay promised).
            promise = {"phase": Phase.STARTING.value, "start_nonce": None}
            deps.store.update(svc.name, holder.id, promise)
            restore = {"phase": own.phase.value, "start_nonce": own.start_nonce}
        t_stop = deps.clock()
        stopped, failure = _stop_victims(ctx, [v.name for v in plan.victims], snapshot)
        stop_s = deps.clock() - t_stop
        if failure is not None:
            return failure
        if stopped is None:
            return None
        failpoints.hit("preempt.after_stops")
        names = ", ".join(stopped)
        ctx.notes.append(f"preempted {names} to make room (their stops took {stop_s:.2f}s)")
        back = _wait_for_memory(ctx, holder.id)
        if back is not None:
            return back
        own_released = True  # launch_under_lease releases it from here on
        return launch(ctx, holder, ttl, Decision.PREEMPTABLE, wait)
    finally:
        if not own_released:
            with contextlib.suppress(GpuctlError):
                deps.store.release(svc.name, holder.id, restore)


def _stop_victims(
    ctx: Ctx, names: list[str], snapshot: Snapshot | None
) -> tuple[list[str] | None, EnsureResult | None]:
    """Take every victim's lease, judge again, stop them. Returns (stopped, None) when all
    are stopped; (None, None) when the plan went stale (nothing stopped); (_, result) when
    a stop failed."""
    deps = ctx.deps
    taken: list[_Taken] = []
    done: list[str] = []
    try:
        for name in names:
            grace = JOB_GRACE_S if is_job(name) else deps.config.service(name).stop_timeout_s
            h = holder_here("preempt")
            ok, rec = deps.store.acquire(name, h, grace + STOP_LEASE_MARGIN_S)
            if not ok:
                return None, None
            taken.append(_Taken(name, h, rec))
        # Under the leases: a victim must still run its recorded server, and nothing may
        # be in flight (an in_use that began before the lease is counted; none begins
        # after it).
        counts = deps.store.inflight()
        for t in taken:
            if t.record.phase is not Phase.RUNNING or not t.record.handle:
                return None, None
            if counts.get(t.name, 0) > 0 and not deps.force:
                return None, None
        for t in list(taken):
            assert deps.launcher_for is not None and t.record.handle is not None
            update: dict[str, Any] = {"phase": Phase.PREEMPTED.value, "handle": None}
            # Marked before the stop: a preemptor killed mid-way leaves its victim
            # `preempted` (brought back once it fits), never `running` with its server
            # gone. Put back to `running` if the stop fails.
            deps.store.update(t.name, t.holder.id, {"phase": Phase.PREEMPTED.value})
            try:
                if is_job(t.name):
                    # A `gpuctl run --preemptible` job: SIGTERM, grace, SIGKILL. Its
                    # handle stays, so its `gpuctl run` can say it was preempted.
                    stop_job(t.record.handle)
                    update = {"phase": Phase.PREEMPTED.value}
                else:
                    vs = deps.config.service(t.name)
                    # The snapshot says which machine the agent runs on: a process
                    # launcher signals a server only on its own machine.
                    launcher = deps.launcher_for(vs, snapshot)
                    launcher.stop(Handle.from_dict(t.record.handle), vs.stop_timeout_s)
            except GpuctlError as e:
                with contextlib.suppress(GpuctlError):
                    deps.store.release(t.name, t.holder.id, {"phase": Phase.RUNNING.value})
                taken.remove(t)
                return done, ctx.result(
                    Outcome.FAILED,
                    f"could not stop {t.name} to make room: {e.message}",
                    Decision.PREEMPTABLE,
                    **({"hint": e.hint} if e.hint else {}),
                )
            failpoints.hit("preempt.after_victim_stop")
            deps.store.release(t.name, t.holder.id, update)
            taken.remove(t)
            done.append(t.name)
        return done, None
    finally:
        for t in taken:
            with contextlib.suppress(GpuctlError):
                deps.store.release(t.name, t.holder.id)


def _wait_for_memory(ctx: Ctx, own_holder: str) -> EnsureResult | None:
    """Poll fresh readings until the service fits (None), or the deadline (a result)."""
    deps = ctx.deps
    last = "the victims' memory has not come back"
    while True:
        health = deps.check_health()
        v, _seen = look(deps, health, own_holder=own_holder, fresh=True)
        if v.decision in (Decision.IDLE, Decision.FITS):
            return None
        if v.decision in (Decision.UNKNOWN, Decision.READY):
            return ctx.from_verdict(v) if v.decision is Decision.UNKNOWN else None
        last = v.reason
        if deps.clock() + POLL_S > ctx.deadline:
            return ctx.result(
                Outcome.TIMEOUT,
                f"stopped the victims, but the memory did not come back in time: {last}",
                Decision.PREEMPTABLE,
            )
        deps.sleep(POLL_S)
