"""What the NVML and ``nvidia-smi`` probes share: pid sanity, naming processes, and the
rule for a device without a memory figure of its own (unified memory)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from msgspec.structs import replace

from gpuctl.adapters import procinfo
from gpuctl.core.pids import PID_MAX
from gpuctl.core.snapshot import GpuDevice, GpuProcess

MIB = 2**20
# No GPU holds 16 TiB (the largest today, under 300 GiB): a figure beyond it is
# NVML_VALUE_NOT_AVAILABLE (2^64-1 bytes, "16 EiB") or garbage, and means unknown.
MAX_DEVICE_MIB = 2**24
# NVML's temperature and power are unsigned ints whose "not available" reads as
# 4294967295; a die beyond 200 °C or a board beyond 10 kW is no reading either.
MAX_TEMPERATURE_C = 200
MAX_POWER_W = 10_000


def valid_pid(pid: int) -> bool:
    """True for a pid the kernel could have issued (not 0, 0xFFFFFFFF or beyond the limit)."""
    # Every pid is below PID_MAX: anything else is garbage read through a mismatched
    # struct (nvitop #75: [1184, 0, 4294967295, ...]).
    return 0 < pid < PID_MAX


def larger(a: int | None, b: int | None) -> int | None:
    """The larger of two memory figures, None counting as unknown (not as zero)."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def describe_processes(
    merged: Mapping[tuple[int, int], int | None],
    sm_util: Mapping[tuple[int, int], int] | None = None,
    mig: Mapping[tuple[int, int], int] | None = None,
) -> tuple[GpuProcess, ...]:
    """``{(gpu, pid): memory_mib}`` as GpuProcess entries with command, user and container
    (a pid whose command cannot be read stays, with ``command`` None); ``mig``: the MIG
    instance each runs in, where MIG is on."""
    util = sm_util or {}
    instance = mig or {}
    return tuple(
        GpuProcess(
            pid=pid,
            command=procinfo.command_of(pid),
            memory_mib=mem,
            user=procinfo.user_of(pid),
            container=procinfo.container_of(pid),
            gpu=gpu,
            sm_util_pct=util.get((gpu, pid)),
            mig=instance.get((gpu, pid)),
        )
        for (gpu, pid), mem in sorted(merged.items())
    )


def unified_total(gpu_memory_mib: int | None) -> tuple[int, str]:
    """The total of a device without a memory figure (GB10 unified memory), and a note:
    the configured GPU memory, else this host's MemTotal."""
    if gpu_memory_mib is not None:
        return gpu_memory_mib, "unified memory: total from the configured GPU memory"
    import psutil

    return psutil.virtual_memory().total // MIB, "unified memory: total is this host's MemTotal"


def memory_problem(used_mib: int, total_mib: int) -> str | None:
    """Why a device's (used, total) is no reading, or None when it is one.

    A total of 0 from a device that answered is not unified memory (GB10 answers "Not
    Supported"): it is a figure the driver could not give, and taking it for unified
    memory would count the host's MemTotal as free GPU memory.
    """
    if total_mib >= MAX_DEVICE_MIB or used_mib >= MAX_DEVICE_MIB:
        return 'the driver gave no memory figure ("not available")'
    if total_mib == 0:
        return "the driver gave a total memory of 0"
    if used_mib > total_mib:
        return f"the driver gave more memory used ({used_mib} MiB) than there is ({total_mib} MiB)"
    return None


def within(value: Any, high: float) -> Any:
    """A figure for the view (temperature, power) in [0, high], else None: a sentinel
    or garbage is unknown, never shown as a reading."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= high:
        return value
    return None


def unified_device(
    device: GpuDevice, processes: Sequence[GpuProcess], gpu_memory_mib: int | None
) -> tuple[GpuDevice, str]:
    """``device`` as a unified one: "used" is what its processes hold (not host
    RAM use, which counts the OS as GPU use, nvtop #511).

    On unified memory that sum is the only "used" there is, so a process whose memory
    the driver cannot tell makes the device's free memory unknown: the device comes back
    with ``error`` set (nothing may be decided on it), not with that process counted as 0.
    """
    total, note = unified_total(gpu_memory_mib)
    mine = [p for p in processes if p.gpu == device.index]
    base = GpuDevice(
        index=device.index,
        memory_total_mib=total,
        unified=True,
        name=device.name,
        uuid=device.uuid,
        utilization_pct=device.utilization_pct,
        temperature_c=device.temperature_c,
        power_w=device.power_w,
    )
    unknown = [p.pid for p in mine if p.memory_mib is None]
    if unknown:
        pids = ", ".join(str(pid) for pid in unknown[:3])
        why = (
            f"unified memory: the driver does not say how much pid {pids} holds, "
            "so its free memory is unknown"
        )
        return replace(base, error=why), f"GPU {device.index}: {note}"
    used = sum(p.memory_mib or 0 for p in mine)
    return replace(base, memory_used_mib=used), f"GPU {device.index}: {note}"


def percent(value: Any) -> int | None:
    """A percentage NVML gave, or None; out of range is garbage, not 100."""
    if isinstance(value, int) and 0 <= value <= 100:
        return value
    return None


def text_of(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
