"""The NVML probe (``nvidia-ml-py``, imported as ``pynvml``): per-GPU, per-process memory.

NVML quirks this module works around (as gpustat, nvitop and nvtop met them):

* GB10 / DGX Spark unified memory: ``nvmlDeviceGetMemoryInfo`` (v1 and v2) answers
  ``NOT_SUPPORTED`` with total = 0, while per-process memory still works. That device
  (and only that device) is unified: its total comes from the config or MemTotal and
  its "used" is the sum of its processes (host RAM use would count the OS as GPU use,
  nvtop #511); a process there whose memory NVML cannot tell makes that sum, and so
  the device, unknown.
* Sentinels: a device that answers total 0 (not NOT_SUPPORTED), a total or used of
  ``NVML_VALUE_NOT_AVAILABLE`` (2^64-1 bytes), used beyond total: that GPU's memory is
  unknown (the GPU is reported with ``error``), never 16 EiB free and never unified.
  A temperature or power of 0xFFFFFFFF (or beyond any real board) is unknown.
* ``_v3`` vs ``_v2`` process structs (driver 535.43): the struct is chosen by the
  functions the driver exports, as nvitop does (``nvml_procs``); a list that still reads
  garbage pids is read again through ``_v2``.
* Memory-info v1 miscounts used memory on drivers >= 510 (gpustat #141): v2 first.
* MIG: with MIG on, memory is each instance's (``nvmlDeviceGetMigDeviceHandleByIndex``
  up to ``nvmlDeviceGetMaxMigDeviceCount``, as nvitop selects them), and so are the
  process lists; the device carries its instances and each process its instance, and a
  service fits on one instance, not on the parent's free memory.
* ``usedGpuMemory`` is None where NVML cannot tell (WDDM, some MIG setups); 0 stays 0.
  The device's used memory that no process accounts for is counted by the decision.
* One bad GPU (lost, no permission, process list unsupported) is reported as that GPU
  unknown, the others as they are; only when no GPU can be read does ``read`` fail.
* Any persistent NVML error makes the next read start NVML over (a lost GPU's handle,
  a driver reloaded under us, a stale handle after a reset).
* A pid in another PID namespace has no readable command: it stays, with its memory.

``pynvml`` is imported on first use only, so importing gpuctl never needs the driver.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from gpuctl.adapters.probes.common import (
    MAX_POWER_W,
    MAX_TEMPERATURE_C,
    MIB,
    describe_processes,
    larger,
    memory_problem,
    percent,
    text_of,
    unified_device,
    valid_pid,
    within,
)
from gpuctl.adapters.probes.nvml_procs import (
    ProcessCall,
    ProcessInfoV2,
    choose_process_call,
    running_processes,
)
from gpuctl.core.snapshot import GpuDevice, MigInstance, ProbeReading
from gpuctl.errors import NoGpuFound, ProbeError

# NVML keeps one process list per kind; MPS exists only on newer drivers and bindings.
_PROCESS_LISTS = ("Compute", "Graphics", "MPSCompute")
_NO_GPU_HINT = (
    "install the NVIDIA driver; or try `gpuctl demo`, or `--probe sim` for a simulated GPU"
)
_MISMATCH_HINT = "nvidia-ml-py may not match the driver: pip install -U 'nvidia-ml-py>=12.535.108'"
_CONTAINER_HINT = "in a container: --pid=host (and NVIDIA_MIG_MONITOR_DEVICES=all on MIG)"
_LOST_HINT = "it fell off the bus: see `dmesg` for Xid errors; it needs a reset or reboot"


class NvmlMismatch(ProbeError):
    """The binding and the driver disagree: a function NVML needs is missing, or every
    pid it lists is garbage. ``probe = "auto"`` falls back to ``nvidia-smi`` on this."""


class _DeviceError(Exception):
    """One GPU's read failed at ``step``."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.error = error


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


