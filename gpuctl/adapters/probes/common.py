"""What the NVML and ``nvidia-smi`` probes share: pid sanity, naming processes, and the
rule for a device without a memory figure of its own (unified memory)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuctl.adapters import procinfo
from gpuctl.core.model import GpuDevice, GpuProcess

MIB = 2**20
# PID_MAX_LIMIT on 64-bit Linux: a pid is always below it, so anything else is garbage
# read through a mismatched struct (nvitop #75: [1184, 0, 4294967295, ...]).
PID_LIMIT = 4_194_304


def valid_pid(pid: int) -> bool:
    """True for a pid the kernel could have issued (not 0, 0xFFFFFFFF or beyond the limit)."""
    return 0 < pid < PID_LIMIT


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
) -> tuple[GpuProcess, ...]:
    """``{(gpu, pid): memory_mib}`` as GpuProcess entries with command, user and container
    (a pid whose command cannot be read stays, with ``command`` None)."""
    util = sm_util or {}
    return tuple(
        GpuProcess(
            pid=pid,
            command=procinfo.command_of(pid),
            memory_mib=mem,
            user=procinfo.user_of(pid),
            container=procinfo.container_of(pid),
            gpu=gpu,
            sm_util_pct=util.get((gpu, pid)),
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


def unified_device(
    device: GpuDevice, processes: Sequence[GpuProcess], gpu_memory_mib: int | None
) -> tuple[GpuDevice, str]:
    """``device`` as a unified one: "used" is what its processes hold (not host
    RAM use, which counts the OS as GPU use, nvtop #511)."""
    total, note = unified_total(gpu_memory_mib)
    used = sum(p.memory_mib or 0 for p in processes if p.gpu == device.index)
    return (
        GpuDevice(
            index=device.index,
            memory_used_mib=used,
            memory_total_mib=total,
            unified=True,
            name=device.name,
            uuid=device.uuid,
            utilization_pct=device.utilization_pct,
            temperature_c=device.temperature_c,
            power_w=device.power_w,
        ),
        f"GPU {device.index}: {note}",
    )


def percent(value: Any) -> int | None:
    """A percentage NVML gave, or None; out of range is garbage, not 100."""
    if isinstance(value, int) and 0 <= value <= 100:
        return value
    return None


def text_of(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
