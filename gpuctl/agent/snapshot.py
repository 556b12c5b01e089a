"""The agent's snapshot builder: a probe reading plus this host's identity and ``starting``.

Moved here as it was in ``app.py``; ``gpuctl.adapters.local.build_snapshot`` is its twin
for the direct path, and the two are to become one builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from gpuctl.core.model import HostIdentity, ProbeReading, Snapshot, StartingProcess


@dataclass(frozen=True, slots=True)
class Scan:
    """One probe reading and when it was taken (UTC, ISO 8601 with 'Z')."""

    reading: ProbeReading
    taken_at: str


def utc_now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def agent_snapshot(
    scan: Scan,
    starting: tuple[StartingProcess, ...] | None,
    *,
    host: HostIdentity,
    state_dir: str | None,
    gpu_memory_mib: int | None,
) -> Snapshot:
    """The ``/status`` snapshot of one scan; ``starting`` None when no keywords were asked."""
    reading = scan.reading
    used = reading.memory_used_mib
    if used is None:
        # Unified memory reports no device figure: the processes' sum is the truth.
        used = sum(p.memory_mib or 0 for p in reading.processes)
    total = reading.memory_total_mib
    if total is None:
        total = gpu_memory_mib
    if starting is not None:
        on_gpu = {p.pid for p in reading.processes}
        starting = tuple(s for s in starting if s.pid not in on_gpu)
    return Snapshot(
        memory_used_mib=used,
        memory_total_mib=total,
        unified_memory=reading.unified_memory,
        probe=reading.probe,
        taken_at=scan.taken_at,
        processes=reading.processes,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpus=reading.gpus,
    )
