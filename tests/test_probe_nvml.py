"""NvmlProbe against a stubbed pynvml, in the manner of gpustat's test_gpustat.py.

Two levels of fake:
* ``FakeNvml`` replaces the binding's Python functions (fake handles, fake process
  objects with pid/usedGpuMemory), for the probe's own logic;
* ``FakeDriver`` replaces the C symbols behind ``pynvml._nvmlGetFunctionPointer``, so the
  real binding runs its two-call protocol against a driver that lacks ``_v3`` (< 510.39)
  or fills a larger ``_v3`` struct than the binding expects (535.43).
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import pynvml
import pytest

from gpuctl.adapters.probes.nvml import NvmlProbe
from gpuctl.errors import NoGpuFound, ProbeError

MIB = 2**20
GIB = 2**30
NO_SUCH_PID = 4194000  # below PID_MAX_LIMIT, but no process has it on a test machine
BAD_PID = 0xFFFFFFFF
KINDS = ("Compute", "Graphics", "MPSCompute")


def proc(pid: int, used: int | None) -> Any:
    """A process entry as the binding returns it."""
    return pynvml.nvmlFriendlyObject(
        {
            "pid": pid,
            "usedGpuMemory": used,
            "gpuInstanceId": 0xFFFFFFFF,
            "computeInstanceId": 0xFFFFFFFF,
        }
    )


def err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class Device:
    """One fake GPU. ``lists`` maps ``Compute_v3`` etc. to entries or an NVML error code;
    a missing key means the driver lacks that function."""

    memory: tuple[int, int] | int = (0, 80 * GIB)  # (used, total) bytes, or an error code
    memory_v1: tuple[int, int] | int | None = None  # None: same as ``memory``
    lists: dict[str, list[Any] | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in KINDS:
            for v in ("_v3", "_v2"):
                self.lists.setdefault(kind + v, [])

    def both(self, kind: str, entries: list[Any] | int) -> Device:
        self.lists[kind + "_v3"] = entries
        self.lists[kind + "_v2"] = entries
        return self


class FakeNvml:
    """Replaces the pynvml calls NvmlProbe makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *devices: Device) -> None:
        self.devices = list(devices)
        self.calls: Counter[str] = Counter()
        self.init_error: int | None = None
        monkeypatch.setattr(pynvml, "nvmlInit", self._init)
        monkeypatch.setattr(pynvml, "nvmlShutdown", self._count("nvmlShutdown"))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(self.devices))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: ("handle", i))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self._memory)
        for kind in KINDS:
            for v in ("_v3", "_v2"):
                name = f"nvmlDeviceGet{kind}RunningProcesses{v}"
                monkeypatch.setattr(pynvml, name, self._lister(kind + v))

    def _count(self, name: str) -> Callable[[], None]:
        def fn() -> None:
            self.calls[name] += 1

        return fn

    def _init(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise err(self.init_error)

    def _memory(self, handle: tuple[str, int], version: int | None = None) -> Any:
        dev = self.devices[handle[1]]
        self.calls["memory_v2" if version else "memory_v1"] += 1
        spec = dev.memory if version or dev.memory_v1 is None else dev.memory_v1
        if isinstance(spec, int):
            raise err(spec)
        mem = pynvml.c_nvmlMemory_v2_t() if version else pynvml.c_nvmlMemory_t()
        mem.used, mem.total = spec
        mem.free = spec[1] - spec[0]
        return mem

    def _lister(self, key: str) -> Callable[[tuple[str, int]], list[Any]]:
        def fn(handle: tuple[str, int]) -> list[Any]:
            self.calls[key] += 1
            if key not in self.devices[handle[1]].lists:
                raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            entries = self.devices[handle[1]].lists[key]
            if isinstance(entries, int):
                raise err(entries)
            return list(entries)

        return fn


def by_pid(reading: Any) -> dict[int, Any]:
    return {p.pid: p for p in reading.processes}


# --- the probe's logic, through FakeNvml ------------------------------------------------


def test_h100_two_processes_and_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    dev = Device(memory=(19818 * MIB, 81559 * MIB)).both(
        "Compute", [proc(me, 15690 * MIB), proc(NO_SUCH_PID, 2566 * MIB + 12345)]
    )
    fake = FakeNvml(monkeypatch, dev)
    probe = NvmlProbe()
    r = probe.read()
    assert r.probe == "nvml"
    assert (r.memory_used_mib, r.memory_total_mib, r.unified_memory, r.gpus) == (
        19818,
        81559,
        False,
        1,
    )
    assert [(p.pid, p.memory_mib, p.gpu) for p in r.processes] == sorted(
        [(me, 15690, 0), (NO_SUCH_PID, 2566, 0)]
    )
    assert fake.calls["memory_v2"] == 1 and fake.calls["memory_v1"] == 0  # v2 struct first
    assert fake.calls["Compute_v2"] == 0  # clean _v3 answer: no fallback
    probe.read()
    assert fake.calls["nvmlInit"] == 1  # initialised once, handles kept


def test_own_process_shows_its_real_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    FakeNvml(monkeypatch, Device().both("Compute", [proc(me, GIB)]))
    (p,) = NvmlProbe().read().processes
    real = psutil.Process(me)
    assert p.command == " ".join(real.cmdline())
    assert "pytest" in p.command
    assert p.user == real.username()
    assert p.memory_mib == 1024


def test_unreadable_pid_stays_with_command_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not psutil.pid_exists(NO_SUCH_PID)
    FakeNvml(monkeypatch, Device().both("Compute", [proc(NO_SUCH_PID, 8200 * MIB)]))
    r = NvmlProbe().read()
    assert [(p.pid, p.command, p.user, p.container, p.memory_mib) for p in r.processes] == [
        (NO_SUCH_PID, None, None, None, 8200)
    ]
    assert r.processes  # not idle


def test_pid_in_compute_and_graphics_is_one_entry_with_larger_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = (
        Device()
        .both("Compute", [proc(NO_SUCH_PID, 700 * MIB), proc(NO_SUCH_PID + 1, 10 * MIB)])
        .both("Graphics", [proc(NO_SUCH_PID, 500 * MIB)])
        .both("MPSCompute", [proc(NO_SUCH_PID + 1, 30 * MIB)])
    )
    FakeNvml(monkeypatch, dev)
    mem = {p.pid: p.memory_mib for p in NvmlProbe().read().processes}
    assert mem == {NO_SUCH_PID: 700, NO_SUCH_PID + 1: 30}


def test_used_memory_none_stays_none_and_zero_stays_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = (
        Device()
        .both("Compute", [proc(NO_SUCH_PID, None), proc(NO_SUCH_PID + 1, 0)])
        .both("Graphics", [proc(NO_SUCH_PID + 2, None)])
    )
    FakeNvml(monkeypatch, dev)
    mem = {p.pid: p.memory_mib for p in NvmlProbe().read().processes}
    assert mem == {NO_SUCH_PID: None, NO_SUCH_PID + 1: 0, NO_SUCH_PID + 2: None}


def test_merge_keeps_known_memory_over_none(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = (
        Device()
        .both("Compute", [proc(NO_SUCH_PID, None), proc(NO_SUCH_PID + 1, 42 * MIB)])
        .both("Graphics", [proc(NO_SUCH_PID, 42 * MIB), proc(NO_SUCH_PID + 1, None)])
    )
    FakeNvml(monkeypatch, dev)
    assert [p.memory_mib for p in NvmlProbe().read().processes] == [42, 42]


NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def gb10() -> Device:
    # DGX Spark: memory info v1 and v2 answer NOT_SUPPORTED; per-process memory works.
    return Device(memory=NOT_SUPPORTED).both(
        "Compute", [proc(NO_SUCH_PID, 19135 * MIB), proc(NO_SUCH_PID + 1, 865 * MIB)]
    )


def test_gb10_not_supported_total_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch, gb10())
    r = NvmlProbe(gpu_memory_mib=122880).read()
    assert r.unified_memory is True
    assert r.memory_total_mib == 122880
    assert r.memory_used_mib == 19135 + 865  # the processes, not host RAM use
    assert len(r.processes) == 2
    assert fake.calls["memory_v2"] >= 1 and fake.calls["memory_v1"] >= 1  # both tried
    assert any("configured" in n for n in r.notes)


def test_gb10_not_supported_total_from_memtotal(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, gb10())
    r = NvmlProbe().read()
    assert r.unified_memory is True
    assert r.memory_total_mib == psutil.virtual_memory().total // MIB
    assert r.memory_used_mib == 20000


def test_total_zero_counts_as_unified(monkeypatch: pytest.MonkeyPatch) -> None:
    # The disputed GB10 variant: success with total = free = used = 0.
    dev = Device(memory=(0, 0)).both("Compute", [proc(NO_SUCH_PID, 100 * MIB)])
    FakeNvml(monkeypatch, dev)
    r = NvmlProbe(gpu_memory_mib=1000).read()
    assert (r.unified_memory, r.memory_used_mib, r.memory_total_mib) == (True, 100, 1000)


def test_memory_v2_missing_falls_back_to_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device(memory=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, memory_v1=(3 * GIB, 16 * GIB))
    fake = FakeNvml(monkeypatch, dev)
    probe = NvmlProbe()
    r = probe.read()
    assert (r.memory_used_mib, r.memory_total_mib, r.unified_memory) == (3072, 16384, False)
    probe.read()
    assert fake.calls["memory_v2"] == 1  # remembered: not tried again
    assert fake.calls["memory_v1"] == 2


def test_garbage_pid_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [proc(NO_SUCH_PID, 5 * MIB), proc(BAD_PID, 7 * MIB), proc(0, 9 * MIB)]
    FakeNvml(monkeypatch, Device().both("Compute", entries))
    r = NvmlProbe().read()
    assert [p.pid for p in r.processes] == [NO_SUCH_PID]
    assert any("dropped 2 invalid pid" in n for n in r.notes)


def test_garbage_from_v3_retried_with_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device()
    dev.lists["Compute_v3"] = [proc(NO_SUCH_PID, 5 * MIB), proc(0, 0)]
    dev.lists["Compute_v2"] = [proc(NO_SUCH_PID, 5 * MIB), proc(NO_SUCH_PID + 1, 6 * MIB)]
    fake = FakeNvml(monkeypatch, dev)
    probe = NvmlProbe()
    mem = {p.pid: p.memory_mib for p in probe.read().processes}
    assert mem == {NO_SUCH_PID: 5, NO_SUCH_PID + 1: 6}
    probe.read()
    assert fake.calls["Compute_v3"] == 1  # v2 remembered for this list
    assert fake.calls["Compute_v2"] == 2


def test_only_garbage_pids_is_an_error_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, Device().both("Compute", [proc(BAD_PID, MIB), proc(0, MIB)]))
    with pytest.raises(ProbeError, match="invalid pids"):
        NvmlProbe().read()


