"""NvmlProbe through the real pynvml binding, driven by fake C functions.

This is gpustat's ``NvidiaDriverMock`` (``gpustat/test_gpustat.py``) made whole: the
binding's ``_nvmlGetFunctionPointer`` answers with Python callables that implement the
C functions of one simulated driver, two-call protocols, structs and error codes
included. Everything above the C boundary is real: pynvml's wrappers, its error
classes, and our own ``ctypes`` process-list calls. A driver is described by which
symbols it exports and which struct layout each process-list symbol fills, so the
driver history (as gpustat's mock and nvitop PR #89 record it) is a table of presets:

======================  =================================================================
< 450.66                unversioned process lists only (16-byte struct), memory info v1
450.66                  + ``_v2`` (24-byte struct)
510.39                  + ``_v3`` (still 24 bytes), memory info v2
535.43 - 535.86         ``_v3`` fills 32 bytes (``usedGpuCcProtectedMemory``), no version
                        bump; ``nvmlDeviceGetConfComputeMemSizeInfo`` exists,
                        ``nvmlDeviceGetRunningProcessDetailList`` does not yet
535.104.05 and later    ``_v3`` back to 24 bytes; the detail list exists
======================  =================================================================
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

from gpuctl.adapters.probes.nvml import NvmlMismatch, NvmlProbe
from gpuctl.adapters.probes.nvml_procs import ProcessInfoV1, ProcessInfoV2, ProcessInfoV3
from gpuctl.errors import NoGpuFound, ProbeError

MIB = 2**20
GIB = 2**30
NO_SUCH_PID = 4194000  # below PID_MAX_LIMIT, but no process has it on a test machine
BAD_PID = 0xFFFFFFFF
NA = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE
MIG_HANDLE = 1000  # a fake MIG device handle is (parent handle) * 1000 + slot + 1
KINDS = ("Compute", "Graphics", "MPSCompute")
OK = int(pynvml.NVML_SUCCESS)
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)

Entries = list[tuple[int, int | None]]


def proc(pid: int, used: int | None) -> tuple[int, int | None]:
    """A process entry as the driver fills it (None: NVML_VALUE_NOT_AVAILABLE)."""
    return (pid, used)


@dataclass
class Device:
    """One fake GPU. ``lists`` maps ``Compute`` etc. to entries or an NVML error code."""

    memory: tuple[int, int] | int = (0, 80 * GIB)  # (used, total) bytes, or an error code
    memory_v1: tuple[int, int] | int | None = None  # None: same as ``memory``
    lists: dict[str, Entries | int] = field(default_factory=dict)
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    util: int | None = None  # None: NOT_SUPPORTED (MIG)
    temperature: int | None = None
    power_mw: int | None = None
    samples: list[tuple[int, int]] | int = NOT_SUPPORTED  # (pid, smUtil), or an error code
    # MIG: None, the board has none (NOT_SUPPORTED); a list, MIG on with these instances
    # (each a Device of its own memory and lists, its GPU instance id in ``gi``).
    mig: list[Device] | None = None
    gi: int = 0

    def __post_init__(self) -> None:
        for kind in KINDS:
            self.lists.setdefault(kind, [])

    def with_(self, kind: str, entries: Entries | int) -> Device:
        self.lists[kind] = entries
        return self


@dataclass
class Driver:
    """What a driver exports: process-list suffix -> the struct it fills."""

    lists: dict[str, type[ctypes.Structure]]
    memory_v2: bool = True
    conf_compute: bool = False
    detail_list: bool = False
    cc_bytes: int = 4096  # usedGpuCcProtectedMemory in a 32-byte entry


MODERN = Driver({"_v3": ProcessInfoV2, "_v2": ProcessInfoV2, "": ProcessInfoV1}, True, True, True)
D535_43 = Driver({"_v3": ProcessInfoV3, "_v2": ProcessInfoV2, "": ProcessInfoV1}, True, True)
D510 = Driver({"_v3": ProcessInfoV2, "_v2": ProcessInfoV2, "": ProcessInfoV1})
D450 = Driver({"_v2": ProcessInfoV2, "": ProcessInfoV1}, memory_v2=False)
D418 = Driver({"": ProcessInfoV1}, memory_v2=False)
# A driver nvitop's rule misjudges: the 32-byte _v3 struct, but no ConfCompute symbol.
# With a zero CC figure the misread shows as pid 0, which the probe catches; a non-zero
# one would pass as a pid, which is why the struct is chosen by symbols in the first place.
MISJUDGED = Driver({"_v3": ProcessInfoV3, "_v2": ProcessInfoV2, "": ProcessInfoV1}, cc_bytes=0)


class FakeDriver:
    """C symbols behind ``pynvml._nvmlGetFunctionPointer`` for ``devices`` on ``driver``."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *devices: Device, driver: Driver = MODERN
    ) -> None:
        self.devices = list(devices)
        self.driver = driver
        self.calls: Counter[str] = Counter()
        self.init_error: int | None = None
        self.handle_errors: dict[int, int] = {}  # GPU index -> error of its handle
        self.missing: set[str] = set()  # symbols removed on top of the driver's
        monkeypatch.setattr(pynvml, "_LoadNvmlLibrary", lambda: None)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self._lookup)

    # -- the symbol table

    def symbols(self) -> dict[str, Callable[..., int]]:
        table: dict[str, Callable[..., int]] = {
            "nvmlInitWithFlags": self._init,
            "nvmlShutdown": self._shutdown,
            "nvmlDeviceGetCount_v2": self._count,
            "nvmlDeviceGetHandleByIndex_v2": self._handle,
            "nvmlDeviceGetMemoryInfo": self._memory_v1,
            "nvmlDeviceGetName": self._string(lambda d: d.name),
            "nvmlDeviceGetUUID": self._string(lambda d: d.uuid),
            "nvmlDeviceGetUtilizationRates": self._util,
            "nvmlDeviceGetTemperature": self._temperature,
            "nvmlDeviceGetPowerUsage": self._power,
            "nvmlDeviceGetProcessUtilization": self._samples,
            "nvmlDeviceGetMigMode": self._mig_mode,
            "nvmlDeviceGetMaxMigDeviceCount": self._mig_count,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle,
            "nvmlDeviceGetGpuInstanceId": self._gpu_instance_id,
        }
        if self.driver.memory_v2:
            table["nvmlDeviceGetMemoryInfo_v2"] = self._memory_v2
        if self.driver.conf_compute:
            table["nvmlDeviceGetConfComputeMemSizeInfo"] = lambda *a: OK
        if self.driver.detail_list:
            table["nvmlDeviceGetRunningProcessDetailList"] = lambda *a: OK
        for kind in KINDS:
            for suffix, struct in self.driver.lists.items():
                name = f"nvmlDeviceGet{kind}RunningProcesses{suffix}"
                table[name] = self._lister(name, kind, struct)
        return {k: v for k, v in table.items() if k not in self.missing}

    def _lookup(self, name: str) -> Callable[..., int]:
        fn = self.symbols().get(name)
        if fn is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return fn

    # -- the C functions

    def _init(self, flags: int) -> int:
        self.calls["nvmlInit"] += 1
        return OK if self.init_error is None else self.init_error

    def _shutdown(self) -> int:
        self.calls["nvmlShutdown"] += 1
        return OK

    def _count(self, count_ref: Any) -> int:
        count_ref._obj.value = len(self.devices)
        return OK

    def _handle(self, index: Any, device_ref: Any) -> int:
        if index.value in self.handle_errors:
            return self.handle_errors[index.value]
        # A handle is an opaque pointer: ours holds index + 1 (NULL is no handle).
        ptr = ctypes.c_void_p(index.value + 1)
        ctypes.memmove(ctypes.addressof(device_ref._obj), ctypes.addressof(ptr), ctypes.sizeof(ptr))
        return OK

    def _dev(self, handle: Any) -> Device:
        ptr: int = ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[assignment]
        if ptr >= MIG_HANDLE:  # a MIG device handle: parent and slot, see _mig_handle
            parent = self.devices[ptr // MIG_HANDLE - 1]
            assert parent.mig is not None
            return parent.mig[ptr % MIG_HANDLE - 1]
        return self.devices[ptr - 1]

    def _mig_mode(self, handle: Any, current_ref: Any, pending_ref: Any) -> int:
        dev = self._dev(handle)
        if dev.mig is None:
            return NOT_SUPPORTED
        current_ref._obj.value = pending_ref._obj.value = int(pynvml.NVML_DEVICE_MIG_ENABLE)
        return OK

    def _mig_count(self, handle: Any, count_ref: Any) -> int:
        count_ref._obj.value = 7  # an A100/H100's most instances
        return OK

    def _mig_handle(self, handle: Any, index: Any, mig_ref: Any) -> int:
        parent_ptr: int = ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[assignment]
        dev = self._dev(handle)
        if dev.mig is None or index.value >= len(dev.mig):
            return int(pynvml.NVML_ERROR_NOT_FOUND)
        ptr = ctypes.c_void_p(parent_ptr * MIG_HANDLE + index.value + 1)
        ctypes.memmove(ctypes.addressof(mig_ref._obj), ctypes.addressof(ptr), ctypes.sizeof(ptr))
        return OK

    def _gpu_instance_id(self, handle: Any, id_ref: Any) -> int:
        id_ref._obj.value = self._dev(handle).gi
        return OK

    def _fill_memory(self, spec: tuple[int, int] | int, mem_ref: Any) -> int:
        if isinstance(spec, int):
            return spec
        mem = mem_ref._obj
        mem.used, mem.total = spec
        mem.free = spec[1] - spec[0]
        return OK

    def _memory_v2(self, handle: Any, mem_ref: Any) -> int:
        self.calls["memory_v2"] += 1
        return self._fill_memory(self._dev(handle).memory, mem_ref)

    def _memory_v1(self, handle: Any, mem_ref: Any) -> int:
        self.calls["memory_v1"] += 1
        dev = self._dev(handle)
        return self._fill_memory(dev.memory if dev.memory_v1 is None else dev.memory_v1, mem_ref)

    def _string(self, get: Callable[[Device], str]) -> Callable[..., int]:
        def fn(handle: Any, buf: Any, size: Any) -> int:
            buf.value = get(self._dev(handle)).encode()
            return OK

        return fn

    def _util(self, handle: Any, util_ref: Any) -> int:
        dev = self._dev(handle)
        if dev.util is None:
            return NOT_SUPPORTED
        util_ref._obj.gpu, util_ref._obj.memory = dev.util, 0
        return OK

    def _temperature(self, handle: Any, sensor: Any, temp_ref: Any) -> int:
        dev = self._dev(handle)
        if dev.temperature is None:
            return NOT_SUPPORTED
        temp_ref._obj.value = dev.temperature
        return OK

    def _power(self, handle: Any, power_ref: Any) -> int:
        dev = self._dev(handle)
        if dev.power_mw is None:
            return NOT_SUPPORTED
        power_ref._obj.value = dev.power_mw
        return OK

    def _samples(self, handle: Any, buf: Any, count_ref: Any, since: Any) -> int:
        self.calls["samples"] += 1
        samples = self._dev(handle).samples
        if isinstance(samples, int):
            return samples
        if not samples:
            return int(pynvml.NVML_ERROR_NOT_FOUND)
        if buf is None:
            count_ref._obj.value = len(samples)
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (pid, sm) in enumerate(samples):
            buf[i].pid, buf[i].smUtil, buf[i].timeStamp = pid, sm, since.value + 1
        count_ref._obj.value = len(samples)
        return OK

    def _lister(self, name: str, kind: str, struct: type[ctypes.Structure]) -> Callable[..., int]:
        """NVML's two-call protocol: INSUFFICIENT_SIZE with the count when the buffer is
        missing (SUCCESS when there is nothing to list), then fill ``struct`` entries.
        The driver writes its own layout whatever the caller allocated, as a real one does."""

        def fn(handle: Any, count_ref: Any, buf: Any) -> int:
            self.calls[name] += 1
            entries = self._dev(handle).lists[kind]
            if isinstance(entries, int):
                return entries
            count = count_ref._obj
            if buf is None:
                count.value = len(entries)
                return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE if entries else OK)
            filled = (struct * len(entries))()
            for i, (pid, used) in enumerate(entries):
                filled[i].pid, filled[i].usedGpuMemory = pid, NA if used is None else used
                if hasattr(filled[i], "gpuInstanceId"):
                    filled[i].gpuInstanceId = filled[i].computeInstanceId = 0xFFFFFFFF
                if hasattr(filled[i], "usedGpuCcProtectedMemory"):
                    # Confidential computing off still reports a small figure: the value
                    # that a 24-byte reader takes for the next entry's pid.
                    filled[i].usedGpuCcProtectedMemory = self.driver.cc_bytes
            size = min(ctypes.sizeof(filled), ctypes.sizeof(buf))
            ctypes.memmove(buf, filled, size)
            count.value = len(entries)
            return OK

        return fn


