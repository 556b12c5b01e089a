"""``gpuctl run --preempt``: make room for a job that is PREEMPTABLE with the one
machinery ``ensure --preempt`` uses (``gpuctl.flows.preempt.make_room``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal, Protocol

from gpuctl.adapters.launchers.base import Launcher
from gpuctl.adapters.store import Store
from gpuctl.config import Config, ServiceConfig
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.jobs import JobSpec
from gpuctl.core.model import HostIdentity, Snapshot
from gpuctl.errors import ExitCode
from gpuctl.flows.deps import JobStopper
from gpuctl.flows.observe import Observation
from gpuctl.flows.preempt import RoomDeps, local_job_stopper, make_room
from gpuctl.flows.victims import victim_facts, with_victims

# (a victim service, snapshot) -> its launcher, to stop it with
VictimLauncher = Callable[[ServiceConfig, Snapshot | None], Launcher]
# (a service) -> its server's requests in flight (vLLM's /metrics); None: none to read
InFlightReader = Callable[[ServiceConfig], int | None]


class JobRoomDeps(Protocol):
    """What of ``gpuctl.flows.run.RunDeps`` a preemption uses."""

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
    def here(self) -> HostIdentity: ...


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
    (``flows.victims.with_victims``)."""
    facts = partial(
        victim_facts,
        seen,
        services,
        spec,
        counts=deps.store.inflight,
        server_in_flight=deps.server_in_flight,
        here=deps.here,
    )
    return with_victims(verdict, spec, judge, facts)


def make_room_for_job(
    deps: JobRoomDeps,
    verdict: Verdict,
    snapshot: Snapshot | None,
    *,
    deadline: float,
    look_again: Callable[[], Verdict],
    notes: list[str],
) -> tuple[int, str, str] | Literal[False] | None:
    """On a PREEMPTABLE ``verdict``, stop its plan's victims and wait until
    ``look_again`` (a fresh look at the job) says it fits. Returns None: look again
    under the admission lock, and start CMD if it fits there; False: not PREEMPTABLE,
    nothing done; else (exit code, reason, hint) of a preemption that failed (a stop
    failed: 1; the memory did not come back in time: 5; the host could not be read: 4),
    and CMD does not run."""
    plan = verdict.plan
    if verdict.decision is not Decision.PREEMPTABLE or plan is None:
        return False
    deps.tell(f"preempting {plan.describe()} to make room")
    room = make_room(
        RoomDeps(
            deps.config,
            deps.store,
            deadline,
            look_again,
            stop_job=deps.stop_job or local_job_stopper,
            launcher_for=deps.launcher_for,
            clock=deps.clock,
            sleep=deps.sleep,
        ),
        plan,
        snapshot,
    )
    if room.stopped:
        notes.append(room.note())
        deps.tell(room.note())
    if room.outcome in ("made", "ready", "stale"):
        return None
    code = {"timeout": ExitCode.TIMEOUT, "unknown": ExitCode.UNKNOWN}.get(room.outcome, 1)
    return int(code), room.reason, room.hint or "`gpuctl status` shows the host"


def preempt_hint(verdict: Verdict) -> str | None:
    """For a PREEMPTABLE job run without ``--preempt``: how to ask (None: not one)."""
    if verdict.decision is not Decision.PREEMPTABLE or verdict.plan is None:
        return None
    names = ", ".join(verdict.plan.names)
    return f"`gpuctl run --preempt …` stops {names} to make room; or wait for room with --wait"