def test_v3_function_not_found_falls_back_to_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device()
    del dev.lists["Compute_v3"], dev.lists["Graphics_v3"]  # driver < 510.39
    dev.lists["Compute_v2"] = [proc(NO_SUCH_PID, 300 * MIB)]
    dev.lists["Graphics_v2"] = [proc(NO_SUCH_PID + 1, 20 * MIB)]
    FakeNvml(monkeypatch, dev)
    mem = {p.pid: p.memory_mib for p in NvmlProbe().read().processes}
    assert mem == {NO_SUCH_PID: 300, NO_SUCH_PID + 1: 20}


def test_mps_missing_and_graphics_not_supported_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = Device().both("Compute", [proc(NO_SUCH_PID, MIB)]).both("Graphics", NOT_SUPPORTED)
    del dev.lists["MPSCompute_v3"], dev.lists["MPSCompute_v2"]
    FakeNvml(monkeypatch, dev)
    assert [p.pid for p in NvmlProbe().read().processes] == [NO_SUCH_PID]


def test_compute_list_failure_is_an_error_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, Device().both("Compute", NOT_SUPPORTED))
    with pytest.raises(ProbeError, match="compute process list of GPU 0"):
        NvmlProbe().read()


def test_no_permission_names_gpu_and_hints_container(monkeypatch: pytest.MonkeyPatch) -> None:
    dev1 = Device().both("Compute", pynvml.NVML_ERROR_NO_PERMISSION)
    FakeNvml(monkeypatch, Device(), dev1)
    with pytest.raises(ProbeError, match="GPU 1") as exc:
        NvmlProbe().read()
    assert "NVIDIA_MIG_MONITOR_DEVICES" in exc.value.hint


