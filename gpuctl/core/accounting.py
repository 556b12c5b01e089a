"""Memory per GPU, as admission counts it (docs/explanation/decisions.md).

A service fits on one GPU, never on the sum of several. On each GPU: memory no process
accounts for ("unattributed": processes whose memory NVML cannot tell, as on MIG, or
in another PID namespace, and the driver's reserve) counts as held; a process of a
configured service counts at the larger of what it holds and its budget (a server that
is still loading grows to it); a service that is starting with nothing on a GPU yet
counts at its budget on every GPU it may land on. ``classify`` chooses among the GPUs
with ``candidates`` and ``best_fit`` and names the holders with ``held_by``.

With MIG on, a GPU is one room per MIG instance (``GpuRoom.mig``): a process sees only
its instance's memory, so a service fits on one instance, never on the parent's free
memory; a service's ``devices`` naming the GPU means any of its instances.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import msgspec

from gpuctl.core.jobs import JobSpec
from gpuctl.core.ownership import ServiceSpec, describe_process, loading_owner, owner_of
from gpuctl.core.snapshot import DRIVER_RESERVE_MIB, GpuDevice, GpuProcess, Snapshot
from gpuctl.core.units import format_mib


class GpuRoom(msgspec.Struct, frozen=True):
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
    # On a GPU with MIG on, the room is one instance (its GPU instance id): a process
    # sees only its instance's memory, so each is a room of its own, with ``index``
    # its GPU's (what a service's ``devices`` names).
    mig: int | None = None

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
    # Keyed by (GPU, MIG instance or None): what processes account for (ours included),
    # what processes of no service hold, and what each service's processes hold.
    known: dict[_Key, int] = {}
    loose: dict[_Key, int] = {}
    measured: dict[str, dict[_Key, int]] = {}
    holders: dict[_Key, list[GpuProcess]] = {}
    for p in snapshot.gpu_processes:
        key = (p.gpu, p.mig)
        known[key] = known.get(key, 0) + (p.memory_mib or 0)
        svc = owner_of(p.command, everyone, p.pid, servers)
        if exclude is not None and svc is not None and svc.name == exclude.name:
            continue
        holders.setdefault(key, []).append(p)
        if svc is None:
            loose[key] = loose.get(key, 0) + (p.memory_mib or 0)
        else:
            per_gpu = measured.setdefault(svc.name, {})
            per_gpu[key] = per_gpu.get(key, 0) + (p.memory_mib or 0)
    promised = {n for n in starting_services if exclude is None or n != exclude.name}
    for sp in snapshot.starting or ():
        svc = loading_owner(sp, others, servers)
        if svc is not None:
            promised.add(svc.name)
    rooms = []
    for d in devices:
        if not d.readable:
            rooms.append(GpuRoom(d.index, None, 0, error=d.error))
            continue
        for mig, used, slot_total in _slots(d):

            def here(key: _Key, index: int = d.index, mig: int | None = mig) -> bool:
                return _in_slot(key, index, mig)

            attributed = sum(v for k, v in known.items() if here(k))
            unattributed = max(0, used - attributed) if used is not None else 0
            committed = unattributed + sum(v for k, v in loose.items() if here(k))
            names = []
            shares = []
            for o in others:
                on = measured.get(o.name, {})
                if on:
                    mine = [v for k, v in on.items() if here(k)]
                    if mine:
                        # A server spread over several GPUs grows to its budget over all
                        # of them.
                        share = max(sum(mine), (o.memory_mib or 0) // len(on))
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
            total = slot_total
            if total is None and mig is None:
                total = total_override_mib
            rooms.append(
                GpuRoom(
                    d.index,
                    total,
                    committed,
                    unattributed,
                    tuple(h for k, hs in holders.items() if here(k) for h in hs),
                    tuple(names),
                    shares=tuple(shares),
                    mig=mig,
                )
            )
    return tuple(rooms)


_Key = tuple[int, int | None]


def _slots(d: GpuDevice) -> list[tuple[int | None, int | None, int | None]]:
    """(MIG instance, used, total) of each room a device makes: one per MIG instance
    with MIG on, else the device itself."""
    if d.mig:
        return [(m.id, m.memory_used_mib, m.memory_total_mib) for m in d.mig]
    return [(None, d.memory_used_mib, d.memory_total_mib)]


def _in_slot(key: _Key, index: int, mig: int | None) -> bool:
    """Whether a process keyed ``key`` is in the room of ``index`` and ``mig``. One whose
    instance is not known counts in every instance of its GPU: it may hold any of them."""
    gpu, on = key
    return gpu == index and (mig is None or on is None or on == mig)


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
    indices = {r.index for r in rooms}
    if spec.devices is None:
        chosen = list(rooms)
    else:
        missing = [i for i in spec.devices if i not in indices]
        if missing:
            have = ", ".join(str(i) for i in sorted(indices)) or "none"
            return [], (
                f"services.{spec.name}.devices names GPU {missing[0]}, which this host does not "
                f"have (GPUs: {have})"
            )
        # On a GPU with MIG on, a GPU named in ``devices`` is any of its instances.
        chosen = [r for i in dict.fromkeys(spec.devices) for r in rooms if r.index == i]
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
    return min(fits, key=lambda r: (r.free_mib, r.index, r.mig or 0)) if fits else None


def on_gpu_text(room: GpuRoom, many: bool) -> str:
    if room.mig is not None:
        return f" on GPU {room.index} (MIG instance {room.mig})"
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
