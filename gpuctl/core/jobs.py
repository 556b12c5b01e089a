"""Ad-hoc jobs (``gpuctl run``) as the decisions see them: records named ``run.<name>``.

A job has no config table: its record is its spec. While CMD runs, the record holds its
pid and start time and the job's budget, priority and whether it may be preempted (the
handle, ``kind = "run"``). The record names the pid, so the agent reports the process
whether or not it is on the GPU yet, and every decision counts it at the larger of what
it holds and its budget, like a service. Once CMD has died the pid is no longer reported
and the job counts for nothing: the record is void even when ``gpuctl run`` itself was
killed and never wrote that CMD ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from gpuctl.core.record import Phase, Record
from gpuctl.core.snapshot import HostIdentity

PREFIX = "run."
# The priorities a service may have (the config's range), and so a job or a waiter: a
# record or queue entry claiming more is capped (a job) or refused (a waiter), so that no
# forged file outranks everything a person can configure.
PRIORITY_MAX = 1_000_000
# A job's process is its own: no keyword, only its recorded pid, makes a process its.
JOB_HEALTH_TIMEOUT_S = 365 * 24 * 3600.0
# How long a preempted job gets between SIGTERM and SIGKILL to save its work.
JOB_GRACE_S = 10.0
# How long `gpuctl locks` lists a job's record after the job ended (``--finished``: always).
FINISHED_SHOWN_S = 3600.0


class JobSpec(msgspec.Struct, frozen=True):
    """A running ``gpuctl run`` job, as a ``ServiceSpec`` for the decision."""

    name: str
    memory_mib: int | None
    priority: int
    preemptible: bool = False
    pid: int | None = None
    pid_start: float | None = None
    devices: tuple[int, ...] | None = None
    health_timeout_s: float = JOB_HEALTH_TIMEOUT_S

    @property
    def keywords(self) -> tuple[str, ...]:
        return ()

    @property
    def default_match(self) -> bool:
        return False

    @property
    def job(self) -> str:
        """The name the user gave (``whisper`` for the record ``run.whisper``)."""
        return self.name[len(PREFIX) :]


def is_job(name: str) -> bool:
    return name.startswith(PREFIX)


def finished_long_ago(record: Record, now: float, shown_s: float = FINISHED_SHOWN_S) -> bool:
    """A job's record that ended more than ``shown_s`` ago and holds nothing: phase
    ``stopped`` or ``preempted`` (``gpuctl run`` wrote that CMD ended), no lease (no
    preemption or start under way), no handle (no pid that could still count), no
    failure and no note of a set-aside file. Nothing reads such a record again but
    ``job_name`` (which keeps the name free) and a preemption's own ``gpuctl run`` (before
    it ends): ``gpuctl locks`` leaves it out, or every ``run`` would stay there for ever."""
    return (
        is_job(record.service)
        and record.phase in (Phase.STOPPED, Phase.PREEMPTED)
        and record.lease is None
        and record.handle is None
        and record.failure is None
        and record.recovered is None
        and now - record.since > shown_s
    )


def job_spec(record: Record) -> JobSpec | None:
    """The job a record describes, or None (not a job's, ended, or not one we wrote)."""
    h = record.handle or {}
    if not is_job(record.service) or h.get("kind") != "run":
        return None
    pid, mem, prio = h.get("pid"), h.get("memory_mib"), h.get("priority")
    if not isinstance(mem, int) or not isinstance(prio, int):
        return None
    # Running: its CMD's pid. Starting: a `run --preempt` keeping the room it makes (its
    # budget counts while its lease lives, as a service's start; no process is its yet).
    if (record.phase is Phase.RUNNING and isinstance(pid, int)) or (
        record.phase is Phase.STARTING and pid is None
    ):
        pass
    else:
        return None
    start = h.get("pid_start")
    return JobSpec(
        record.service,
        mem,
        max(-PRIORITY_MAX, min(PRIORITY_MAX, prio)),
        preemptible=h.get("preemptible") is True,
        pid=pid if isinstance(pid, int) else None,
        pid_start=float(start) if isinstance(start, int | float) else None,
    )


def job_specs(records: Iterable[Record], exclude: str = "") -> list[JobSpec]:
    """Every job the records describe (their processes may have ended: a job whose pid
    the agent no longer reports counts for nothing)."""
    return [j for r in records if r.service != exclude and (j := job_spec(r)) is not None]


Route = Literal["here", "agent"]


def job_route(
    handle: Mapping[str, Any], here: HostIdentity, agent: HostIdentity | None
) -> Route | None:
    """Who can signal a job's CMD: this machine (it runs here), the host's agent (it runs
    on the agent's machine; ``agent`` is None for a host read without one), or nobody
    (None): a pid means something only on the machine, and in the boot, that wrote it."""
    where = (handle.get("host"), handle.get("boot_id"))
    if where == (here.hostname, here.boot_id):
        return "here"
    if agent is not None and where == (agent.hostname, agent.boot_id):
        return "agent"
    return None


def unreachable(
    handle: Mapping[str, Any], here: HostIdentity, agent: HostIdentity | None
) -> str | None:
    """None when the job can be signalled from here or through the agent; else why not
    (the planner's words: such a job is no victim)."""
    if job_route(handle, here, agent) is not None:
        return None
    host = handle.get("host")
    on = f"on {host}" if isinstance(host, str) and host else "on another machine"
    if agent is None:
        return f"a run job {on}, which this machine ({here.hostname}) cannot signal (no agent)"
    return (
        f"a run job {on}, which neither this machine ({here.hostname}) nor the agent "
        f"({agent.hostname}) can signal"
    )