def by_pid(reading: Any) -> dict[int, Any]:
    return {p.pid: p for p in reading.processes}


# --- the basics ---------------------------------------------------------------------


def test_h100_two_processes_and_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    dev = Device(memory=(19818 * MIB, 81559 * MIB)).with_(
        "Compute", [proc(me, 15690 * MIB), proc(NO_SUCH_PID, 2566 * MIB + 12345)]
    )
    fake = FakeDriver(monkeypatch, dev)
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
    (d,) = r.devices
    assert (d.index, d.name, d.uuid, d.memory_used_mib, d.memory_total_mib, d.unified) == (
        0,
        "NVIDIA H100 80GB HBM3",
        "GPU-00000000-0000-0000-0000-000000000000",
        19818,
        81559,
        False,
    )
    assert fake.calls["memory_v2"] == 1 and fake.calls["memory_v1"] == 0  # v2 struct first
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 0  # clean _v3 answer
    probe.read()
    assert fake.calls["nvmlInit"] == 1  # initialised once, handles kept


def test_own_process_shows_its_real_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    FakeDriver(monkeypatch, Device().with_("Compute", [proc(me, GIB)]))
    (p,) = NvmlProbe().read().processes
    real = psutil.Process(me)
    assert p.command == " ".join(real.cmdline())
    # The arguments too (pytest's own, or an xdist worker's ``-u -c ...``), not the
    # process name alone.
    assert len(real.cmdline()) > 1 and p.command != real.name()
    assert p.user == real.username()
    assert p.memory_mib == 1024


