"""The ``sim`` probe: reads the simulated GPU the way the NVML probe reads a real one.

It lives with the other probes, not in ``gpuctl.sim``: it names processes through
``procinfo`` (psutil), which the standard-library-only sim must not import.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpuctl.adapters import procinfo
from gpuctl.core.snapshot import GpuDevice, GpuProcess, ProbeReading
from gpuctl.errors import ConfigError, ProbeError
from gpuctl.sim.gpu import ClaimInfo, SimError, SimGpu


class SimProbe:
    """One ``GpuProcess`` per live claim holding memory, with its real pid and command line,
    and one ``GpuDevice`` per simulated GPU with its own total.

    Args:
        sim_dir: the sim directory (default: ``$GPUCTL_SIM_DIR``, else the user state dir).
        total_mib: one GPU of this total (default: ``$GPUCTL_SIM_GPUS`` or
            ``$GPUCTL_SIM_GPU_MEMORY``), used only while the directory has no ``gpu.json``.
            A read never changes the simulated hardware: where ``gpu.json`` names the
            GPUs (as ``gpuctl sim`` wrote them), they are read, and a total that
            disagrees is a note of the reading.
        required: the directory was named (``agent --sim-dir``): it must exist, now and
            at every read. A missing one is a typo or a folder removed under us, and
            reading it as an empty GPU would call the GPU free without knowing.
            Without it, a default directory not created yet is an empty simulated GPU.

    Raises:
        ConfigError: a bad total.
        ProbeError: ``required`` and the directory is not there.
    """

    name = "sim"

    def __init__(
        self, sim_dir: Path | None = None, total_mib: int | None = None, *, required: bool = False
    ) -> None:
        try:
            self.gpu = SimGpu(sim_dir, total_mib, define=False)
        except SimError as err:  # a bad $GPUCTL_SIM_GPU_MEMORY or total
            raise ConfigError(err.message, err.hint) from err
        self.required = required
        self._check_there()
        mismatch = self.gpu.totals_mismatch()
        if mismatch:
            logging.getLogger("gpuctl.probe").warning("warning: %s", mismatch)

    def read(self) -> ProbeReading:
        """List the claims: a directory listing, a few small JSON files, one flock try each.

        Raises:
            ProbeError: the sim directory exists but cannot be read, or it is required and
                missing (never "idle" then).
        """
        self._check_there()
        try:
            claims = self.gpu.claims()
            totals = self.gpu.totals_mib
        except OSError as err:
            raise ProbeError(
                f"cannot read the simulated GPU at {self.gpu.sim_dir}: {err.strerror or err}",
                hint="check the directory's permissions, or pass another --sim-dir",
            ) from err
        # Like NVML, one entry per process and GPU: several claims show as their sum.
        by_key: dict[tuple[int, int], list[ClaimInfo]] = {}
        for claim in claims:
            if claim.memory_mib > 0:
                by_key.setdefault((claim.gpu, claim.pid), []).append(claim)
        processes = tuple(
            GpuProcess(
                pid=pid,
                command=procinfo.command_of(pid),
                memory_mib=sum(c.memory_mib for c in group),
                user=procinfo.user_of(pid),
                container=procinfo.container_of(pid),
                gpu=gpu,
                sm_util_pct=min(100, sum(c.util_pct for c in group)),
            )
            for (gpu, pid), group in sorted(by_key.items())
        )
        devices = tuple(
            GpuDevice(
                index=i,
                memory_used_mib=sum(p.memory_mib or 0 for p in processes if p.gpu == i),
                memory_total_mib=total,
                name="gpuctl simulated GPU",
                uuid=f"GPU-sim-{i}",
                # The sim knows every process's share: the GPU is as busy as their sum.
                utilization_pct=min(100, sum(p.sm_util_pct or 0 for p in processes if p.gpu == i)),
            )
            for i, total in enumerate(totals)
        )
        stray = [p for p in processes if p.gpu >= len(devices)]
        notes = [f"pid {p.pid} claims GPU {p.gpu}, which the sim does not have" for p in stray]
        mismatch = self.gpu.totals_mismatch()
        if mismatch:
            notes.append(mismatch)
        return ProbeReading.of_devices(self.name, processes, devices, notes)

    def _check_there(self) -> None:
        if self.required and not self.gpu.sim_dir.is_dir():
            d = self.gpu.sim_dir
            raise ProbeError(
                f"the simulated GPU's folder {d} does not exist (--sim-dir)",
                hint=f"check the path; for an empty simulated GPU there: mkdir -p {d}",
            )

    def close(self) -> None:
        """Nothing to close: every read opens and closes its own files."""
