"""The NVML probe (``nvidia-ml-py``, imported as ``pynvml``): per-process GPU memory.

NVML quirks this module works around (as gpustat, nvitop and nvtop met them):

* GB10 / DGX Spark unified memory: ``nvmlDeviceGetMemoryInfo`` (v1 and v2) answers
  ``NOT_SUPPORTED`` with total = 0, while per-process memory still works. The device
  figure is then unknown; the total comes from the config or MemTotal and "used" is
  the sum of the processes (host RAM use would count the OS as GPU use, nvtop #511).
* ``_v3`` vs ``_v2`` process structs: driver 535.43 grew the v3 struct without a version
  bump, so a binding and a driver that disagree read garbage pids (``0``,
  ``0xFFFFFFFF``); drivers < 510.39 have no ``_v3`` symbol at all. We fall back to the
  ``_v2`` call, which has one struct layout everywhere.
* Memory-info v1 miscounts used memory on drivers >= 510 (gpustat #141): v2 first.
* ``usedGpuMemory`` is None where NVML cannot tell (WDDM, some MIG setups); 0 stays 0.
* A pid in another PID namespace has no readable command: it stays, with its memory.

``pynvml`` is imported on first use only, so importing gpuctl never needs the driver.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import psutil

from gpuctl.adapters import procinfo
from gpuctl.core.model import GpuProcess, ProbeReading
from gpuctl.errors import NoGpuFound, ProbeError

MIB = 2**20
# PID_MAX_LIMIT on 64-bit Linux: a pid is always below it, so anything else is garbage
# read through a mismatched struct (nvitop #75: [1184, 0, 4294967295, ...]).
PID_LIMIT = 4_194_304
_ULLONG_MAX = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE, should a binding not map it to None
# NVML keeps one process list per kind; MPS exists only on newer drivers and bindings.
_PROCESS_LISTS = ("Compute", "Graphics", "MPSCompute")
_NO_GPU_HINT = (
    "install the NVIDIA driver; or try `gpuctl demo`, or `--probe sim` for a simulated GPU"
)
_MISMATCH_HINT = "nvidia-ml-py may not match the driver: pip install -U 'nvidia-ml-py>=12.535.108'"


def valid_pid(pid: int) -> bool:
    """True for a pid the kernel could have issued (not 0, 0xFFFFFFFF or beyond the limit)."""
    return 0 < pid < PID_LIMIT


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


class NvmlProbe:
    """Reads every NVIDIA GPU of this host through NVML.

    NVML is initialised once, on the first ``read`` (or ``open``), and the device
    handles are kept; ``close`` shuts it down. Safe to call from several threads.

    Args:
        gpu_memory_mib: the memory total to report where the device has no figure of
            its own (unified memory); None means MemTotal of this host.
    """

    name = "nvml"

    def __init__(self, gpu_memory_mib: int | None = None) -> None:
        self._gpu_memory_mib = gpu_memory_mib
        self._nv: Any = None
        self._handles: list[Any] = []
        self._mem_v2: bool | None = None  # None: not tried yet
        self._v2_only: set[str] = set()  # process-list kinds whose _v3 call proved unusable
        self._lock = threading.Lock()

    def open(self) -> None:
        """Initialise NVML now (``read`` does it on first use).

        Raises:
            NoGpuFound: no NVML library, no driver, or no GPU.
            ProbeError: NVML is there but failed.
        """
        with self._lock:
            self._init()

    def close(self) -> None:
        """Shut NVML down; a later ``read`` initialises it again."""
        with self._lock:
            self._shutdown()

    def read(self) -> ProbeReading:
        """Read memory and processes of every GPU.

        Raises:
            NoGpuFound: no NVML library, driver or GPU.
            ProbeError: a GPU could not be read (lost, no permission, ...). A failed read
                never comes back as an empty (idle) process list.
        """
        with self._lock:
            nv = self._init()
            device_mem: list[tuple[int, int] | None] = []
            merged: dict[tuple[int, int], int | None] = {}
            notes: list[str] = []
            for idx, handle in enumerate(self._handles):
                step = "memory info"
                try:
                    device_mem.append(self._memory(nv, handle))
                    for kind in _PROCESS_LISTS:
                        step = f"{kind.lower()} process list"
                        for pid, mem in self._processes(nv, handle, kind, idx, notes):
                            key = (idx, pid)
                            merged[key] = larger(merged[key], mem) if key in merged else mem
                except nv.NVMLError as e:
                    raise self._error(nv, e, idx, step) from e
            processes = describe_processes(merged)
            if self._v2_only:
                notes.append("process lists read through the _v2 call (_v3 missing or mismatched)")
            used, total, unified, note = combine_memory(device_mem, processes, self._gpu_memory_mib)
            return ProbeReading(
                probe=self.name,
                processes=processes,
                memory_used_mib=used,
                memory_total_mib=total,
                unified_memory=unified,
                gpus=len(device_mem),
                notes=(*notes, note) if note else tuple(notes),
            )

    # --- NVML calls -----------------------------------------------------------------

    def _init(self) -> Any:
        if self._nv is not None:
            return self._nv
        try:
            import pynvml
        except ImportError as e:
            raise NoGpuFound("nvidia-ml-py is not installed", hint=_NO_GPU_HINT) from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            if _code(e) in (
                pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
            ):
                raise NoGpuFound(
                    f"no NVIDIA driver on this machine (NVML: {e})", _NO_GPU_HINT
                ) from e
            hint = (
                "the driver was upgraded without a reboot: reboot, or reload the nvidia modules"
                if _code(e) == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
                else "check that `nvidia-smi` works on this machine"
            )
            raise ProbeError(f"NVML failed to initialise: {e}", hint) from e
        handles: list[Any] = []
        try:
            for idx in range(pynvml.nvmlDeviceGetCount()):
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(idx))
        except pynvml.NVMLError as e:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise self._error(pynvml, e, len(handles), "device handle") from e
        if not handles:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise NoGpuFound("NVML sees no GPU on this machine", hint=_NO_GPU_HINT)
        self._nv, self._handles = pynvml, handles
        return pynvml

    def _shutdown(self) -> None:
        nv, self._nv, self._handles = self._nv, None, []
        if nv is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlShutdown()

    def _error(self, nv: Any, e: BaseException, idx: int, step: str) -> ProbeError:
        code = _code(e)
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            # Its handle stays dead: start over on the next read, which re-enumerates.
            self._shutdown()
            return ProbeError(
                f"GPU {idx} is lost (NVML: {e})",
                hint="it fell off the bus: see `dmesg` for Xid errors; it needs a reset or reboot",
            )
        if code == nv.NVML_ERROR_NO_PERMISSION:
            return ProbeError(
                f"NVML refused to read the {step} of GPU {idx}: {e}",
                hint="in a container: --pid=host (and NVIDIA_MIG_MONITOR_DEVICES=all on MIG)",
            )
        hint = _MISMATCH_HINT if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND else ""
        return ProbeError(f"NVML could not read the {step} of GPU {idx}: {e}", hint)

    def _memory(self, nv: Any, handle: Any) -> tuple[int, int] | None:
        """(used, total) MiB of one device, or None where it has no figure (unified memory)."""
        mem: Any = None
        if self._mem_v2 is not False and hasattr(nv, "nvmlMemory_v2"):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
                self._mem_v2 = True
            except TypeError:  # a binding whose call takes no version= (< 11.510.69)
                self._mem_v2 = False
            except nv.NVMLError as e:
                if _code(e) == nv.NVML_ERROR_FUNCTION_NOT_FOUND:  # driver < 510.39: no _v2
                    self._mem_v2 = False
                elif _code(e) != nv.NVML_ERROR_NOT_SUPPORTED:
                    raise
        if mem is None:
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
            except nv.NVMLError as e:
                if _code(e) == nv.NVML_ERROR_NOT_SUPPORTED:  # GB10: both versions refuse
                    return None
                raise
        if not mem.total:  # GB10 fills total = free = used = 0
            return None
        return int(mem.used) // MIB, int(mem.total) // MIB

    def _processes(
        self, nv: Any, handle: Any, kind: str, idx: int, notes: list[str]
    ) -> list[tuple[int, int | None]]:
        """(pid, MiB) of one NVML process list, garbage pids dropped."""
        try:
            raw = self._process_list(nv, handle, kind)
        except nv.NVMLError as e:
            code = _code(e)
            # MPS lists are optional (older drivers lack them); some compute-only boards
            # answer NOT_SUPPORTED for Graphics (a gpustat test case). Compute must work.
            if kind == "MPSCompute" and code in (
                nv.NVML_ERROR_FUNCTION_NOT_FOUND,
                nv.NVML_ERROR_NOT_SUPPORTED,
            ):
                return []
            if kind == "Graphics" and code == nv.NVML_ERROR_NOT_SUPPORTED:
                return []
            raise
        out = [(int(p.pid), _mib(p.usedGpuMemory)) for p in raw if valid_pid(int(p.pid))]
        if raw and not out:
            # Something holds the GPU, and we cannot tell what: that is not "idle".
            raise ProbeError(
                f"NVML listed {len(raw)} {kind.lower()} process(es) on GPU {idx}, "
                "all with invalid pids",
                hint=_MISMATCH_HINT,
            )
        if len(out) < len(raw):
            notes.append(f"GPU {idx}: dropped {len(raw) - len(out)} invalid pid(s) from NVML")
        return out

    def _process_list(self, nv: Any, handle: Any, kind: str) -> list[Any]:
        """One NVML process list, surviving the ``_v3``/``_v2`` struct mismatch.

        gpustat patches ``pynvml._nvmlGetFunctionPointer`` process-wide to answer the
        ``_v3`` symbol with the ``_v2`` one, and only on FunctionNotFound. Calling the
        binding's own ``_v2`` wrapper does the same without touching pynvml for anyone
        else, and also covers the 535.43 case where ``_v3`` exists but returns garbage.
        """
        base = f"nvmlDeviceGet{kind}RunningProcesses"
        first: list[Any] | None = None
        if kind not in self._v2_only:
            try:
                first = _versioned(nv, base, "_v3")(handle)
            except nv.NVMLError as e:
                if _code(e) != nv.NVML_ERROR_FUNCTION_NOT_FOUND:  # driver < 510.39: no _v3
                    raise
            if first is not None and all(valid_pid(int(p.pid)) for p in first):
                return first
        try:
            second: list[Any] = _versioned(nv, base, "_v2")(handle)
        except nv.NVMLError as e:
            if first is None or _code(e) != nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            return first  # no _v2 either: keep what _v3 gave, its garbage pids get dropped
        if all(valid_pid(int(p.pid)) for p in second):
            self._v2_only.add(kind)
        return second


def combine_memory(
    figures: Sequence[tuple[int, int] | None],
    processes: Sequence[GpuProcess],
    gpu_memory_mib: int | None,
) -> tuple[int, int, bool, str | None]:
    """The host's memory from per-device (used, total) MiB, None where a device has none.

    Returns:
        (used, total, unified, note). Where a device has no figure (GB10 unified memory)
        "used" is what the GPU processes hold (DESIGN §4: not host RAM use, which counts
        the OS as GPU use, nvtop #511) and the total is ``gpu_memory_mib``, else MemTotal.
    """
    known = [f for f in figures if f is not None]
    if known and len(known) == len(figures):
        return sum(u for u, _ in known), sum(t for _, t in known), False, None
    used = sum(p.memory_mib or 0 for p in processes)
    if gpu_memory_mib is not None:
        return used, gpu_memory_mib, True, "unified memory: total from the configured GPU memory"
    total = psutil.virtual_memory().total // MIB
    return used, total, True, "unified memory: total is this host's MemTotal"


def describe_processes(merged: dict[tuple[int, int], int | None]) -> tuple[GpuProcess, ...]:
    """``{(gpu, pid): memory_mib}`` as GpuProcess entries with command, user and container
    (a pid whose command cannot be read stays, with ``command`` None)."""
    return tuple(
        GpuProcess(
            pid=pid,
            command=procinfo.command_of(pid),
            memory_mib=mem,
            user=procinfo.user_of(pid),
            container=procinfo.container_of(pid),
            gpu=gpu,
        )
        for (gpu, pid), mem in sorted(merged.items())
    )


def larger(a: int | None, b: int | None) -> int | None:
    """The larger of two memory figures, None counting as unknown (not as zero)."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _versioned(nv: Any, base: str, suffix: str) -> Any:
    """The binding's ``base + suffix`` wrapper; a binding without it acts as a driver without it."""
    fn = getattr(nv, base + suffix, None)
    if fn is None:
        raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
    return fn


def _mib(used_bytes: int | None) -> int | None:
    if used_bytes is None or used_bytes >= _ULLONG_MAX:
        return None
    return int(used_bytes) // MIB