def test_unreadable_pid_stays_with_command_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not psutil.pid_exists(NO_SUCH_PID)
    FakeDriver(monkeypatch, Device().with_("Compute", [proc(NO_SUCH_PID, 8200 * MIB)]))
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
        .with_("Compute", [proc(NO_SUCH_PID, 700 * MIB), proc(NO_SUCH_PID + 1, 10 * MIB)])
        .with_("Graphics", [proc(NO_SUCH_PID, 500 * MIB)])
        .with_("MPSCompute", [proc(NO_SUCH_PID + 1, 30 * MIB)])
    )
    FakeDriver(monkeypatch, dev)
    mem = {p.pid: p.memory_mib for p in NvmlProbe().read().processes}
    assert mem == {NO_SUCH_PID: 700, NO_SUCH_PID + 1: 30}


def test_used_memory_none_stays_none_and_zero_stays_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = (
        Device()
        .with_("Compute", [proc(NO_SUCH_PID, None), proc(NO_SUCH_PID + 1, 0)])
        .with_("Graphics", [proc(NO_SUCH_PID + 2, None)])
    )
    FakeDriver(monkeypatch, dev)
    mem = {p.pid: p.memory_mib for p in NvmlProbe().read().processes}
    assert mem == {NO_SUCH_PID: None, NO_SUCH_PID + 1: 0, NO_SUCH_PID + 2: None}


