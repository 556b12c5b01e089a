"""Choose a probe by name: ``nvml``, ``nvidia-smi``, ``sim`` or ``auto``."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from msgspec.structs import replace

from gpuctl.adapters.probes.base import Probe
from gpuctl.adapters.probes.nvidia_smi import NvidiaSmiProbe
from gpuctl.adapters.probes.nvml import NvmlMismatch, NvmlProbe
from gpuctl.config.values import PROBES
from gpuctl.core.snapshot import ProbeReading
from gpuctl.errors import NoGpuFound, ProbeError, UsageError

PROBE_NAMES = PROBES  # the one list lives with the config, which names a probe per host


def make_probe(
    name: str,
    *,
    sim_dir: Path | None = None,
    gpu_memory_mib: int | None = None,
    sim_required: bool = False,
) -> Probe:
    """Build the probe called ``name``.

    Args:
        name: ``nvml``, ``nvidia-smi``, ``sim``, or ``auto`` (NVML if it initialises,
            else ``nvidia-smi`` if it is on PATH; and ``nvidia-smi`` from the first NVML
            read that fails because the binding does not fit the driver).
        sim_dir: the simulated GPU's state directory (``sim`` only).
        sim_required: ``sim_dir`` was named and must exist (``SimProbe``'s ``required``).
        gpu_memory_mib: the total to report where the device has none (unified memory).

    Raises:
        UsageError: an unknown name.
        NoGpuFound: ``auto`` found neither NVML nor ``nvidia-smi``.
        ProbeError: ``auto`` found NVML broken and no ``nvidia-smi`` to fall back on.
    """
    if name == "nvml":
        return NvmlProbe(gpu_memory_mib)
    if name == "nvidia-smi":
        return NvidiaSmiProbe(gpu_memory_mib=gpu_memory_mib)
    if name == "sim":
        from gpuctl.adapters.probes.sim import SimProbe

        return SimProbe(sim_dir, gpu_memory_mib, required=sim_required)
    if name == "auto":
        return _auto(gpu_memory_mib)
    raise UsageError(f"unknown probe {name!r}", hint=f"use one of: {', '.join(PROBE_NAMES)}")


def _auto(gpu_memory_mib: int | None) -> Probe:
    nvml = NvmlProbe(gpu_memory_mib)
    try:
        nvml.open()
    except ProbeError as e:
        if shutil.which("nvidia-smi") is not None:
            return NvidiaSmiProbe(gpu_memory_mib=gpu_memory_mib)
        if not isinstance(e, NoGpuFound):
            raise  # NVML is there but broken: its own message says more than "no GPU"
        raise NoGpuFound(
            "no NVIDIA GPU found on this machine (no NVML library, no nvidia-smi)",
            hint="try `gpuctl demo`, or `--probe sim` for a simulated GPU",
        ) from e
    return AutoProbe(nvml, gpu_memory_mib)


class AutoProbe:
    """NVML, and ``nvidia-smi`` once NVML's reads fail on this driver.

    An old driver can load NVML and still lack what a read needs (a process-list
    function, a struct the binding expects): nvidia-smi ships with the driver and
    speaks its language. The switch is for good, and every reading says why.
    """

    def __init__(self, nvml: NvmlProbe, gpu_memory_mib: int | None) -> None:
        self._nvml = nvml
        self._gpu_memory_mib = gpu_memory_mib
        self._smi: NvidiaSmiProbe | None = None
        self._why = ""
        self._lock = threading.Lock()
        self.name = nvml.name

    def read(self) -> ProbeReading:
        """Raises what the probe in use raises (NVML's mismatch only without nvidia-smi)."""
        with self._lock:
            if self._smi is None:
                try:
                    return self._nvml.read()
                except NvmlMismatch as e:
                    if shutil.which("nvidia-smi") is None:
                        raise
                    self._nvml.close()
                    self._smi = NvidiaSmiProbe(gpu_memory_mib=self._gpu_memory_mib)
                    self._why = e.message
                    self.name = self._smi.name
            reading = self._smi.read()
        note = f"NVML failed on this driver ({self._why}): read through nvidia-smi"
        return replace(reading, notes=(*reading.notes, note))

    def close(self) -> None:
        self._nvml.close()
