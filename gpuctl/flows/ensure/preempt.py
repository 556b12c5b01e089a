"""Preemption: make room by stopping lower-priority work, for ``ensure`` and ``gpuctl run``.

``make_room`` is the one machinery both call on a PREEMPTABLE verdict:

1. take each victim's lease (without waiting: a lease held means a start, stop or wake
   of it is under way, and the plan is void), and judge again under them that each
   still runs its recorded server with nothing in flight (a use that began before the
   lease is in the counts; none can begin after it), and that a victim taken only
   because it sat idle (``core.plan.yields``) has still not been used within its
   ``yield_after``;
2. mark each ``preempted`` (before its stop: a preemptor killed mid-way leaves no
   ``running`` record with its server gone; put back to ``running`` if the stop fails),
   stop it by its record's handle (a service with its launcher: SIGTERM, grace, SIGKILL
   for a process; the container's stop; the terminal's process. A ``gpuctl run
   --preemptible`` job: SIGTERM to its process group, grace, SIGKILL, sent from this
   machine or, when CMD runs on the agent's, by the agent) and release its lease, so a
   ``resume = true`` service is brought back later;
3. wait until the host shows the memory back: fresh reads about every 0.2 s, bounded by
   the caller's deadline.

Then the caller starts its work as it always does, under the admission lock with a fresh
re-check: ``ensure X --preempt`` (``preempt``) with ``launch_under_lease``, under X's
own lease, taken first so that nobody else starts X while its room is made, and with X
marked ``starting`` under it, so every other admission counts X at its budget and the
room made for X is not taken before X's launch (its phase is put back if X is not
launched); ``gpuctl run --preempt`` by looking again (``gpuctl.flows.run``).

A victim is stopped only by the handle its record names, never by keywords: nothing
gpuctl did not start is ever stopped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from gpuctl import failpoints
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store.base import Store
from gpuctl.config import Config
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.jobs import JOB_GRACE_S, is_job
from gpuctl.core.plan import Plan, Victim
from gpuctl.core.record import LEASE_MARGIN_S, Holder, Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import GpuctlError, LauncherError
from gpuctl.flows import story
from gpuctl.flows.ensure.context import Ctx
from gpuctl.flows.ensure.launch import launch_under_lease
from gpuctl.flows.look import idle_seconds, look
from gpuctl.flows.op_results import EnsureResult, Outcome
from gpuctl.flows.ports import JobStopper, VictimLauncher

# How often the memory is looked for after the stops (the "about 0.2 s").
POLL_S = 0.2
STOP_LEASE_MARGIN_S = 60.0
# How often a preemption waiting on a victim's lingering entry looks again: the entry
# goes at once when its holder counts a request again (the plan is stale then).
LINGER_POLL_S = 0.25


class RoomDeps(msgspec.Struct):
    """What making room needs, whoever asks for it."""

    config: Config
    store: Store
    deadline: float
    # A fresh look at the one asking: IDLE or FITS once the room is there.
    look_again: Callable[[], Verdict]
    # (entry) -> a fresh lease holder for this process (``Machine.holder``)
    holder: Callable[[str], Holder]
    # How a run job victim is stopped (None: none can be)
    stop_job: JobStopper | None = None
    # (a victim service, snapshot) -> its launcher, to stop it with
    launcher_for: VictimLauncher | None = None
    force: bool = False
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # Who makes the room and why, in the victims' stop events (``flows.story``).
    by: str = ""
    why: str = ""


class Room(msgspec.Struct):
    """How ``make_room`` ended.

    ``made``: the victims are stopped and the work fits now (or answers: ``ready``);
    ``stale``: the plan went stale before anything was stopped (a victim's lease was
    taken, or it changed): look again; ``failed``: a stop failed; ``timeout``: the memory
    did not come back in time, or a victim's lingering entry still stood at the deadline
    (then nothing was stopped); ``unknown``: the host could not be read (``verdict``).
    """

    outcome: Literal["made", "ready", "stale", "failed", "timeout", "unknown"]
    stopped: list[str] = msgspec.field(default_factory=list)
    stop_s: float = 0.0
    reason: str = ""
    hint: str = ""
    verdict: Verdict | None = None

    def note(self) -> str:
        """``preempted a, b to make room (their stops took 1.23s)``, for a result."""
        return f"preempted {', '.join(self.stopped)} to make room (their stops took {self.stop_s:.2f}s)"


class _Taken(msgspec.Struct):
    name: str
    holder: Holder
    record: Record


def make_room(deps: RoomDeps, plan: Plan, snapshot: Snapshot | None) -> Room:
    """Stop ``plan``'s victims and wait until the memory is back (see the module)."""
    # Between the plan and the victims' leases: a use of an idle victim here must void it.
    failpoints.hit("preempt.before_leases")
    t_stop = deps.clock()
    room = _stop_victims(deps, list(plan.victims), snapshot)
    room.stop_s = deps.clock() - t_stop
    if room.outcome != "made":
        return room
    failpoints.hit("preempt.after_stops")
    return _wait_for_memory(deps, room)