def test_merge_keeps_known_memory_over_none(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = (
        Device()
        .with_("Compute", [proc(NO_SUCH_PID, None), proc(NO_SUCH_PID + 1, 42 * MIB)])
        .with_("Graphics", [proc(NO_SUCH_PID, 42 * MIB), proc(NO_SUCH_PID + 1, None)])
    )
    FakeDriver(monkeypatch, dev)
    assert [p.memory_mib for p in NvmlProbe().read().processes] == [42, 42]


def test_mig_device_memory_that_no_process_accounts_for_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30 of 80 GiB used, the process's memory N/A: the device figure stays, so the
    decision can count the 30 GiB as unattributed (not as free)."""
    dev = Device(memory=(30 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, None)])
    FakeDriver(monkeypatch, dev)
    r = NvmlProbe().read()
    (d,) = r.devices
    assert (d.memory_used_mib, d.memory_total_mib, d.unified) == (30 * 1024, 80 * 1024, False)
    assert [p.memory_mib for p in r.processes] == [None]


# --- unified memory (GB10) ---------------------------------------------------------------


def gb10() -> Device:
    # DGX Spark: memory info v1 and v2 answer NOT_SUPPORTED; per-process memory works.
    return Device(memory=NOT_SUPPORTED, name="NVIDIA GB10").with_(
        "Compute", [proc(NO_SUCH_PID, 19135 * MIB), proc(NO_SUCH_PID + 1, 865 * MIB)]
    )


def test_gb10_not_supported_total_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, gb10())
    r = NvmlProbe(gpu_memory_mib=122880).read()
    assert r.unified_memory is True
    assert r.memory_total_mib == 122880
    assert r.memory_used_mib == 19135 + 865  # the processes, not host RAM use
    assert len(r.processes) == 2
    assert fake.calls["memory_v2"] >= 1 and fake.calls["memory_v1"] >= 1  # both tried
    assert any("configured" in n for n in r.notes)


def test_gb10_not_supported_total_from_memtotal(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, gb10())
    r = NvmlProbe().read()
    assert r.unified_memory is True
    assert r.memory_total_mib == psutil.virtual_memory().total // MIB
    assert r.memory_used_mib == 20000


def test_a_discrete_gpu_answering_total_zero_is_unknown_not_unified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Success with total = 0 was taken for unified memory, so the host's MemTotal (or
    the configured total) showed as free. GB10 answers NOT_SUPPORTED; a device that
    answers 0 has given no figure, and that GPU is unknown."""
    zero = Device(memory=(0, 0)).with_("Compute", [proc(NO_SUCH_PID, 100 * MIB)])
    FakeDriver(monkeypatch, Device(), zero)
    r = NvmlProbe(gpu_memory_mib=1000).read()
    d1 = r.devices[1]
    assert not d1.unified and d1.error is not None and "total memory of 0" in d1.error
    assert r.unified_memory is False
    assert _decide(r, _Spec("llm", 500)).decision.value == "UNKNOWN"
    FakeDriver(monkeypatch, zero)
    with pytest.raises(ProbeError, match="total memory of 0"):
        NvmlProbe(gpu_memory_mib=1000).read()


def test_gb10_process_of_unknown_memory_makes_free_memory_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GB10 with a process whose memory NVML cannot tell counted it as 0, so a 100 GiB
    service was FITS. On unified memory "used" is the processes' sum: one unknown makes
    the GPU's free memory unknown, and the decision UNKNOWN, naming the pid."""
    dev = gb10().with_("Compute", [proc(NO_SUCH_PID, 19135 * MIB), proc(NO_SUCH_PID + 1, None)])
    FakeDriver(monkeypatch, dev)
    r = NvmlProbe(gpu_memory_mib=122880).read()
    (d,) = r.devices
    assert d.unified and d.error is not None and str(NO_SUCH_PID + 1) in d.error
    assert d.memory_used_mib is None
    assert [p.pid for p in r.processes] == [NO_SUCH_PID, NO_SUCH_PID + 1]  # still listed
    v = _decide(r, _Spec("big", 100 * 1024))
    assert v.decision.value == "UNKNOWN", v.reason
    assert f"pid {NO_SUCH_PID + 1}" in v.reason


@pytest.mark.parametrize(
    "memory",
    [(NA, NA), (GIB, NA), (NA, 80 * GIB), (90 * GIB, 80 * GIB)],
    ids=["both-na", "total-na", "used-na", "used-beyond-total"],
)
def test_sentinel_memory_is_unknown_never_16_eib(
    monkeypatch: pytest.MonkeyPatch, memory: tuple[int, int]
) -> None:
    """A total or used of NVML_VALUE_NOT_AVAILABLE (2^64-1) was read as 16 EiB, so a
    1000 GiB service was FITS: that GPU is unknown, the decision UNKNOWN."""
    FakeDriver(monkeypatch, Device(), Device(memory=memory))
    r = NvmlProbe().read()
    d1 = r.devices[1]
    assert d1.error is not None and "memory is unknown" in d1.error
    assert (d1.memory_used_mib, d1.memory_total_mib) == (None, None)
    assert r.memory_total_mib == 80 * 1024  # the readable GPU only
    assert _decide(r, _Spec("huge", 1000 * 1024)).decision.value == "UNKNOWN"
    FakeDriver(monkeypatch, Device(memory=memory))
    with pytest.raises(ProbeError, match="memory is unknown"):
        NvmlProbe().read()


def test_only_the_device_without_a_figure_is_unified(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU without a memory figure no longer turns the whole host unified with
    MemTotal and drops the others' figures."""
    normal = Device(memory=(10 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, 10 * GIB)])
    FakeDriver(monkeypatch, normal, gb10())
    r = NvmlProbe(gpu_memory_mib=122880).read()
    d0, d1 = r.devices
    assert (d0.unified, d0.memory_used_mib, d0.memory_total_mib) == (False, 10240, 81920)
    assert (d1.unified, d1.memory_used_mib, d1.memory_total_mib) == (True, 20000, 122880)
    assert (r.memory_used_mib, r.memory_total_mib) == (30240, 81920 + 122880)


def test_memory_v2_missing_falls_back_to_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, Device(memory=(3 * GIB, 16 * GIB)), driver=D450)
    probe = NvmlProbe()
    r = probe.read()
    assert (r.memory_used_mib, r.memory_total_mib, r.unified_memory) == (3072, 16384, False)
    probe.read()
    assert fake.calls["memory_v2"] == 0
    assert fake.calls["memory_v1"] == 2


# --- pids and process structs ------------------------------------------------------------