def test_two_gpus_carry_their_index(monkeypatch: pytest.MonkeyPatch) -> None:
    d0 = Device(memory=(10 * GIB, 80 * GIB)).both("Compute", [proc(NO_SUCH_PID, 10 * GIB)])
    d1 = Device(memory=(1 * GIB, 80 * GIB)).both("Compute", [proc(NO_SUCH_PID, 1 * GIB)])
    FakeNvml(monkeypatch, d0, d1)
    r = NvmlProbe().read()
    assert r.gpus == 2
    assert [(p.gpu, p.pid, p.memory_mib) for p in r.processes] == [
        (0, NO_SUCH_PID, 10240),
        (1, NO_SUCH_PID, 1024),
    ]
    assert (r.memory_used_mib, r.memory_total_mib) == (11264, 163840)


def test_gpu_is_lost_names_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    lost = Device(memory=pynvml.NVML_ERROR_GPU_IS_LOST)
    fake = FakeNvml(monkeypatch, Device(), lost)
    probe = NvmlProbe()
    with pytest.raises(ProbeError, match="GPU 1 is lost") as exc:
        probe.read()
    assert not isinstance(exc.value, NoGpuFound)
    assert "Xid" in exc.value.hint
    assert fake.calls["nvmlShutdown"] == 1  # dead handles dropped
    fake.devices[1] = Device()
    assert probe.read().gpus == 2  # re-enumerated
    assert fake.calls["nvmlInit"] == 2


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_library_or_driver_is_no_gpu_found(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    fake = FakeNvml(monkeypatch, Device())
    fake.init_error = code
    with pytest.raises(NoGpuFound, match="no NVIDIA driver") as exc:
        NvmlProbe().read()
    assert "--probe sim" in exc.value.hint


def test_other_init_errors_are_probe_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch, Device())
    fake.init_error = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    with pytest.raises(ProbeError, match="failed to initialise") as exc:
        NvmlProbe().read()
    assert not isinstance(exc.value, NoGpuFound)
    assert "reboot" in exc.value.hint


