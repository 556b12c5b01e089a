"""The decision (docs/explanation/decisions.md): what state is a service in, and may it start now?

``classify`` is a pure function of the service's health answer, the agent's snapshot
(or why there is none), the service's spec and the other services' specs. The rows
are checked in order of precedence; the first that holds wins:

=========== ==============================================================
SLEEPING    vLLM sleep mode: /health answers, /is_sleeping says it sleeps (gpuctl
            reclaim put it there with ``stop = "sleep"``); ``ensure`` wakes it
READY       the health endpoint answers 200 (even while the agent is down)
UNKNOWN     not healthy, and the agent cannot tell us why; or a GPU the service may
            use cannot be read: never start blind
LOADING     someone else holds its lease, or a process of this service is on the GPU
            or starting (not on it yet), or its recorded server runs
FAILED      the last start failed and its back-off has not run out
IDLE        no GPU process at all, no other service is starting, and no GPU holds
            memory beyond the driver's reserve that no process accounts for
FITS        others hold GPU memory, but this service's budget fits on one GPU beside them
PREEMPTABLE it fits on no GPU as things are, but would on one once some victims stop:
            managed services of strictly lower priority, servers idle past their
            ``yield_after`` whatever their priority, or ``gpuctl run --preemptible``
            jobs, with nothing in flight (``gpuctl.core.plan``); only when the caller
            hands in ``victims`` (what it knows of the running services)
BUSY        it fits on no GPU it may use (or has no budget and anything else runs): say
            who (pid, command, memory; the service and its priority when it is ours)
=========== ==============================================================

Memory is accounted per GPU (``gpu_rooms``), and per MIG instance where MIG is on: a
service fits on one GPU or instance, of the GPUs its ``devices`` names, and the verdict
says which (best fit). On each GPU, a
process of a configured service counts at the larger of what it holds and its
service's budget; a service that is starting (not on a GPU yet) counts at its budget
on every GPU it may land on; and device memory that no process accounts for
("unattributed") counts too. A server that is still loading grows to its budget;
counting only what it holds now would admit a second server into memory already
promised.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

import msgspec

from gpuctl.core.accounting import (
    GpuRoom,
    best_fit,
    candidates,
    committed_memory,
    gpu_rooms,
    held_by,
    holders_of,
    on_gpu_text,
)
from gpuctl.core.ownership import (
    ServiceSpec,
    describe_process,
    loading_match,
    loading_owner,
    owner_of,
    owns,
    short_command,
)
from gpuctl.core.plan import Plan, VictimFacts, held_back, plan_victims
from gpuctl.core.record import Record, in_backoff
from gpuctl.core.snapshot import DRIVER_RESERVE_MIB, GpuProcess, Snapshot, StartingProcess
from gpuctl.core.units import format_duration, format_mib

# The accounting and ownership helpers are part of the decision's public face: flows,
# renderers and tests import them from here.
__all__ = [
    "NO_HEALTH",
    "Decision",
    "GpuRoom",
    "Health",
    "ServiceSpec",
    "Verdict",
    "classify",
    "committed_memory",
    "gpu_rooms",
    "loading_match",
    "loading_owner",
    "owner_of",
    "owns",
]


# A BUSY reason names this many holders (the biggest) before "N more": who holds the GPU
# is its answer. (`status --json` lists every one in `holders`.)
BUSY_HOLDERS = 4


class Decision(StrEnum):
    READY = "READY"
    UNKNOWN = "UNKNOWN"
    SLEEPING = "SLEEPING"
    LOADING = "LOADING"
    FAILED = "FAILED"
    IDLE = "IDLE"
    FITS = "FITS"
    PREEMPTABLE = "PREEMPTABLE"
    BUSY = "BUSY"


class Health(msgspec.Struct, frozen=True):
    """One health check's answer.

    ``state`` is ``ready`` (200), ``refused`` (connection refused/reset: a vLLM that is
    loading binds its port but does not listen yet), ``timeout``, ``error`` (an HTTP
    status other than 200: 503 means the engine is dead), ``sleeping`` (200, but vLLM
    sleep mode says it sleeps: not ready until woken), or ``none`` (no health URL).
    """

    state: str
    detail: str = ""
    status_code: int | None = None
    # What the server says it holds on the GPU, where it says (Ollama's /api/ps
    # size_vram): an Ollama model has no process of its own to measure.
    memory_mib: int | None = None
    # The URL asked where it is not the service's ``health`` as written: a Slurm job's
    # ``{node}`` expanded (the ensure flow records it for the agent and ``status``).
    url: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ready"


NO_HEALTH = Health("none", "no health URL configured")


class Verdict(msgspec.Struct, frozen=True):
    """The decision with its reason in words, and the processes behind it."""

    service: str
    decision: Decision
    reason: str
    own: tuple[GpuProcess, ...] = ()
    starting: tuple[StartingProcess, ...] = ()
    holders: tuple[GpuProcess, ...] = ()
    need_mib: int | None = None
    free_mib: int | None = None
    # The GPU it fits on (IDLE, FITS; PREEMPTABLE: once the plan's victims stop).
    gpu: int | None = None
    # PREEMPTABLE: what to stop, and where.
    plan: Plan | None = None
    # What the user can do about it, where the decision knows better than the caller.
    hint: str = ""
    # BUSY: (pid, service or ``run.NAME`` job) of the holders that are ours (by a
    # record's pid too, which the caller's keywords alone would not tell).
    ours: tuple[tuple[int, str], ...] = ()

    @property
    def own_memory_mib(self) -> int:
        return sum(p.memory_mib or 0 for p in self.own)


def classify(
    spec: ServiceSpec,
    health: Health,
    snapshot: Snapshot | None,
    *,
    others: Sequence[ServiceSpec] = (),
    agent_error: str | None = None,
    total_override_mib: int | None = None,
    record: Record | None = None,
    handle_alive: bool | None = None,
    now: float = 0.0,
    own_holder: str | None = None,
    leased: Collection[str] = (),
    servers: Mapping[int, str] | None = None,
    victims: Mapping[str, VictimFacts] | None = None,
    force: bool = False,
) -> Verdict:
    """Decide the state of ``spec`` (see the module docstring for the rows).

    Args:
        spec: the service being decided.
        health: its health answer (``NO_HEALTH`` when it has no health URL).
        snapshot: the agent's (or local probe's) view, or None when there is none.
        others: every other configured service on the same host.
        agent_error: why there is no snapshot, in words.
        total_override_mib: the host's GPU memory from the config, used where the
            probe cannot tell (unified memory).
        record: the service's record from the store; its lease is already the
            effective one (an expired or void lease reads as none).
        handle_alive: whether the server the record points to still runs (None: unknown).
        now: the clock, for the lease and the back-off.
        own_holder: a lease held by this holder id is ours (re-checking under our own
            lease), so it does not make the service LOADING.
        leased: other services whose lease is live (a start under way): they count at
            their budget, so two services never start into the same memory at once.
        servers: the pids the services' records name (their launchers recorded them),
            and whose they are: a recorded server is its service's, whatever its
            command line, and at any age.
        victims: what the caller knows of the running services as victims (their
            priority, in-flight requests, leases, restart cost); None: PREEMPTABLE is
            not considered (the answer is BUSY).
        force: victims with requests in flight may be planned too (``--force``).
    """
    everyone = [spec, *(o for o in others if o.name != spec.name)]

    def mine(pid: int, command: str | None) -> bool:
        o = owner_of(command, everyone, pid, servers)
        return o is not None and o.name == spec.name

    name = spec.name
    if health.state == "sleeping":
        # vLLM answers /health while asleep; its /is_sleeping told the health check.
        own_asleep = (
            tuple(p for p in snapshot.gpu_processes if mine(p.pid, p.command)) if snapshot else ()
        )
        return Verdict(name, Decision.SLEEPING, f"asleep ({health.detail})", own=own_asleep)
    if health.ok:
        own_ready = (
            tuple(p for p in snapshot.gpu_processes if mine(p.pid, p.command)) if snapshot else ()
        )
        return Verdict(
            name,
            Decision.READY,
            f"answers its health check ({health.detail or 'HTTP 200'})",
            own=own_ready,
        )
    if snapshot is None:
        why = agent_error or "no answer from the agent"
        return Verdict(
            name, Decision.UNKNOWN, f"not healthy ({health.detail or health.state}), and {why}"
        )

    own = tuple(p for p in snapshot.gpu_processes if mine(p.pid, p.command))
    own_pids = {p.pid for p in own}
    starting = tuple(
        s
        for s in (snapshot.starting or ())
        if mine(s.pid, s.command) and loading_match(spec, s, servers) and s.pid not in own_pids
    )
    lease = record.lease if record else None
    if lease is not None and lease.holder != own_holder:
        # Its processes go with it: a server 40 GiB into its load under a start's lease
        # holds 40 GiB, which the MEMORY column shows against its budget, as for READY.
        return Verdict(
            name,
            Decision.LOADING,
            f"being started by {lease.entry} (pid {lease.pid} on {lease.host}), lease expires in "
            f"{format_duration(lease.expires - now)}; health: {health.detail or health.state}",
            own=own,
            starting=starting,
        )
    if own or starting:
        parts = [describe_process(p) for p in own]
        parts += [
            f"pid {s.pid} starting (not on the GPU yet): {short_command(s.command, 60)}"
            for s in starting[:3]
        ]
        state = health.detail or health.state
        # Only a keyword says these are the service's (no record names their pid): they may
        # be someone else's job whose command line happens to carry the word.
        by_keyword = not any(p in (servers or {}) for p in (*own_pids, *(s.pid for s in starting)))
        hint = (
            f"not yours? narrow the service's `match` keywords (services.{name}.match); "
            f"if it is, wait: `gpuctl ensure {name} --timeout DURATION`"
            if by_keyword
            else ""
        )
        return Verdict(
            name,
            Decision.LOADING,
            f"{'; '.join(parts)}; health: {state}",
            own=own,
            starting=starting,
            hint=hint,
        )

    if handle_alive and record is not None and record.handle:
        h = record.handle
        what = h.get("container_name") or (
            f"pid {h['pid']}"
            if h.get("pid")
            else f"Slurm job {h['job_id']}"
            if h.get("job_id")
            else h.get("kind", "server")
        )
        return Verdict(
            name,
            Decision.LOADING,
            f"its server ({what}) runs; health: {health.detail or health.state}",
        )
    if in_backoff(record, now):
        assert record is not None and record.failure is not None
        f = record.failure
        return Verdict(
            name,
            Decision.FAILED,
            f"the last start failed ({f.error}); next try in {format_duration(f.backoff_until - now)} "
            f"(failure {f.count})",
        )

    specs = [s for s in others if s.name != name]
    others_starting = any(
        loading_owner(s, specs, servers) is not None for s in (snapshot.starting or ())
    )
    others_leased = [n for n in leased if n != name and any(o.name == n for o in specs)]
    rooms = gpu_rooms(
        snapshot,
        specs,
        exclude=spec,
        starting_services=others_leased,
        servers=servers,
        total_override_mib=total_override_mib,
    )
    usable, unknown = candidates(spec, rooms)
    if unknown:
        return Verdict(
            name, Decision.UNKNOWN, f"not healthy ({health.detail or health.state}); {unknown}"
        )
    many = len(rooms) > 1
    need = spec.memory_mib
    # Memory beyond the driver's reserve that no process accounts for is a process we
    # cannot see (another PID namespace, a MIG instance hidden from us): never IDLE; the
    # rows below count it as held (FITS beside it, or BUSY).
    hidden = any(r.unattributed_mib > DRIVER_RESERVE_MIB for r in rooms)
    idle = not snapshot.gpu_processes and not others_starting and not others_leased and not hidden
    if idle:
        # Nothing runs; the reserve still is not free.
        room = best_fit(usable, need or 0)
        if need is None or room is not None or all(r.total_mib is None for r in usable):
            chosen = room or usable[0]
            return Verdict(
                name,
                Decision.IDLE,
                "no process on the GPU" + on_gpu_text(chosen, many),
                gpu=chosen.index,
            )

    def label(p: GpuProcess) -> str:
        o = owner_of(p.command, everyone, p.pid, servers)
        if o is None:
            return ""
        # It counts at its budget (a loading server grows to it): say so, or the
        # reason names 8 GiB held while 80 GiB is what keeps the room.
        grows = o.memory_mib is not None and (p.memory_mib or 0) < o.memory_mib
        return f" = {o.name}, priority {o.priority}" + (
            f", counted at its {format_mib(o.memory_mib)} budget" if grows else ""
        )

    holders_text = held_by(usable, top=BUSY_HOLDERS, label=label)
    by_size = sorted(holders_of(usable), key=lambda p: -(p.memory_mib or 0))
    ours = tuple(
        (p.pid, o.name) for p in by_size if (o := owner_of(p.command, everyone, p.pid, servers))
    )
    if need is None:
        return Verdict(
            name,
            Decision.BUSY,
            f"GPU in use by {holders_text} (the service has no memory budget, so any other process means busy)",
            holders=holders_of(usable),
            ours=ours,
        )
    room = best_fit(usable, need)
    if room is not None:
        assert room.free_mib is not None and room.total_mib is not None
        return Verdict(
            name,
            Decision.FITS,
            f"needs {format_mib(need)}, {format_mib(room.free_mib)} of {format_mib(room.total_mib)} "
            f"free{on_gpu_text(room, many)} {_beside(room)}",
            holders=room.holders,
            need_mib=need,
            free_mib=room.free_mib,
            gpu=room.index,
        )
    known = [r for r in usable if r.total_mib is not None]
    if not known:
        return Verdict(
            name,
            Decision.BUSY,
            f"GPU total memory unknown, cannot tell whether {format_mib(need)} fits beside {holders_text}",
            holders=holders_of(usable),
            need_mib=need,
            ours=ours,
        )
    if victims is not None:
        plan = plan_victims(need, usable, victims, priority=spec.priority, force=force)
        if plan is not None:
            on = next(r for r in usable if (r.index, r.mig) == (plan.gpu, plan.mig))
            assert on.total_mib is not None
            stops = "stops" if len(plan.victims) == 1 else "stop"
            return Verdict(
                name,
                Decision.PREEMPTABLE,
                f"needs {format_mib(need)} but only {format_mib(max(plan.free_mib, 0))} of "
                f"{format_mib(on.total_mib)} free{on_gpu_text(on, many)}; fits once "
                f"{plan.describe()} {stops}",
                holders=holders_of(usable),
                need_mib=need,
                free_mib=plan.free_mib,
                gpu=plan.gpu,
                plan=plan,
                hint=f"`gpuctl ensure {name} --preempt` stops {', '.join(plan.names)} to make "
                f"room (or set preempt = true in [services.{name}]); or wait and try again",
            )
    most = max(known, key=lambda r: (r.free_mib or 0, -r.index))
    assert most.free_mib is not None and most.total_mib is not None
    mig = any(r.mig is not None for r in usable)
    where = on_gpu_text(most, many)
    best = ""
    if many and len(usable) > 1:
        where = " on any MIG instance or GPU" if mig else " on any GPU"
        best = f" (most{on_gpu_text(most, True)})"
    kept = ""
    if victims is not None:
        kept_back = held_back(usable, victims, priority=spec.priority, force=force)
        kept = f"; not stoppable: {'; '.join(kept_back[:3])}" if kept_back else ""
    return Verdict(
        name,
        Decision.BUSY,
        f"needs {format_mib(need)} but only {format_mib(max(most.free_mib, 0))} of "
        f"{format_mib(most.total_mib)} free{where}{best}; held by "
        f"{held_by((most,), top=BUSY_HOLDERS, label=label)}{kept}",
        holders=holders_of(usable),
        need_mib=need,
        free_mib=most.free_mib,
        ours=ours,
    )


def _beside(room: GpuRoom) -> str:
    """What a FITS shares its GPU with; an empty room on a host that is not idle (others
    starting elsewhere, memory held on another MIG instance) says so."""
    if room.holders or room.promised or room.unattributed_mib > DRIVER_RESERVE_MIB:
        return f"beside {held_by((room,))}"
    return "(nothing holds it; other GPUs or instances are in use)"