def _stop_victims(deps: RoomDeps, victims: list[Victim], snapshot: Snapshot | None) -> Room:
    """Take every victim's lease, judge again, stop them."""
    taken: list[_Taken] = []
    room = Room("made")
    yielded = {v.name: v.yield_after_s for v in victims if v.yielded}
    try:
        for name in (v.name for v in victims):
            grace = JOB_GRACE_S if is_job(name) else deps.config.service(name).stop_timeout_s
            h = deps.holder("preempt")
            ok, rec = deps.store.acquire(name, h, grace + STOP_LEASE_MARGIN_S)
            if not ok:
                return Room("stale")
            taken.append(_Taken(name, h, rec))
        # A victim with a lingering entry (``core.record.LINGER_ENTRY``: a proxy that
        # may send its next request without counting it first) is waited for, up to
        # the entry's term: a request sent on its strength counts itself again, even
        # under these leases, and makes the plan stale below.
        # Out of time with one still standing: nothing is stopped (its holder may still
        # send a request on its strength, which a stop now would cut).
        lingers = _wait_lingering(deps, [t.name for t in taken])
        if lingers:
            return Room(
                "timeout",
                reason=f"{lingers}'s lingering in-flight entry did not lapse in time "
                "(a proxy may still send it a request): nothing was stopped",
            )
        # Under the leases: a victim must still run its recorded server, and nothing may
        # be in flight (an in_use that began before the lease is counted; none begins
        # after it, but a lingering holder's).
        counts = deps.store.inflight()
        now = deps.clock()
        for t in taken:
            if t.record.phase is not Phase.RUNNING or not t.record.handle:
                return Room("stale")
            if t.name in yielded:
                # Stopped only because it sat idle (its priority is not below ours): a
                # use since the plan (a request, a touch) means it no longer yields, and
                # --force never cuts an idle server's request short: it is in use.
                after = yielded[t.name]
                if counts.get(t.name, 0) > 0 or after is None:
                    return Room("stale")
                if idle_seconds(t.record, now) < after:
                    return Room("stale")
            elif counts.get(t.name, 0) > 0 and not deps.force:
                return Room("stale")
        for t in list(taken):
            assert t.record.handle is not None
            update = RecordUpdate(phase=Phase.PREEMPTED, handle=None)
            # Marked before the stop: a preemptor killed mid-way leaves its victim
            # `preempted` (brought back once it fits), never `running` with its server
            # gone. Put back to `running` if the stop fails.
            deps.store.update(t.name, t.holder.id, RecordUpdate(phase=Phase.PREEMPTED))
            # A preemptor killed here leaves a live server under `preempted`: whoever
            # reads it next heals it back to `running` (``gpuctl.flows.heal``).
            failpoints.hit("preempt.after_mark")
            try:
                if is_job(t.name):
                    # Its handle stays, so its `gpuctl run` can say it was preempted.
                    if deps.stop_job is None:
                        raise LauncherError(f"cannot stop {t.name}: no way to stop run jobs")
                    deps.stop_job(t.name, t.record.handle, t.holder.id, snapshot)
                    update = RecordUpdate(phase=Phase.PREEMPTED)
                else:
                    assert deps.launcher_for is not None
                    vs = deps.config.service(t.name)
                    # The snapshot says which machine the agent runs on: a process
                    # launcher signals a server only on its own machine.
                    launcher = deps.launcher_for(vs, snapshot)
                    launcher.stop(Handle.from_dict(t.record.handle), vs.stop_timeout_s, vs.name)
            except GpuctlError as e:
                with contextlib.suppress(GpuctlError):
                    deps.store.release(t.name, t.holder.id, RecordUpdate(phase=Phase.RUNNING))
                taken.remove(t)
                room.outcome = "failed"
                room.reason = f"could not stop {t.name} to make room: {e.message}"
                room.hint = e.hint
                return room
            failpoints.hit("preempt.after_victim_stop")
            cause = "yield" if t.name in yielded else "preempted"
            deps.store.release(
                t.name,
                t.holder.id,
                update,
                event=story.ev(
                    "stop",
                    t.name,
                    "preempt",
                    job=is_job(t.name),
                    cause=cause,
                    by=deps.by or None,
                    before=t.record.phase,
                    after=Phase.PREEMPTED,
                    reason=deps.why or None,
                    idle_s=idle_seconds(t.record, now) if t.name in yielded else None,
                ),
            )
            taken.remove(t)
            room.stopped.append(t.name)
        return room
    finally:
        for t in taken:
            with contextlib.suppress(GpuctlError):
                deps.store.release(t.name, t.holder.id)