def test_garbage_pid_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [proc(NO_SUCH_PID, 5 * MIB), proc(BAD_PID, 7 * MIB), proc(0, 9 * MIB)]
    FakeDriver(monkeypatch, Device().with_("Compute", entries))
    r = NvmlProbe().read()
    assert [p.pid for p in r.processes] == [NO_SUCH_PID]
    assert any("dropped 2 invalid pid" in n for n in r.notes)


def test_only_garbage_pids_is_an_error_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, Device().with_("Compute", [proc(BAD_PID, MIB), proc(0, MIB)]))
    with pytest.raises(NvmlMismatch, match="invalid pids"):
        NvmlProbe().read()


TWO = [proc(NO_SUCH_PID, 2566 * MIB), proc(NO_SUCH_PID + 1, 1542 * MIB)]
# Three, with a small pid among them: the pid a misaligned read must not invent.
THREE = [
    proc(NO_SUCH_PID, 2566 * MIB),
    proc(4096 + 1, 100 * MIB),
    proc(NO_SUCH_PID + 1, 1542 * MIB),
]


@pytest.mark.parametrize(
    ("driver", "call"),
    [
        (MODERN, "nvmlDeviceGetComputeRunningProcesses_v3"),
        (D535_43, "nvmlDeviceGetComputeRunningProcesses_v3"),
        (D510, "nvmlDeviceGetComputeRunningProcesses_v3"),
        (D450, "nvmlDeviceGetComputeRunningProcesses_v2"),
        (D418, "nvmlDeviceGetComputeRunningProcesses"),
    ],
    ids=["535.104+", "535.43", "510", "450", "418"],
)
def test_every_driver_generation_reads_exact_pids(
    monkeypatch: pytest.MonkeyPatch, driver: Driver, call: str
) -> None:
    fake = FakeDriver(monkeypatch, Device().with_("Compute", THREE), driver=driver)
    r = NvmlProbe().read()
    assert [(p.pid, p.memory_mib) for p in r.processes] == sorted(
        [(NO_SUCH_PID, 2566), (4097, 100), (NO_SUCH_PID + 1, 1542)]
    )
    assert fake.calls[call] == 2  # size, then fill: the one call this driver calls for
    compute = [k for k in fake.calls if k.startswith("nvmlDeviceGetComputeRunningProcesses")]
    assert sum(fake.calls[k] for k in compute) == 2


def test_driver_535_43_cc_memory_is_never_taken_for_a_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported case: the binding's 24-byte view of the 32-byte _v3 struct reads the
    first entry's ``usedGpuCcProtectedMemory`` (4096) as the second entry's pid: a
    valid-looking pid, and a real process lost. Choosing the struct by the driver's
    symbols reads both real pids."""
    FakeDriver(monkeypatch, Device().with_("Compute", TWO), driver=D535_43)
    pynvml.nvmlInit()
    naive = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert [p.pid for p in naive][:2] == [NO_SUCH_PID, 4096]  # what a 24-byte reader sees
    r = NvmlProbe().read()
    assert [(p.pid, p.memory_mib) for p in r.processes] == [
        (NO_SUCH_PID, 2566),
        (NO_SUCH_PID + 1, 1542),
    ]
    assert 4096 not in {p.pid for p in r.processes}


def test_struct_sizes_match_the_c_header() -> None:
    assert [ctypes.sizeof(s) for s in (ProcessInfoV1, ProcessInfoV2, ProcessInfoV3)] == [16, 24, 32]


def test_garbage_from_a_misjudged_v3_retried_with_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, Device().with_("Compute", TWO), driver=MISJUDGED)
    probe = NvmlProbe()
    mem = {p.pid: p.memory_mib for p in probe.read().processes}
    assert mem == {NO_SUCH_PID: 2566, NO_SUCH_PID + 1: 1542}
    probe.read()
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2  # one read only
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 4  # then _v2, remembered


def test_mps_missing_and_graphics_not_supported_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = Device().with_("Compute", [proc(NO_SUCH_PID, MIB)]).with_("Graphics", NOT_SUPPORTED)
    fake = FakeDriver(monkeypatch, dev)
    fake.missing = {f"nvmlDeviceGetMPSComputeRunningProcesses{s}" for s in ("_v3", "_v2", "")}
    assert [p.pid for p in NvmlProbe().read().processes] == [NO_SUCH_PID]


# --- utilisation, temperature, power ------------------------------------------------------


def test_utilisation_temperature_power_and_per_process_sm(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device(util=87, temperature=64, power_mw=312_456, samples=[(NO_SUCH_PID, 71)]).with_(
        "Compute", [proc(NO_SUCH_PID, GIB), proc(NO_SUCH_PID + 1, GIB)]
    )
    fake = FakeDriver(monkeypatch, dev)
    r = NvmlProbe().read()
    (d,) = r.devices
    assert (d.utilization_pct, d.temperature_c, d.power_w) == (87, 64, 312.5)
    sm = {p.pid: p.sm_util_pct for p in r.processes}
    assert sm == {NO_SUCH_PID: 71, NO_SUCH_PID + 1: None}  # no sample: unknown, not 0
    assert fake.calls["samples"] == 2  # size, then fill


def test_unknown_figures_stay_none_never_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG answers NOT_SUPPORTED for utilisation; old boards lack power and temperature."""
    FakeDriver(monkeypatch, Device().with_("Compute", [proc(NO_SUCH_PID, GIB)]))
    r = NvmlProbe().read()
    (d,) = r.devices
    assert (d.utilization_pct, d.temperature_c, d.power_w) == (None, None, None)
    assert r.processes[0].sm_util_pct is None


