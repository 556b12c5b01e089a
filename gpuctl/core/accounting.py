"""Memory per GPU, as admission counts it (README: How it decides).

A service fits on one GPU, never on the sum of several. On each GPU: memory no process
accounts for ("unattributed": processes whose memory NVML cannot tell, as on MIG, or
in another PID namespace, and the driver's reserve) counts as held; a process of a
configured service counts at the larger of what it holds and its budget (a server that
is still loading grows to it); a service that is starting with nothing on a GPU yet
counts at its budget on every GPU it may land on. ``classify`` chooses among the GPUs
with ``candidates`` and ``best_fit`` and names the holders with ``held_by``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from gpuctl.core.jobs import JobSpec
from gpuctl.core.model import DRIVER_RESERVE_MIB, GpuProcess, Snapshot
from gpuctl.core.ownership import ServiceSpec, describe_process, loading_match, owner_of
from gpuctl.core.units import format_mib


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
    # What each service running here counts for in ``committed_mib`` (max of measured
    # and budget): what stopping it would give back, for the victim planner.
    shares: tuple[tuple[str, int], ...] = ()

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
        shares = []
        for o in others:
            on = measured.get(o.name, {})
            if on:
                if d.index in on:
                    # A server spread over several GPUs grows to its budget over all of them.
                    share = max(on[d.index], (o.memory_mib or 0) // len(on))
                    committed += share
                    shares.append((o.name, share))
            elif o.name in promised and (o.devices is None or d.index in o.devices):
                committed += o.memory_mib or 0
                names.append(o.name)
                if isinstance(o, JobSpec) and o.pid is not None:
                    # A run job whose CMD lives (its pid recorded) but shows no memory
                    # yet: stopping it gives its budget back, so it is a share a
                    # preemption may take (and held_back names why when it may not).
                    shares.append((o.name, o.memory_mib or 0))
        total = d.memory_total_mib if d.memory_total_mib is not None else total_override_mib
        rooms.append(
            GpuRoom(
                d.index,
                total,
                committed,
                unattributed,
                tuple(holders.get(d.index, ())),
                tuple(names),
                shares=tuple(shares),
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


def candidates(spec: ServiceSpec, rooms: Sequence[GpuRoom]) -> tuple[list[GpuRoom], str]:
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


def best_fit(rooms: Sequence[GpuRoom], need: int) -> GpuRoom | None:
    """The GPU where ``need`` fits most tightly (best fit: it keeps the roomiest GPUs whole
    for a bigger service later); the lowest index on a tie."""
    fits = [r for r in rooms if r.free_mib is not None and need <= r.free_mib]
    return min(fits, key=lambda r: (r.free_mib, r.index)) if fits else None


def on_gpu_text(room: GpuRoom, many: bool) -> str:
    return f" on GPU {room.index}" if many else ""


def holders_of(rooms: Sequence[GpuRoom]) -> tuple[GpuProcess, ...]:
    return tuple(h for r in rooms for h in r.holders)


def held_by(
    rooms: Sequence[GpuRoom], top: int = 2, label: Callable[[GpuProcess], str] | None = None
) -> str:
    """The biggest holders by name and a count of the rest, so a reason stays one line or two.
    ``label`` adds to a process what it is to gpuctl (its service and priority)."""
    procs = sorted(holders_of(rooms), key=lambda p: -(p.memory_mib or 0))
    parts = [describe_process(p) + (label(p) if label else "") for p in procs[:top]]
    promised = sorted({n for r in rooms for n in r.promised})
    rest = len(procs) - top
    if rest > 0:
        parts.append(f"{rest} more")
    parts += [f"{n} (starting)" for n in promised]
    unattributed = max((r.unattributed_mib for r in rooms), default=0)
    if unattributed > DRIVER_RESERVE_MIB:
        parts.append(f"{format_mib(unattributed)} no process accounts for")
    return "; ".join(parts) or "other services starting"