def test_no_devices_is_no_gpu_found(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch)
    with pytest.raises(NoGpuFound, match="no GPU"):
        NvmlProbe().read()
    assert fake.calls["nvmlShutdown"] == 1


def test_close_shuts_down_once_and_read_reopens(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch, Device())
    probe = NvmlProbe()
    probe.close()  # never opened: nothing to do
    assert fake.calls["nvmlShutdown"] == 0
    probe.read()
    probe.close()
    probe.close()
    assert fake.calls["nvmlShutdown"] == 1
    probe.read()
    assert fake.calls["nvmlInit"] == 2


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_loadable(), reason="this machine has an NVIDIA driver")
def test_real_binding_without_library_is_no_gpu_found() -> None:
    # No stubs: the real pynvml fails to dlopen libnvidia-ml.so.1.
    with pytest.raises(NoGpuFound) as exc:
        NvmlProbe().read()
    assert "NVML Shared Library Not Found" in exc.value.message


# --- the real binding against fake C symbols (gpustat's NvidiaDriverMock) ---------------


class ProcV2(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class ProcV3_535_43(ctypes.Structure):
    """The struct driver 535.43 fills for ``_v3``, larger than before with no version bump."""

    _fields_ = [*ProcV2._fields_, ("usedGpuCcProtectedMemory", ctypes.c_ulonglong)]


class FakeDriver:
    """C symbols for ``pynvml._nvmlGetFunctionPointer``: one GPU, these compute processes."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        procs: list[tuple[int, int]],
        v3: type[ctypes.Structure] | None,
    ) -> None:
        self.procs = procs
        self.calls: Counter[str] = Counter()
        self.symbols: dict[str, Callable[..., int]] = {
            "nvmlInitWithFlags": lambda flags: 0,
            "nvmlShutdown": lambda: 0,
            "nvmlDeviceGetCount_v2": self._count,
            "nvmlDeviceGetHandleByIndex_v2": lambda index, device: 0,
            "nvmlDeviceGetMemoryInfo_v2": self._memory,
        }
        for kind in ("Compute", "Graphics"):
            entries = procs if kind == "Compute" else []
            name = f"nvmlDeviceGet{kind}RunningProcesses"
            self.symbols[name + "_v2"] = self._lister(name + "_v2", entries, ProcV2)
            if v3 is not None:
                self.symbols[name + "_v3"] = self._lister(name + "_v3", entries, v3)
        monkeypatch.setattr(pynvml, "_LoadNvmlLibrary", lambda: None)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self._lookup)

    def _lookup(self, name: str) -> Callable[..., int]:
        if name not in self.symbols:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self.symbols[name]

    @staticmethod
    def _count(count_ref: Any) -> int:
        count_ref._obj.value = 1
        return int(pynvml.NVML_SUCCESS)

    @staticmethod
    def _memory(handle: Any, mem_ref: Any) -> int:
        mem_ref._obj.total, mem_ref._obj.used = 80 * GIB, 4 * GIB
        return int(pynvml.NVML_SUCCESS)

    def _lister(
        self, name: str, entries: list[tuple[int, int]], struct: type[ctypes.Structure]
    ) -> Callable[..., int]:
        def fn(handle: Any, count_ref: Any, buf: Any) -> int:
            self.calls[name] += 1
            count = count_ref._obj
            if buf is None:  # the sizing call
                count.value = len(entries)
                return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE if entries else pynvml.NVML_SUCCESS)
            assert count.value >= len(entries)
            filled = (struct * len(entries))()
            for i, (pid, used) in enumerate(entries):
                filled[i].pid, filled[i].usedGpuMemory = pid, used
                filled[i].gpuInstanceId = filled[i].computeInstanceId = 0xFFFFFFFF
            assert ctypes.sizeof(buf) >= ctypes.sizeof(filled)
            ctypes.memmove(buf, filled, ctypes.sizeof(filled))
            count.value = len(entries)
            return int(pynvml.NVML_SUCCESS)

        return fn


TWO = [(NO_SUCH_PID, 2566 * MIB), (NO_SUCH_PID + 1, 1542 * MIB)]


def test_driver_without_v3_symbols_reads_through_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver(monkeypatch, TWO, v3=None)  # driver < 510.39
    r = NvmlProbe().read()
    assert [(p.pid, p.memory_mib) for p in r.processes] == [
        (NO_SUCH_PID, 2566),
        (NO_SUCH_PID + 1, 1542),
    ]
    assert (r.memory_used_mib, r.memory_total_mib) == (4096, 81920)
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2  # size, then fill


def test_driver_535_43_v3_struct_mismatch_recovers_through_v2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver(monkeypatch, TWO, v3=ProcV3_535_43)
    # What the binding alone makes of it: the second entry is misaligned garbage.
    pynvml.nvmlInit()
    garbage = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(None)
    assert [p.pid for p in garbage] == [NO_SUCH_PID, 0]
    r = NvmlProbe().read()
    assert [(p.pid, p.memory_mib) for p in r.processes] == [
        (NO_SUCH_PID, 2566),
        (NO_SUCH_PID + 1, 1542),
    ]
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    assert any("_v2" in n for n in r.notes)