def test_sentinel_temperature_and_power_are_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """4294967295 °C and 4,294,967 W were shown: NVML's unsigned "not available"."""
    dev = Device(temperature=0xFFFFFFFF, power_mw=0xFFFFFFFF)
    FakeDriver(monkeypatch, dev.with_("Compute", [proc(NO_SUCH_PID, GIB)]))
    (d,) = NvmlProbe().read().devices
    assert (d.temperature_c, d.power_w) == (None, None)
    assert d.readable and d.memory_total_mib == 80 * 1024  # the rest of the GPU is read


def test_a_measured_zero_stays_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device(util=0, temperature=30, power_mw=0, samples=[(NO_SUCH_PID, 0)])
    FakeDriver(monkeypatch, dev.with_("Compute", [proc(NO_SUCH_PID, GIB)]))
    r = NvmlProbe().read()
    assert (r.devices[0].utilization_pct, r.devices[0].power_w) == (0, 0.0)
    assert r.processes[0].sm_util_pct == 0


# --- one bad GPU, and errors ---------------------------------------------------------------


def test_one_process_list_unsupported_gpu_is_unknown_the_other_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = Device(memory=(10 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, 10 * GIB)])
    bad = Device().with_("Compute", NOT_SUPPORTED)
    FakeDriver(monkeypatch, good, bad)
    r = NvmlProbe().read()
    d0, d1 = r.devices
    assert d0.readable and (d0.memory_used_mib, d0.memory_total_mib) == (10240, 81920)
    assert d1.error is not None and "compute process list of GPU 1" in d1.error
    assert [(p.pid, p.gpu) for p in r.processes] == [(NO_SUCH_PID, 0)]
    assert (r.memory_used_mib, r.memory_total_mib) == (10240, 81920)  # the readable GPU only


def test_compute_list_failure_on_the_only_gpu_is_an_error_not_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeDriver(monkeypatch, Device().with_("Compute", NOT_SUPPORTED))
    with pytest.raises(ProbeError, match="compute process list of GPU 0"):
        NvmlProbe().read()


def test_no_permission_names_gpu_and_hints_container(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = Device().with_("Compute", pynvml.NVML_ERROR_NO_PERMISSION)
    FakeDriver(monkeypatch, Device(), denied)
    r = NvmlProbe().read()
    assert r.devices[1].error is not None and "GPU 1" in r.devices[1].error
    assert any("NVIDIA_MIG_MONITOR_DEVICES" in n for n in r.notes)
    assert r.devices[0].readable
    # The only GPU refused: no reading at all, with the hint.
    FakeDriver(monkeypatch, Device().with_("Compute", pynvml.NVML_ERROR_NO_PERMISSION))
    with pytest.raises(ProbeError, match="GPU 0") as exc:
        NvmlProbe().read()
    assert "NVIDIA_MIG_MONITOR_DEVICES" in exc.value.hint


def test_two_gpus_carry_their_index(monkeypatch: pytest.MonkeyPatch) -> None:
    d0 = Device(memory=(10 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, 10 * GIB)])
    d1 = Device(memory=(1 * GIB, 80 * GIB), uuid="GPU-1").with_(
        "Compute", [proc(NO_SUCH_PID, 1 * GIB)]
    )
    FakeDriver(monkeypatch, d0, d1)
    r = NvmlProbe().read()
    assert r.gpus == 2
    assert [(p.gpu, p.pid, p.memory_mib) for p in r.processes] == [
        (0, NO_SUCH_PID, 10240),
        (1, NO_SUCH_PID, 1024),
    ]
    assert [(d.index, d.memory_used_mib, d.memory_total_mib) for d in r.devices] == [
        (0, 10240, 81920),
        (1, 1024, 81920),
    ]
    assert r.devices[1].uuid == "GPU-1"
    assert (r.memory_used_mib, r.memory_total_mib) == (11264, 163840)


def test_gpu_is_lost_is_that_gpu_and_nvml_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    lost = Device(memory=pynvml.NVML_ERROR_GPU_IS_LOST)
    fake = FakeDriver(monkeypatch, Device(), lost)
    probe = NvmlProbe()
    r = probe.read()
    assert r.devices[1].error is not None and "GPU 1 is lost" in r.devices[1].error
    assert any("Xid" in n for n in r.notes)
    assert r.devices[0].readable
    fake.devices[1] = Device()
    assert all(d.readable for d in probe.read().devices)  # re-enumerated
    assert (fake.calls["nvmlInit"], fake.calls["nvmlShutdown"]) == (2, 1)


def test_the_only_gpu_lost_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, Device(memory=pynvml.NVML_ERROR_GPU_IS_LOST))
    with pytest.raises(ProbeError, match="GPU 0 is lost") as exc:
        NvmlProbe().read()
    assert not isinstance(exc.value, NoGpuFound)
    assert "Xid" in exc.value.hint


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_UNKNOWN,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_RESET_REQUIRED,
    ],
)
def test_any_persistent_error_restarts_nvml_on_the_next_read(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    fake = FakeDriver(monkeypatch, Device(), Device(memory=code))
    probe = NvmlProbe()
    assert not probe.read().devices[1].readable
    assert fake.calls["nvmlInit"] == 1
    fake.devices[1] = Device()
    assert probe.read().devices[1].readable
    assert (fake.calls["nvmlInit"], fake.calls["nvmlShutdown"]) == (2, 1)
    probe.read()
    assert fake.calls["nvmlInit"] == 2  # healthy again: no more restarts


def test_a_timeout_does_not_restart_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, Device(), Device(memory=pynvml.NVML_ERROR_TIMEOUT))
    probe = NvmlProbe()
    probe.read()
    probe.read()
    assert fake.calls["nvmlInit"] == 1


