"""Read this machine's GPU directly: the agent's view without an agent.

Used by ``gpuctl status`` with no config (as nvidia-smi and nvitop do), by hosts
configured without an agent, and by the agent itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpuctl.adapters import procinfo
from gpuctl.adapters.pipeline import own_pipeline
from gpuctl.core.snapshot import ProbeReading, Snapshot, snapshot_from_reading
from gpuctl.core.timestamps import iso_utc


def build_snapshot(
    reading: ProbeReading,
    keywords: Sequence[str] | None,
    *,
    state_dir: str | None = None,
    gpu_memory_mib: int | None = None,
    pids: Sequence[int] = (),
) -> Snapshot:
    """Add host identity and the ``starting`` list (processes that match a service but hold
    no GPU memory yet: a server still loading) to a probe reading.

    ``keywords`` None means "not asked": the snapshot carries no ``starting`` list.
    ``pids`` are servers the records name: listed under ``starting`` when alive and not
    on the GPU, whatever their command line.
    """
    starting = None
    if keywords is not None:
        on_gpu = {p.pid for p in reading.processes}
        # Our own pipeline (`gpuctl status | cat | grep vllm`) is not a server.
        found = [
            s
            for s in procinfo.find_matching(keywords, own_pipeline(), state_dir)
            if s.pid not in on_gpu
        ]
        seen = {s.pid for s in found} | on_gpu
        found += procinfo.describe_pids(p for p in pids if p not in seen)
        starting = tuple(found)
    return snapshot_from_reading(
        reading,
        taken_at=iso_utc(),
        starting=starting,
        host=procinfo.host_identity(),
        state_dir=state_dir,
        gpu_memory_mib=gpu_memory_mib,
    )


def local_snapshot(
    probe_name: str,
    keywords: Sequence[str],
    *,
    sim_dir: Path | None = None,
    gpu_memory_mib: int | None = None,
    pids: Sequence[int] = (),
    state_dir: str | None = None,
) -> Snapshot:
    """Probe once and build a snapshot; raises ``ProbeError`` / ``NoGpuFound``."""
    from gpuctl.adapters.probes.factory import make_probe

    probe = make_probe(probe_name, sim_dir=sim_dir, gpu_memory_mib=gpu_memory_mib)
    try:
        reading = probe.read()
    finally:
        probe.close()
    return build_snapshot(
        reading, keywords, state_dir=state_dir, gpu_memory_mib=gpu_memory_mib, pids=pids
    )