def _wait_lingering(deps: RoomDeps, victims: list[str]) -> str | None:
    """Wait until no victim has a lingering in-flight entry (each lapses within
    ``INFLIGHT_TTL_MAX_S``); at the deadline, the first victim whose entry still stands
    (None: none does)."""
    while True:
        left = {n: s for n, s in deps.store.lingering().items() if n in victims and s > 0}
        if not left:
            return None
        room = deps.deadline - deps.clock()
        if room <= 0:
            return min(left)
        deps.sleep(min(max(left.values()), room, LINGER_POLL_S))


def _wait_for_memory(deps: RoomDeps, room: Room) -> Room:
    """Poll fresh readings until the work fits (made), or the deadline."""
    last = "the victims' memory has not come back"
    while True:
        v = deps.look_again()
        if v.decision in (Decision.IDLE, Decision.FITS):
            return room
        if v.decision is Decision.READY:
            room.outcome = "ready"
            return room
        if v.decision is Decision.UNKNOWN:
            room.outcome, room.reason, room.verdict = "unknown", v.reason, v
            return room
        last = v.reason
        if deps.clock() + POLL_S > deps.deadline:
            room.outcome = "timeout"
            room.reason = f"stopped the victims, but the memory did not come back in time: {last}"
            return room
        deps.sleep(POLL_S)


def preempt(
    ctx: Ctx, verdict: Verdict, snapshot: Snapshot | None, wait: bool
) -> EnsureResult | None:
    """``ensure --preempt``: carry out ``verdict.plan`` and start the service with
    ``launch_under_lease``; None: look again (the plan went stale: a
    victim's lease was taken, or the service's own)."""
    deps, svc = ctx.deps, ctx.deps.service
    plan = verdict.plan
    assert plan is not None
    holder = deps.machine.holder(ctx.req.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    granted, own = deps.store.acquire(svc.name, holder, ttl, svc.promise())
    if not granted:
        return None  # someone else is starting it: look again (a bystander waits)
    own_released = False
    restore: RecordUpdate | None = None
    try:
        if own.phase is not Phase.STARTING:
            # Its memory is promised before the victims give theirs back: `starting`
            # under this lease counts it at its budget for every other admission (a
            # resume of a victim, a `gpuctl run` job), so the room made for it is still
            # there at its launch (a resume once took it, and it ended BUSY).
            # No start nonce: nothing is spawned yet, so if this caller is killed the
            # record is no orphaned start (whose memory would stay promised).
            promise = RecordUpdate(phase=Phase.STARTING, start_nonce=None)
            deps.store.update(svc.name, holder.id, promise)
            restore = RecordUpdate(phase=own.phase, start_nonce=own.start_nonce)
        room = make_room(
            RoomDeps(
                deps.config,
                deps.store,
                ctx.deadline,
                lambda: look(
                    deps,
                    deps.servers.health(),
                    own_holder=holder.id,
                    fresh=True,
                    force=ctx.req.force,
                )[0],
                holder=deps.machine.holder,
                stop_job=deps.launchers.stop_job,
                launcher_for=deps.launchers.other,
                force=ctx.req.force,
                clock=deps.clock,
                sleep=deps.sleep,
                by=svc.name,
                why=f"priority {svc.priority}, needed {plan.need_mib} MiB on GPU {plan.gpu}",
            ),
            plan,
            snapshot,
        )
        if room.stopped:
            ctx.notes.append(room.note())
        if room.outcome == "stale":
            return None
        if room.outcome == "failed":
            kw = {"hint": room.hint} if room.hint else {}
            return ctx.result(Outcome.FAILED, room.reason, Decision.PREEMPTABLE, **kw)
        if room.outcome == "timeout":
            return ctx.result(Outcome.TIMEOUT, room.reason, Decision.PREEMPTABLE)
        if room.outcome == "unknown":
            assert room.verdict is not None
            return ctx.from_verdict(room.verdict)
        failpoints.hit("preempt.before_launch")
        # launch_under_lease releases it from here on, putting `restore` back if it
        # launches nothing (refused, out of time, an exception).
        own_released = True
        return launch_under_lease(ctx, holder, ttl, Decision.PREEMPTABLE, wait, restore=restore)
    finally:
        if not own_released:
            with contextlib.suppress(GpuctlError):
                deps.store.release(svc.name, holder.id, restore)
