"""The agent's snapshot builder: a probe reading plus this host's identity and ``starting``.

The memory rules live in ``gpuctl.core.model.snapshot_from_reading``, which the direct
path (``gpuctl.adapters.local``) uses too: one way to observe a host.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuctl.core.model import (
    HostIdentity,
    ProbeReading,
    Snapshot,
    StartingProcess,
    snapshot_from_reading,
)
from gpuctl.core.timestamps import iso_utc


@dataclass(frozen=True, slots=True)
class Scan:
    """One probe reading and when it was taken (UTC, ISO 8601 with 'Z')."""

    reading: ProbeReading
    taken_at: str


def utc_now_iso() -> str:
    """Now, in gpuctl's one timestamp form (ISO-8601 UTC with milliseconds)."""
    return iso_utc()


def agent_snapshot(
    scan: Scan,
    starting: tuple[StartingProcess, ...] | None,
    *,
    host: HostIdentity,
    state_dir: str | None,
    gpu_memory_mib: int | None,
) -> Snapshot:
    """The ``/status`` snapshot of one scan; ``starting`` None when no keywords were asked."""
    return snapshot_from_reading(
        scan.reading,
        taken_at=scan.taken_at,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpu_memory_mib=gpu_memory_mib,
    )