class NvmlProbe:
    """Reads every NVIDIA GPU of this host through NVML.

    NVML is initialised once, on the first ``read`` (or ``open``), and the device
    handles are kept; ``close`` shuts it down. Safe to call from several threads.

    Args:
        gpu_memory_mib: the memory total to report for a device that has no figure of
            its own (unified memory); None means MemTotal of this host.
    """

    name = "nvml"

    def __init__(self, gpu_memory_mib: int | None = None) -> None:
        self._gpu_memory_mib = gpu_memory_mib
        self._nv: Any = None
        self._handles: list[Any] = []
        self._call: ProcessCall | None = None
        self._mem_v2: bool | None = None  # None: not tried yet
        self._v2_only: set[str] = set()  # lists whose chosen call read garbage; _v2 did not
        self._stale = False  # a persistent error: start NVML over on the next read
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
        """Read memory, processes and utilisation of every GPU.

        Raises:
            NoGpuFound: no NVML library, driver or GPU.
            NvmlMismatch: the binding does not fit the driver.
            ProbeError: no GPU could be read. A failed read never comes back as an
                empty (idle) process list; one bad GPU among good ones comes back as
                that GPU with ``error`` set.
        """
        with self._lock:
            if self._stale:
                self._shutdown()
            nv = self._init()
            devices: list[GpuDevice] = []
            merged: dict[tuple[int, int], int | None] = {}
            sm_util: dict[tuple[int, int], int] = {}
            mig_of: dict[tuple[int, int], int] = {}
            notes: list[str] = []
            failures: list[ProbeError] = []
            for idx, handle in enumerate(self._handles):
                try:
                    if isinstance(handle, _DeviceError):
                        raise handle
                    device = self._device(
                        nv, handle, idx, merged=merged, sm_util=sm_util, mig_of=mig_of, notes=notes
                    )
                except _DeviceError as e:
                    err = self._error(nv, e.error, idx, e.step)
                    if isinstance(err, NvmlMismatch):
                        self._stale = True
                        raise err from e.error
                    failures.append(err)
                    devices.append(GpuDevice(idx, error=err.message))
                    if err.hint and err.hint not in notes:
                        notes.append(err.hint)
                    continue
                devices.append(device)
            if failures and len(failures) == len(devices):
                raise failures[0]
            processes = describe_processes(merged, sm_util, mig_of)
            for i, d in enumerate(devices):
                if d.readable and d.memory_total_mib is None:
                    devices[i], note = unified_device(d, processes, self._gpu_memory_mib)
                    notes.append(note)
            if self._v2_only:
                notes.append("process lists read through the _v2 call (_v3 mismatched)")
            return ProbeReading.of_devices(self.name, processes, devices, notes)

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
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise self._error(pynvml, e, 0, "device count") from e
        for idx in range(count):
            try:
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(idx))
            except pynvml.NVMLError as e:
                # A GPU that fell off the bus has no handle: that GPU is unknown, the
                # others are read (and the next read tries it again).
                handles.append(_DeviceError("device handle", e))
        if handles and all(isinstance(h, _DeviceError) for h in handles):
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            first = handles[0]
            raise self._error(pynvml, first.error, 0, first.step) from first.error
        if not handles:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise NoGpuFound("NVML sees no GPU on this machine", hint=_NO_GPU_HINT)
        try:
            call = choose_process_call(pynvml)
        except RuntimeError as e:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise NvmlMismatch(f"cannot read NVML's process lists here: {e}") from e
        self._nv, self._handles, self._call, self._stale = pynvml, handles, call, False
        return pynvml

    def _shutdown(self) -> None:
        nv, self._nv, self._handles, self._stale = self._nv, None, [], False
        if nv is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlShutdown()

    def _error(self, nv: Any, e: BaseException, idx: int, step: str) -> ProbeError:
        """The user's words for an NVML error; a persistent one marks NVML for a restart."""
        if isinstance(e, ProbeError):
            return e
        code = _code(e)
        if code != nv.NVML_ERROR_TIMEOUT:
            # A lost GPU's handle stays dead, a reset GPU's handle is stale, a reloaded
            # driver needs a new init: start over on the next read, which re-enumerates.
            self._stale = True
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            return ProbeError(f"GPU {idx} is lost (NVML: {e})", hint=_LOST_HINT)
        if code == nv.NVML_ERROR_NO_PERMISSION:
            return ProbeError(f"NVML refused to read the {step} of GPU {idx}: {e}", _CONTAINER_HINT)
        if code == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
            return NvmlMismatch(f"NVML could not read the {step} of GPU {idx}: {e}", _MISMATCH_HINT)
        return ProbeError(f"NVML could not read the {step} of GPU {idx}: {e}")

    def _device(
        self,
        nv: Any,
        handle: Any,
        idx: int,
        *,
        merged: dict[tuple[int, int], int | None],
        sm_util: dict[tuple[int, int], int],
        mig_of: dict[tuple[int, int], int],
        notes: list[str],
    ) -> GpuDevice:
        """One GPU's figures; its processes go into ``merged`` (and ``sm_util``, and
        ``mig_of`` with MIG on).

        Raises:
            _DeviceError: memory, a MIG instance or a process list could not be read.
        """
        try:
            memory = self._memory(nv, handle)
        except nv.NVMLError as e:
            raise _DeviceError("memory info", e) from e
        problem = memory_problem(*memory) if memory else None
        if problem:
            err = ProbeError(f"GPU {idx}'s memory is unknown: {problem}")
            raise _DeviceError("memory info", err)
        found: dict[tuple[int, int], int | None] = {}
        for kind in _PROCESS_LISTS:
            try:
                listed = self._processes(nv, handle, kind, idx, notes)
            except nv.NVMLError as e:
                raise _DeviceError(f"{kind.lower()} process list", e) from e
            except ProbeError as e:
                raise _DeviceError(f"{kind.lower()} process list", e) from e
            for pid, mem in listed:
                key = (idx, pid)
                found[key] = larger(found[key], mem) if key in found else mem
        instances = self._mig(nv, handle, idx, found=found, mig_of=mig_of, notes=notes)
        merged.update(found)
        sm_util.update(self._process_utilisation(nv, handle, idx))
        util = self._optional(nv, lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        temp = self._optional(
            nv, lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
        )
        power_mw = self._optional(nv, lambda: nv.nvmlDeviceGetPowerUsage(handle))
        return GpuDevice(
            index=idx,
            memory_used_mib=memory[0] if memory else None,
            memory_total_mib=memory[1] if memory else None,
            name=text_of(self._optional(nv, lambda: nv.nvmlDeviceGetName(handle))),
            uuid=text_of(self._optional(nv, lambda: nv.nvmlDeviceGetUUID(handle))),
            utilization_pct=percent(util),
            temperature_c=within(temp, MAX_TEMPERATURE_C),
            power_w=round(power_mw / 1000, 1)
            if within(power_mw, MAX_POWER_W * 1000) is not None
            else None,
            mig=instances,
        )

    def _mig(
        self,
        nv: Any,
        handle: Any,
        idx: int,
        *,
        found: dict[tuple[int, int], int | None],
        mig_of: dict[tuple[int, int], int],
        notes: list[str],
    ) -> tuple[MigInstance, ...]:
        """The MIG instances of a GPU with MIG on (none with it off), as nvitop selects
        them: the mode, then each MIG device handle up to the maximum count, its memory
        and its own process lists (the parent's lists may not show them). A process
        sees only its instance's memory, so each instance is admitted on its own.

        Raises:
            _DeviceError: the mode or an instance could not be read.
        """
        try:
            current = nv.nvmlDeviceGetMigMode(handle)[0]
        except nv.NVMLError as e:
            if _code(e) in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                return ()  # a board (or a driver) without MIG
            raise _DeviceError("MIG mode", e) from e
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            return ()
        out: list[MigInstance] = []
        try:
            count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nv.NVMLError as e:
            raise _DeviceError("MIG device count", e) from e
        for slot in range(count):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nv.NVMLError as e:
                if _code(e) == nv.NVML_ERROR_NOT_FOUND:
                    continue  # no instance in this slot
                raise _DeviceError("MIG device handle", e) from e
            try:
                gi = int(nv.nvmlDeviceGetGpuInstanceId(mig))
                memory = self._memory(nv, mig)
            except nv.NVMLError as e:
                raise _DeviceError("MIG instance memory", e) from e
            problem = memory_problem(*memory) if memory else "the driver gave no memory figure"
            if problem:
                err = ProbeError(f"GPU {idx}'s MIG instance {gi} memory is unknown: {problem}")
                raise _DeviceError("MIG instance memory", err)
            assert memory is not None
            for kind in _PROCESS_LISTS:
                try:
                    listed = self._processes(nv, mig, kind, idx, notes)
                except (nv.NVMLError, ProbeError) as e:
                    raise _DeviceError(f"MIG instance {gi} {kind.lower()} process list", e) from e
                for pid, mem in listed:
                    key = (idx, pid)
                    found[key] = larger(found[key], mem) if key in found else mem
                    mig_of[key] = gi
            uuid = text_of(self._optional(nv, lambda h=mig: nv.nvmlDeviceGetUUID(h)))
            out.append(MigInstance(gi, memory[0], memory[1], uuid))
        if not out:
            # MIG on and no instance: nothing can run there, and its whole memory is not
            # free for anyone.
            err = ProbeError(f"GPU {idx} has MIG on and no MIG instance: nothing can run on it")
            raise _DeviceError("MIG instances", err)
        return tuple(out)

    @staticmethod
    def _optional(nv: Any, fn: Any) -> Any:
        """A figure the view shows but no decision needs: unknown (None) when NVML says
        no (MIG answers NOT_SUPPORTED for utilisation), never 0."""
        try:
            return fn()
        except nv.NVMLError:
            return None

    def _process_utilisation(self, nv: Any, handle: Any, idx: int) -> dict[tuple[int, int], int]:
        """SM utilisation per pid over the last second, as nvitop asks for it (now - 1 s:
        without a recent ``lastSeenTimeStamp`` the samples lag, nvtop #91). A process
        without a sample stays unknown."""
        since_us = int((time.time() - 1.0) * 1_000_000)
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(handle, since_us)
        except nv.NVMLError:
            return {}  # NOT_FOUND (no sample), NOT_SUPPORTED (MIG): unknown
        out: dict[tuple[int, int], int] = {}
        for s in samples:
            pid, sm = int(s.pid), percent(s.smUtil)
            if valid_pid(pid) and sm is not None:
                out[(idx, pid)] = max(out.get((idx, pid), 0), sm)
        return out

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
        return int(mem.used) // MIB, int(mem.total) // MIB

    def _processes(
        self, nv: Any, handle: Any, kind: str, idx: int, notes: list[str]
    ) -> list[tuple[int, int | None]]:
        """(pid, MiB) of one NVML process list, garbage pids dropped.

        Raises:
            NvmlMismatch: every pid listed is garbage (something holds the GPU, and we
                cannot tell what: that is not "idle").
        """
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
        out = [(pid, None if used is None else used // MIB) for pid, used in raw if valid_pid(pid)]
        if raw and not out:
            raise NvmlMismatch(
                f"NVML listed {len(raw)} {kind.lower()} process(es) on GPU {idx}, "
                "all with invalid pids",
                hint=_MISMATCH_HINT,
            )
        if len(out) < len(raw):
            notes.append(f"GPU {idx}: dropped {len(raw) - len(out)} invalid pid(s) from NVML")
        return out

    def _process_list(self, nv: Any, handle: Any, kind: str) -> list[tuple[int, int | None]]:
        """One process list through the call chosen for this driver; when it still reads
        garbage pids (a driver that nvitop's rule misjudges), through ``_v2`` instead,
        which has had one struct layout everywhere."""
        call = self._call
        assert call is not None
        v2 = ProcessCall("_v2", ProcessInfoV2)
        if kind in self._v2_only:
            return running_processes(nv, handle, kind, v2)
        first = running_processes(nv, handle, kind, call)
        if call.suffix != "_v3" or all(valid_pid(pid) for pid, _ in first):
            return first
        try:
            second = running_processes(nv, handle, kind, v2)
        except nv.NVMLError as e:
            if _code(e) != nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            return first  # no _v2 either: keep what _v3 gave, its garbage pids get dropped
        if all(valid_pid(pid) for pid, _ in second):
            self._v2_only.add(kind)
            return second
        return first