def test_missing_process_list_function_is_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An old driver that loads NVML but lacks what a read needs: ``auto`` falls back on it."""
    fake = FakeDriver(monkeypatch, Device())
    fake.missing = {f"nvmlDeviceGetComputeRunningProcesses{s}" for s in ("_v3", "_v2", "")}
    with pytest.raises(NvmlMismatch, match="compute process list") as exc:
        NvmlProbe().read()
    assert "nvidia-ml-py" in exc.value.hint


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_library_or_driver_is_no_gpu_found(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    fake = FakeDriver(monkeypatch, Device())
    fake.init_error = code
    with pytest.raises(NoGpuFound, match="no NVIDIA driver") as exc:
        NvmlProbe().read()
    assert "--probe sim" in exc.value.hint


def test_other_init_errors_are_probe_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, Device())
    fake.init_error = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    with pytest.raises(ProbeError, match="failed to initialise") as exc:
        NvmlProbe().read()
    assert not isinstance(exc.value, NoGpuFound)
    assert "reboot" in exc.value.hint


def test_no_devices_is_no_gpu_found(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch)
    with pytest.raises(NoGpuFound, match="no GPU"):
        NvmlProbe().read()
    assert fake.calls["nvmlShutdown"] == 1


def test_close_shuts_down_once_and_read_reopens(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDriver(monkeypatch, Device())
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


# --- the reported cases, from the driver to the decision -------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    memory_mib: int | None
    priority: int = 50
    health_timeout_s: float = 600.0
    devices: tuple[int, ...] | None = None

    @property
    def keywords(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def default_match(self) -> bool:
        return True


def _decide(reading: Any, spec: _Spec) -> Any:
    from gpuctl.core.decision import Health, classify
    from gpuctl.core.snapshot import snapshot_from_reading

    snap = snapshot_from_reading(reading, taken_at="t")
    return classify(spec, Health("refused"), snap, others=[])


def test_mig_memory_no_process_accounts_for_is_not_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG device at 30 of 80 GiB whose process reports no memory gave FITS for an
    80 GiB service; the 30 GiB are held, so it is BUSY, and 50 GiB still fits."""
    dev = Device(memory=(30 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, None)])
    FakeDriver(monkeypatch, dev)
    reading = NvmlProbe().read()
    v = _decide(reading, _Spec("llm", 80 * 1024))
    assert v.decision.value == "BUSY", v.reason
    assert "30.0 GiB no process accounts for" in v.reason
    assert _decide(reading, _Spec("small", 50 * 1024)).decision.value == "FITS"


def test_two_gpus_at_70_and_10_do_not_make_80_free(monkeypatch: pytest.MonkeyPatch) -> None:
    d0 = Device(memory=(70 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, 70 * GIB)])
    d1 = Device(memory=(10 * GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID + 1, 10 * GIB)])
    FakeDriver(monkeypatch, d0, d1)
    reading = NvmlProbe().read()
    assert (reading.memory_used_mib, reading.memory_total_mib) == (80 * 1024, 160 * 1024)
    v = _decide(reading, _Spec("llm", 80 * 1024))
    assert v.decision.value == "BUSY", v.reason
    v = _decide(reading, _Spec("mid", 60 * 1024))
    assert (v.decision.value, v.gpu) == ("FITS", 1)


def test_a_lost_gpu_makes_unpinned_services_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, Device(), Device(memory=pynvml.NVML_ERROR_GPU_IS_LOST))
    reading = NvmlProbe().read()
    assert _decide(reading, _Spec("any", 1024)).decision.value == "UNKNOWN"
    assert _decide(reading, _Spec("pinned", 1024, devices=(0,))).decision.value == "IDLE"
    assert _decide(reading, _Spec("there", 1024, devices=(1,))).decision.value == "UNKNOWN"


def test_a_gpu_without_a_handle_is_unknown_the_others_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU that fell off the bus before NVML started has no handle at all."""
    good = Device(memory=(GIB, 80 * GIB)).with_("Compute", [proc(NO_SUCH_PID, GIB)])
    fake = FakeDriver(monkeypatch, good, Device())
    fake.handle_errors = {1: pynvml.NVML_ERROR_GPU_IS_LOST}
    probe = NvmlProbe()
    r = probe.read()
    assert r.devices[0].readable and r.devices[0].memory_used_mib == 1024
    assert r.devices[1].error is not None and "GPU 1 is lost" in r.devices[1].error
    fake.handle_errors = {}
    assert all(d.readable for d in probe.read().devices)  # enumerated again: back
    assert fake.calls["nvmlInit"] == 2
    # Every handle lost: no reading.
    fake.handle_errors = {0: pynvml.NVML_ERROR_GPU_IS_LOST, 1: pynvml.NVML_ERROR_GPU_IS_LOST}
    with pytest.raises(ProbeError, match="is lost"):
        NvmlProbe().read()


def test_memory_used_with_no_process_listed_is_held_not_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MIG's hidden processes, or a container without --pid=host: 40 of 80 GiB used and
    no process listed gave IDLE and is_idle true. Beyond the driver's reserve it is
    held: 20 GiB is FITS beside it (and says so), 60 GiB is BUSY, nothing is IDLE."""
    from gpuctl.core.snapshot import snapshot_from_reading

    FakeDriver(monkeypatch, Device(memory=(40 * GIB, 80 * GIB)))
    reading = NvmlProbe().read()
    assert reading.processes == ()
    assert snapshot_from_reading(reading, taken_at="t").is_idle is False
    v = _decide(reading, _Spec("mid", 20 * 1024))
    assert v.decision.value == "FITS", v.reason
    assert "40.0 GiB no process accounts for" in v.reason
    v = _decide(reading, _Spec("big", 60 * 1024))
    assert v.decision.value == "BUSY", v.reason
    # The driver's own few hundred MiB (memory info v1 on an idle board) are no holder.
    FakeDriver(monkeypatch, Device(memory=(614 * MIB, 80 * GIB)))
    reading = NvmlProbe().read()
    assert snapshot_from_reading(reading, taken_at="t").is_idle is True
    assert _decide(reading, _Spec("mid", 20 * 1024)).decision.value == "IDLE"


