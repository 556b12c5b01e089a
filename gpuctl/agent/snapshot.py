"""The agent's snapshot builder: a probe reading plus this host's identity and ``starting``.

The memory rules live in ``gpuctl.core.snapshot.snapshot_from_reading``, which the direct
path (``gpuctl.adapters.local``) uses too: one way to observe a host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuctl.core.snapshot import (
    GpuProcess,
    HostIdentity,
    ProbeReading,
    Snapshot,
    StartingProcess,
    snapshot_from_reading,
)


@dataclass(frozen=True, slots=True)
class Scan:
    """One probe reading and when it was taken (UTC, ISO 8601 with 'Z')."""

    reading: ProbeReading
    taken_at: str


def agent_snapshot(
    scan: Scan,
    starting: tuple[StartingProcess, ...] | None,
    *,
    host: HostIdentity,
    state_dir: str | None,
    gpu_memory_mib: int | None,
    loading: tuple[StartingProcess, ...] = (),
    servers: tuple[tuple[int, str], ...] = (),
    promised: bool = False,
) -> Snapshot:
    """The ``/status`` snapshot of one scan; ``starting`` None when no keywords were asked.

    ``loading``: servers of ours not on the GPU yet (see ``gpuctl.agent.servers``), listed
    in ``processes`` with ``on_gpu`` false and ``memory_mib`` 0 for clients of the
    original API; gpuctl's own accounting skips them (``Snapshot.gpu_processes``).
    ``servers``: (pid, service) of the servers the records name and their children.
    ``promised``: a record holds a lease or says ``starting`` (``is_idle`` is false).
    """
    snap = snapshot_from_reading(
        scan.reading,
        taken_at=scan.taken_at,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpu_memory_mib=gpu_memory_mib,
    )
    if servers or promised:
        snap = replace(snap, servers=servers, promised=promised)
    if not loading:
        return snap
    listed = {p.pid for p in snap.processes}
    extra = tuple(
        GpuProcess(pid=s.pid, command=s.command, memory_mib=0, user=s.user, on_gpu=False)
        for s in dict((s.pid, s) for s in loading if s.pid not in listed).values()
    )
    return replace(snap, processes=snap.processes + extra) if extra else snap
