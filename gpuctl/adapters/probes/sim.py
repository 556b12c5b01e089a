"""The ``sim`` probe: reads the simulated GPU the way the NVML probe reads a real one.

It lives with the other probes, not in ``gpuctl.sim``: it names processes through
``procinfo`` (psutil), which the standard-library-only sim must not import.
"""

from __future__ import annotations

from pathlib import Path

from gpuctl.adapters import procinfo
from gpuctl.core.model import GpuProcess, ProbeReading
from gpuctl.errors import ConfigError, ProbeError
from gpuctl.sim.gpu import ClaimInfo, SimError, SimGpu


class SimProbe:
    """One ``GpuProcess`` per live claim holding memory, with its real pid and command line.

    Args:
        sim_dir: the sim directory (default: ``$GPUCTL_SIM_DIR``, else the user state dir).
        total_mib: the total memory (default: ``$GPUCTL_SIM_GPU_MEMORY``, else the
            directory's ``gpu.json``, else 128 GiB).
    """

    name = "sim"

    def __init__(self, sim_dir: Path | None = None, total_mib: int | None = None) -> None:
        try:
            self.gpu = SimGpu(sim_dir, total_mib)
        except SimError as err:  # a bad $GPUCTL_SIM_GPU_MEMORY or total
            raise ConfigError(err.message, err.hint) from err

    def read(self) -> ProbeReading:
        """List the claims: a directory listing, a few small JSON files, one flock try each.

        Raises:
            ProbeError: the sim directory exists but cannot be read (never "idle" then).
        """
        try:
            claims = self.gpu.claims()
            total = self.gpu.total_mib
        except OSError as err:
            raise ProbeError(
                f"cannot read the simulated GPU at {self.gpu.sim_dir}: {err.strerror or err}",
                hint="check the directory's permissions, or pass another --sim-dir",
            ) from err
        # Like NVML, one entry per process: a process with several claims shows their sum.
        by_pid: dict[int, list[ClaimInfo]] = {}
        for claim in claims:
            if claim.memory_mib > 0:
                by_pid.setdefault(claim.pid, []).append(claim)
        processes = tuple(
            GpuProcess(
                pid=pid,
                command=procinfo.command_of(pid),
                memory_mib=sum(c.memory_mib for c in group),
                user=procinfo.user_of(pid),
                container=procinfo.container_of(pid),
                gpu=group[0].gpu,
            )
            for pid, group in sorted(by_pid.items())
        )
        return ProbeReading(
            probe=self.name,
            processes=processes,
            memory_used_mib=sum(p.memory_mib or 0 for p in processes),
            memory_total_mib=total,
            unified_memory=False,
            gpus=1,
        )

    def close(self) -> None:
        """Nothing to close: every read opens and closes its own files."""