# --- MIG ------------------------------------------------------------------------------------


def mig_h100() -> Device:
    """An H100 with MIG on: the parent says 68.8 GiB free, but its largest instance (GI 1,
    40 GiB) has 28.7 GiB free, held by a process whose memory MIG does not tell, and
    the two 20 GiB instances (GI 2 and 3) are empty."""
    gi1 = Device(memory=(int(11.3 * GIB), 40 * GIB), uuid="MIG-1", gi=1).with_(
        "Compute", [proc(NO_SUCH_PID, None)]
    )
    gi2 = Device(memory=(17 * MIB, 20 * GIB), uuid="MIG-2", gi=2)
    gi3 = Device(memory=(26 * MIB, 20 * GIB), uuid="MIG-3", gi=3)
    return Device(memory=(int(11.2 * GIB), 80 * GIB), mig=[gi1, gi2, gi3])


def test_mig_instances_are_read_per_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, mig_h100())
    r = NvmlProbe().read()
    (d,) = r.devices
    assert [(m.id, m.uuid, m.memory_used_mib, m.memory_total_mib) for m in d.mig] == [
        (1, "MIG-1", 11571, 40960),
        (2, "MIG-2", 17, 20480),
        (3, "MIG-3", 26, 20480),
    ]
    assert (d.memory_used_mib, d.memory_total_mib) == (11468, 81920)  # the parent's, shown
    [p] = r.processes
    assert (p.pid, p.memory_mib, p.gpu, p.mig) == (NO_SUCH_PID, None, 0, 1)


def test_mig_a_service_fits_on_one_instance_not_on_the_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """35 GiB was FITS on the parent's 68.8 GiB free, though no instance has it: it is
    BUSY. What fits goes on the instance it fits most tightly, and says which."""
    FakeDriver(monkeypatch, mig_h100())
    reading = NvmlProbe().read()
    v = _decide(reading, _Spec("big", 35 * 1024))
    assert v.decision.value == "BUSY", v.reason
    assert "28.7 GiB of 40.0 GiB free on any MIG instance or GPU" in v.reason
    assert "(most on GPU 0 (MIG instance 1))" in v.reason
    v = _decide(reading, _Spec("mid", 25 * 1024))
    assert (v.decision.value, v.gpu) == ("FITS", 0), v.reason
    assert "on GPU 0 (MIG instance 1)" in v.reason
    assert "11.3 GiB no process accounts for" in v.reason
    # 15 GiB: the tightest fit is GI 3 (26 MiB of the driver's own used there, vs 17).
    v = _decide(reading, _Spec("small", 15 * 1024))
    assert v.decision.value == "FITS" and "(MIG instance 3)" in v.reason, v.reason


def test_mig_devices_0_means_any_instance_of_gpu_0(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, mig_h100(), Device(memory=(0, 80 * GIB)))
    reading = NvmlProbe().read()
    v = _decide(reading, _Spec("pinned", 25 * 1024, devices=(0,)))
    assert v.decision.value == "FITS" and "GPU 0 (MIG instance 1)" in v.reason, v.reason
    v = _decide(reading, _Spec("pinned", 35 * 1024, devices=(0,)))
    assert v.decision.value == "BUSY", v.reason
    # Unpinned, it goes where it fits whole: GPU 1 (MIG off).
    v = _decide(reading, _Spec("any", 35 * 1024))
    assert (v.decision.value, v.gpu) == ("FITS", 1), v.reason


def test_mig_hidden_memory_in_an_instance_is_not_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG's hidden processes: an instance 30 GiB used with no process listed, the
    parent's own figure small. Not idle, and that instance is held."""
    from gpuctl.core.snapshot import snapshot_from_reading

    gi1 = Device(memory=(30 * GIB, 40 * GIB), gi=1)
    gi2 = Device(memory=(17 * MIB, 40 * GIB), gi=2)
    FakeDriver(monkeypatch, Device(memory=(59 * MIB, 80 * GIB), mig=[gi1, gi2]))
    reading = NvmlProbe().read()
    assert reading.processes == ()
    assert snapshot_from_reading(reading, taken_at="t").is_idle is False
    v = _decide(reading, _Spec("mid", 20 * 1024))
    assert v.decision.value == "FITS" and "(MIG instance 2)" in v.reason, v.reason
    assert _decide(reading, _Spec("big", 41 * 1024)).decision.value == "BUSY"


def test_mig_on_with_no_instance_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(monkeypatch, Device(), Device(memory=(0, 80 * GIB), mig=[]))
    reading = NvmlProbe().read()
    assert reading.devices[1].error is not None and "no MIG instance" in reading.devices[1].error
    assert _decide(reading, _Spec("any", 1024)).decision.value == "UNKNOWN"


def test_mig_instance_process_list_refused_is_that_gpu_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a container without NVIDIA_MIG_MONITOR_DEVICES=all: no permission per instance."""
    gi1 = Device(memory=(GIB, 40 * GIB), gi=1).with_("Compute", pynvml.NVML_ERROR_NO_PERMISSION)
    FakeDriver(monkeypatch, Device(), Device(memory=(GIB, 80 * GIB), mig=[gi1]))
    r = NvmlProbe().read()
    assert r.devices[1].error is not None and "MIG instance 1" in r.devices[1].error
    assert any("NVIDIA_MIG_MONITOR_DEVICES" in n for n in r.notes)
