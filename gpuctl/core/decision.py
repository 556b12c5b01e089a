"""The decision (DESIGN §4): what state is a service in, and may it start now?

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
IDLE        no GPU process at all, and no other service is starting
FITS        others hold GPU memory, but this service's budget fits on one GPU beside them
BUSY        it fits on no GPU it may use (or has no budget and anything else runs): say who
=========== ==============================================================

``classify`` never answers PREEMPTABLE yet; its enum member exists so that the wire
format stays as it is when preemption comes.

Memory is accounted per GPU (``gpu_rooms``): a service fits on one GPU, or on one of
the GPUs its ``devices`` names, and the verdict says which (best fit). On each GPU, a
process of a configured service counts at the larger of what it holds and its
service's budget; a service that is starting (not on a GPU yet) counts at its budget
on every GPU it may land on; and device memory that no process accounts for
("unattributed") counts too. A server that is still loading grows to its budget;
counting only what it holds now would admit a second server into memory already
promised.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpuctl.core.model import GpuProcess, Snapshot, StartingProcess
from gpuctl.core.record import Record, in_backoff
from gpuctl.core.units import format_duration, format_mib


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


class ServiceSpec(Protocol):
    """What the decision needs of a service (``gpuctl.config.ServiceConfig`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def keywords(self) -> tuple[str, ...]: ...
    @property
    def memory_mib(self) -> int | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def health_timeout_s(self) -> float: ...
    @property
    def devices(self) -> tuple[int, ...] | None:
        """The GPU indexes the service may use; None: any one GPU."""


def loading_match(
    spec: ServiceSpec, s: StartingProcess, servers: Mapping[int, str] | None = None
) -> bool:
    """A host process not on the GPU that counts as this service loading.

    Either the service's record names it (its launcher recorded its pid), or its command
    carries a keyword and it is younger than the service's health timeout: a model
    server does not read weights for longer than that, while a `tail -f` of its log or
    an editor on its config can sit there for days, and must not block starts.
    """
    if servers and s.pid in servers:
        return servers[s.pid] == spec.name
    return owns(spec, s.command) and (s.age_s is None or s.age_s < spec.health_timeout_s)


@dataclass(frozen=True, slots=True)
class Health:
    """One health check's answer.

    ``state`` is ``ready`` (200), ``refused`` (connection refused/reset: a vLLM that is
    loading binds its port but does not listen yet), ``timeout``, ``error`` (an HTTP
    status other than 200: 503 means the engine is dead), ``sleeping`` (200, but vLLM
    sleep mode says it sleeps: not ready until woken), or ``none`` (no health URL).
    """

    state: str
    detail: str = ""
    status_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ready"


NO_HEALTH = Health("none", "no health URL configured")


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision with its reason in words, and the processes behind it."""

    service: str
    decision: Decision
    reason: str
    own: tuple[GpuProcess, ...] = ()
    starting: tuple[StartingProcess, ...] = ()
    holders: tuple[GpuProcess, ...] = ()
    need_mib: int | None = None
    free_mib: int | None = None
    # The GPU it fits on (IDLE, FITS): where a launch should put it.
    gpu: int | None = None

    @property
    def own_memory_mib(self) -> int:
        return sum(p.memory_mib or 0 for p in self.own)


def owns(spec: ServiceSpec, command: str | None) -> bool:
    """True when a command line carries one of the service's match keywords (case-insensitive)."""
    if not command:
        return False
    low = command.lower()
    return any(k.lower() in low for k in spec.keywords)


def owner_of(
    command: str | None,
    specs: Sequence[ServiceSpec],
    pid: int | None = None,
    servers: Mapping[int, str] | None = None,
) -> ServiceSpec | None:
    """The service a process belongs to: the one whose record names its pid (its launcher
    recorded it: true whatever its command line says), else the first whose keywords match."""
    if servers and pid is not None and pid in servers:
        name = servers[pid]
        return next((s for s in specs if s.name == name), None)
    for s in specs:
        if owns(s, command):
            return s
    return None


def _describe(p: GpuProcess, width: int = 72) -> str:
    """``pid 123 (python -m vllm… , 8.0 GiB)``: short, but with what tells one job from another.

    The program is named by its base name: a long venv path would push the arguments
    (the model, the job's name) out of the cut.
    """
    if p.command is None:
        cmd = "<command not visible>"
    else:
        words = p.command.split()
        cmd = " ".join([words[0].rsplit("/", 1)[-1], *words[1:]]) if words else ""
    if len(cmd) > width:
        cmd = cmd[: width - 1] + "…"
    mem = format_mib(p.memory_mib)
    return f"pid {p.pid} ({cmd}, {mem})"


@dataclass(frozen=True, slots=True)
class GpuRoom:
    """One GPU as admission sees it: what is held or promised there, and by whom.

    ``committed_mib`` = memory that no process accounts for ("unattributed": driver
    reserve, processes whose memory NVML cannot tell, processes in another PID
    namespace) + processes of no service + each service at max(measured, budget) +
    services starting with nothing on a GPU yet, at their budget on every GPU they may
    land on. ``error`` is set when the GPU could not be read: nothing is known of it.
    """

    index: int
    total_mib: int | None
    committed_mib: int
    unattributed_mib: int = 0
    holders: tuple[GpuProcess, ...] = ()
    promised: tuple[str, ...] = ()
    error: str | None = None

    @property
    def free_mib(self) -> int | None:
        return None if self.total_mib is None else self.total_mib - self.committed_mib


def gpu_rooms(
    snapshot: Snapshot,
    specs: Sequence[ServiceSpec],
    *,
    exclude: ServiceSpec | None = None,
    starting_services: Collection[str] = (),
    servers: Mapping[int, str] | None = None,
    total_override_mib: int | None = None,
) -> tuple[GpuRoom, ...]:
    """Memory already promised on each GPU, and the processes holding it.

    Processes of ``exclude`` (the service being decided) are left out. A configured
    service counts at max(measured, budget) on the GPU(s) it runs on; a service that is
    starting (its processes not on a GPU yet, or in ``starting_services``: someone holds
    its lease, its server may not even exist) counts at its budget on each GPU it may
    use, since nobody knows yet which one it will take.
    """
    everyone = [*specs, exclude] if exclude is not None else list(specs)
    others = [s for s in specs if exclude is None or s.name != exclude.name]
    devices = snapshot.device_list()
    known: dict[int, int] = {}  # what processes account for, per GPU (ours included)
    loose: dict[int, int] = {}
    measured: dict[str, dict[int, int]] = {}
    holders: dict[int, list[GpuProcess]] = {}
    for p in snapshot.gpu_processes:
        known[p.gpu] = known.get(p.gpu, 0) + (p.memory_mib or 0)
        svc = owner_of(p.command, everyone, p.pid, servers)
        if exclude is not None and svc is not None and svc.name == exclude.name:
            continue
        holders.setdefault(p.gpu, []).append(p)
        if svc is None:
            loose[p.gpu] = loose.get(p.gpu, 0) + (p.memory_mib or 0)
        else:
            per_gpu = measured.setdefault(svc.name, {})
            per_gpu[p.gpu] = per_gpu.get(p.gpu, 0) + (p.memory_mib or 0)
    promised = {n for n in starting_services if exclude is None or n != exclude.name}
    for sp in snapshot.starting or ():
        svc = owner_of(sp.command, others, sp.pid, servers)
        if svc is not None and loading_match(svc, sp, servers):
            promised.add(svc.name)
    rooms = []
    for d in devices:
        if not d.readable:
            rooms.append(GpuRoom(d.index, None, 0, error=d.error))
            continue
        used = d.memory_used_mib
        unattributed = max(0, used - known.get(d.index, 0)) if used is not None else 0
        committed = unattributed + loose.get(d.index, 0)
        names = []
        for o in others:
            on = measured.get(o.name, {})
            if on:
                if d.index in on:
                    # A server spread over several GPUs grows to its budget over all of them.
                    committed += max(on[d.index], (o.memory_mib or 0) // len(on))
            elif o.name in promised and (o.devices is None or d.index in o.devices):
                committed += o.memory_mib or 0
                names.append(o.name)
        total = d.memory_total_mib if d.memory_total_mib is not None else total_override_mib
        rooms.append(
            GpuRoom(
                d.index,
                total,
                committed,
                unattributed,
                tuple(holders.get(d.index, ())),
                tuple(names),
            )
        )
    return tuple(rooms)


def committed_memory(
    snapshot: Snapshot,
    specs: Sequence[ServiceSpec],
    exclude: ServiceSpec | None = None,
    starting_services: Collection[str] = (),
    servers: Mapping[int, str] | None = None,
) -> tuple[int, list[GpuProcess]]:
    """Memory promised over all GPUs together, and the processes holding it (for views
    of the whole host; admission uses ``gpu_rooms``, one GPU at a time)."""
    rooms = gpu_rooms(
        snapshot, specs, exclude=exclude, starting_services=starting_services, servers=servers
    )
    return sum(r.committed_mib for r in rooms), [h for r in rooms for h in r.holders]


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

    lease = record.lease if record else None
    if lease is not None and lease.holder != own_holder:
        return Verdict(
            name,
            Decision.LOADING,
            f"being started by {lease.entry} (pid {lease.pid} on {lease.host}), lease expires in "
            f"{format_duration(lease.expires - now)}; health: {health.detail or health.state}",
        )
    own = tuple(p for p in snapshot.gpu_processes if mine(p.pid, p.command))
    own_pids = {p.pid for p in own}
    starting = tuple(
        s
        for s in (snapshot.starting or ())
        if mine(s.pid, s.command) and loading_match(spec, s, servers) and s.pid not in own_pids
    )
    if own or starting:
        parts = [_describe(p) for p in own]
        parts += [f"pid {s.pid} starting (not on the GPU yet)" for s in starting[:3]]
        state = health.detail or health.state
        return Verdict(
            name,
            Decision.LOADING,
            f"{'; '.join(parts)}; health: {state}",
            own=own,
            starting=starting,
        )

    if handle_alive and record is not None and record.handle:
        h = record.handle
        what = h.get("container_name") or (
            f"pid {h['pid']}" if h.get("pid") else h.get("kind", "server")
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
        (o := owner_of(s.command, specs, s.pid, servers)) is not None
        and loading_match(o, s, servers)
        for s in (snapshot.starting or ())
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
    candidates, unknown = _candidates(spec, rooms)
    if unknown:
        return Verdict(
            name, Decision.UNKNOWN, f"not healthy ({health.detail or health.state}); {unknown}"
        )
    many = len(rooms) > 1
    need = spec.memory_mib
    idle = not snapshot.gpu_processes and not others_starting and not others_leased
    if idle:
        # Nothing runs, but memory nothing accounts for (a process in another PID
        # namespace, a MIG slice we cannot see into) still is not free.
        room = _best(candidates, need or 0)
        if need is None or room is not None or all(r.total_mib is None for r in candidates):
            chosen = room or candidates[0]
            return Verdict(
                name, Decision.IDLE, "no process on the GPU" + _on(chosen, many), gpu=chosen.index
            )

    held_by = _held_by(candidates)
    if need is None:
        return Verdict(
            name,
            Decision.BUSY,
            f"GPU in use by {held_by} (the service has no memory budget, so any other process means busy)",
            holders=_holders(candidates),
        )
    room = _best(candidates, need)
    if room is not None:
        assert room.free_mib is not None and room.total_mib is not None
        return Verdict(
            name,
            Decision.FITS,
            f"needs {format_mib(need)}, {format_mib(room.free_mib)} of {format_mib(room.total_mib)} "
            f"free{_on(room, many)} beside {_held_by((room,))}",
            holders=room.holders,
            need_mib=need,
            free_mib=room.free_mib,
            gpu=room.index,
        )
    known = [r for r in candidates if r.total_mib is not None]
    if not known:
        return Verdict(
            name,
            Decision.BUSY,
            f"GPU total memory unknown, cannot tell whether {format_mib(need)} fits beside {held_by}",
            holders=_holders(candidates),
            need_mib=need,
        )
    most = max(known, key=lambda r: (r.free_mib or 0, -r.index))
    assert most.free_mib is not None and most.total_mib is not None
    where = " on any GPU" if many and len(candidates) > 1 else _on(most, many)
    best = f" (most on GPU {most.index})" if where == " on any GPU" else ""
    return Verdict(
        name,
        Decision.BUSY,
        f"needs {format_mib(need)} but only {format_mib(max(most.free_mib, 0))} of "
        f"{format_mib(most.total_mib)} free{where}{best}; held by {_held_by((most,))}",
        holders=_holders(candidates),
        need_mib=need,
        free_mib=most.free_mib,
    )


def _candidates(spec: ServiceSpec, rooms: Sequence[GpuRoom]) -> tuple[list[GpuRoom], str]:
    """The GPUs ``spec`` may use, or why nothing can be decided (a GPU it may use is
    unreadable: what runs there, and whether it is ours, is unknown)."""
    by_index = {r.index: r for r in rooms}
    if spec.devices is None:
        chosen = list(rooms)
    else:
        missing = [i for i in spec.devices if i not in by_index]
        if missing:
            have = ", ".join(str(i) for i in sorted(by_index)) or "none"
            return [], (
                f"services.{spec.name}.devices names GPU {missing[0]}, which this host does not "
                f"have (GPUs: {have})"
            )
        chosen = [by_index[i] for i in spec.devices]
    bad = [r for r in chosen if r.error is not None]
    if bad:
        r = bad[0]
        pinned = "" if spec.devices is None else " it is pinned to"
        return [], f"GPU {r.index}{pinned} cannot be read ({r.error})"
    return chosen, ""


def _best(rooms: Sequence[GpuRoom], need: int) -> GpuRoom | None:
    """The GPU where ``need`` fits most tightly (best fit: it keeps the roomiest GPUs whole
    for a bigger service later); the lowest index on a tie."""
    fits = [r for r in rooms if r.free_mib is not None and need <= r.free_mib]
    return min(fits, key=lambda r: (r.free_mib, r.index)) if fits else None


def _on(room: GpuRoom, many: bool) -> str:
    return f" on GPU {room.index}" if many else ""


def _holders(rooms: Sequence[GpuRoom]) -> tuple[GpuProcess, ...]:
    return tuple(h for r in rooms for h in r.holders)


def _held_by(rooms: Sequence[GpuRoom], top: int = 2) -> str:
    """The biggest holders by name and a count of the rest, so a reason stays one line or two."""
    procs = sorted(_holders(rooms), key=lambda p: -(p.memory_mib or 0))
    parts = [_describe(p) for p in procs[:top]]
    promised = sorted({n for r in rooms for n in r.promised})
    rest = len(procs) - top
    if rest > 0:
        parts.append(f"{rest} more")
    parts += [f"{n} (starting)" for n in promised]
    unattributed = max((r.unattributed_mib for r in rooms), default=0)
    if unattributed >= 1024:
        parts.append(f"{format_mib(unattributed)} no process accounts for")
    return "; ".join(parts) or "other services starting"
