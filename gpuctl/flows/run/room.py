"""``gpuctl run --preempt``: make room for a job that is PREEMPTABLE with the one
machinery ``ensure --preempt`` uses (``gpuctl.flows.ensure.preempt.make_room``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, Protocol

from gpuctl.adapters.store.base import Store
from gpuctl.config import Config, ServiceConfig
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.jobs import JobSpec
from gpuctl.core.record import Holder, Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.flows.ensure.preempt import RoomDeps, make_room
from gpuctl.flows.look import Observation, victim_facts, with_victims
from gpuctl.flows.ports import InFlightReader, JobStopper, Machine, VictimLauncher

# Preemptions one `gpuctl run --preempt` makes at most (as ensure's rounds): each frees
# the room its plan needs, but others may take it first.
MAX_PREEMPTIONS = 3
# How long the job's promise (its record `starting`, under its lease) lasts unless it
# starts: the victims' stops (10 s grace each) and the wait for their memory.
PROMISE_TTL_S = 120.0


class JobRoomDeps(Protocol):
    """What of ``gpuctl.flows.run.job.RunDeps`` a preemption uses."""

    @property
    def config(self) -> Config: ...
    @property
    def store(self) -> Store: ...
    @property
    def stop_job(self) -> JobStopper | None: ...
    @property
    def launcher_for(self) -> VictimLauncher | None: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def sleep(self) -> Callable[[float], None]: ...
    @property
    def tell(self) -> Callable[[str], None]: ...
    @property
    def server_in_flight(self) -> InFlightReader | None: ...
    @property
    def machine(self) -> Machine: ...


def with_job_victims(
    deps: JobRoomDeps,
    seen: Observation,
    services: Sequence[ServiceConfig],
    spec: JobSpec,
    verdict: Verdict,
    *,
    judge: Callable[..., Verdict],
) -> Verdict:
    """The job's ``verdict``, or where it is BUSY and stopping lower-priority work would
    make room, PREEMPTABLE with the plan: decided as ``ensure`` and ``status`` decide
    (``flows.look.with_victims``)."""
    facts = partial(
        victim_facts,
        seen,
        services,
        spec,
        counts=deps.store.inflight,
        server_in_flight=deps.server_in_flight,
        machine=deps.machine,
        now=deps.clock(),
    )
    return with_victims(verdict, spec, judge, facts)


class Preemption:
    """One ``gpuctl run --preempt``: its preemptions, and the room they made kept for it.

    Before the victims stop, the job's record (``run.NAME``) is marked ``starting`` under
    its lease with its budget and no pid: every other admission (a resume at the end of
    the victim's own ``gpuctl run``, another job, a service) counts it at its budget, so
    the memory given back is still there when it is admitted, as ``ensure --preempt``
    keeps its service's room. ``_start`` takes that lease again (``holder``) and writes
    the job's pid; ``give_back`` puts the record back when it never started (a no-op once
    it did: the lease is no longer held). A killed ``gpuctl run`` leaves a promise whose
    lease ends by itself, and a starting job without a pid holds nothing.
    """

    def __init__(self, deps: JobRoomDeps, spec: JobSpec, notes: list[str], command: str) -> None:
        self.deps, self.spec, self.notes, self.command = deps, spec, notes, command
        self.attempts = 0
        self.holder: Holder | None = None
        self._restore: RecordUpdate | None = None

    @property
    def holder_id(self) -> str | None:
        return self.holder.id if self.holder is not None else None

    def make_room(
        self,
        verdict: Verdict,
        snapshot: Snapshot | None,
        deadline: float,
        look_again: Callable[[], Verdict],
    ) -> tuple[int, str, str] | Literal[False] | None:
        """On a PREEMPTABLE ``verdict``, promise the job's room and stop its plan's
        victims, then wait until ``look_again`` (a fresh look at the job) says it fits.
        Returns None: look again under the admission lock, and start CMD if it fits
        there; False: nothing to do (not PREEMPTABLE, or ``MAX_PREEMPTIONS`` made: its
        promise is given back, so a job that then waits holds none); else
        (exit code, reason, hint): it failed (a stop: 1; the memory did not come back in
        time: 5; the host could not be read, or the job's record is held: 4), and CMD
        does not run."""
        plan, deps = verdict.plan, self.deps
        if verdict.decision is not Decision.PREEMPTABLE or plan is None:
            # Its room was taken after all (or it never needed any): a job that waits
            # (--wait) must not hold a promise of memory meanwhile.
            self.give_back()
            return False
        if self.attempts >= MAX_PREEMPTIONS:
            self.give_back()
            return False
        self.attempts += 1
        if self.holder is None and not self._promise():
            why = f"the record {self.spec.name} is held by another caller"
            return int(ExitCode.UNKNOWN), why, "`gpuctl locks` shows who holds it"
        deps.tell(f"preempting {plan.describe()} to make room")
        room = make_room(
            RoomDeps(
                deps.config,
                deps.store,
                deadline,
                look_again,
                holder=deps.machine.holder,
                stop_job=deps.stop_job,
                launcher_for=deps.launcher_for,
                clock=deps.clock,
                sleep=deps.sleep,
                by=self.spec.name,
                why=f"priority {self.spec.priority}, needed {plan.need_mib} MiB on GPU {plan.gpu}",
            ),
            plan,
            snapshot,
        )
        if room.stopped:
            self.notes.append(room.note())
            deps.tell(room.note())
        if room.outcome in ("made", "ready", "stale"):
            return None
        code = {"timeout": ExitCode.TIMEOUT, "unknown": ExitCode.UNKNOWN}.get(room.outcome, 1)
        return int(code), room.reason, room.hint or "`gpuctl status` shows the host"

    def _promise(self) -> bool:
        """Mark the job's record ``starting`` with its budget, under its lease."""
        deps, spec = self.deps, self.spec
        holder = deps.machine.holder("run")
        granted, rec = deps.store.acquire(spec.name, holder, PROMISE_TTL_S)
        if not granted:
            return False
        handle: dict[str, Any] = {
            "kind": "run",
            "memory_mib": spec.memory_mib,
            "priority": spec.priority,
            "preemptible": spec.preemptible,
            "host": deps.machine.here.hostname,
            "boot_id": deps.machine.here.boot_id,
            "command": self.command,
        }
        self._restore = RecordUpdate(phase=rec.phase, handle=rec.handle)
        self.holder = holder
        update = RecordUpdate(phase=Phase.STARTING, handle=handle, start_nonce=None)
        deps.store.update(spec.name, holder.id, update)
        return True

    def give_back(self) -> None:
        """The record as it was, if the job never started (its lease still ours)."""
        if self.holder is not None:
            with contextlib.suppress(GpuctlError):
                self.deps.store.release(self.spec.name, self.holder.id, self._restore)
            self.holder = None


def preempt_hint(verdict: Verdict) -> str | None:
    """For a PREEMPTABLE job run without ``--preempt``: how to ask (None: not one)."""
    if verdict.decision is not Decision.PREEMPTABLE or verdict.plan is None:
        return None
    names = ", ".join(verdict.plan.names)
    return f"`gpuctl run --preempt …` stops {names} to make room; or wait for room with --wait"
