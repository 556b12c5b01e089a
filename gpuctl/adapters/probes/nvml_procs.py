"""NVML's running-process lists, read with the struct the driver really fills.

Driver 535.43 grew the ``_v3`` process struct by ``usedGpuCcProtectedMemory`` (32 bytes
instead of 24) without bumping the version; 535.98 dropped ``_v3``; 535.104.05 brought
it back with the 24-byte struct. A binding that assumes the wrong size reads every
entry after the first at the wrong offset, and a small confidential-computing memory
value then passes as a pid while a real process is lost.

So, as nvitop does (``nvitop/api/libnvml.py``), the struct is chosen by which functions
the driver exports, and the C function is called here with that struct:

* ``…RunningProcesses_v3`` with ``nvmlDeviceGetConfComputeMemSizeInfo`` but without
  ``nvmlDeviceGetRunningProcessDetailList`` is the 535.43-535.86 family: ``_v3`` with the
  32-byte struct;
* any other driver with ``_v3``: ``_v3`` with the 24-byte struct;
* no ``_v3`` (before 510.39): ``_v2`` with the 24-byte struct;
* neither (before 450.66): the unversioned call with the 16-byte struct.

Each layout's size is checked with ``ctypes.sizeof`` against the C header's, so a
platform whose padding differs fails loudly instead of reading garbage.
"""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec

_ULLONG_MAX = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE: "the driver cannot tell"


class ProcessInfoV1(ctypes.Structure):
    """``nvmlProcessInfo_v1_t``: 16 bytes."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfoV2(ctypes.Structure):
    """``nvmlProcessInfo_v2_t``: 24 bytes (also what ``_v3`` fills outside 535.43-535.86)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class ProcessInfoV3(ctypes.Structure):
    """``nvmlProcessInfo_v3_t`` of drivers 535.43-535.86: 32 bytes."""

    _fields_ = [
        *ProcessInfoV2._fields_,
        ("usedGpuCcProtectedMemory", ctypes.c_ulonglong),
    ]


# The sizes of the C header (8-byte alignment of the 64-bit members).
STRUCT_SIZES = {ProcessInfoV1: 16, ProcessInfoV2: 24, ProcessInfoV3: 32}


class ProcessCall(msgspec.Struct, frozen=True):
    """Which symbol suffix to call and which struct it fills."""

    suffix: str
    struct: type[ctypes.Structure]

    @property
    def label(self) -> str:
        return f"{self.suffix or 'v1'} ({ctypes.sizeof(self.struct)}-byte struct)"


def _has(nv: Any, symbol: str) -> bool:
    try:
        nv._nvmlGetFunctionPointer(symbol)
    except nv.NVMLError:
        return False
    return True


def choose_process_call(nv: Any) -> ProcessCall:
    """The process-list call this driver supports, by the functions it exports.

    Raises:
        RuntimeError: a struct's size differs from the C header's on this platform.
    """
    for struct, size in STRUCT_SIZES.items():
        if ctypes.sizeof(struct) != size:
            raise RuntimeError(
                f"{struct.__name__} is {ctypes.sizeof(struct)} bytes here, the driver's is {size}"
            )
    if _has(nv, "nvmlDeviceGetComputeRunningProcesses_v3"):
        cc_era = _has(nv, "nvmlDeviceGetConfComputeMemSizeInfo") and not _has(
            nv, "nvmlDeviceGetRunningProcessDetailList"
        )
        return ProcessCall("_v3", ProcessInfoV3 if cc_era else ProcessInfoV2)
    if _has(nv, "nvmlDeviceGetComputeRunningProcesses_v2"):
        return ProcessCall("_v2", ProcessInfoV2)
    return ProcessCall("", ProcessInfoV1)


def running_processes(
    nv: Any, handle: Any, kind: str, call: ProcessCall
) -> list[tuple[int, int | None]]:
    """(pid, used bytes or None) of one list: ``Compute``, ``Graphics`` or ``MPSCompute``.

    The two-call protocol of NVML: ask for the count with no buffer (SUCCESS means no
    process), then fill a buffer with room to spare for processes born in between.

    Raises:
        pynvml.NVMLError: the driver's answer (FUNCTION_NOT_FOUND when it lacks the list).
    """
    fn = nv._nvmlGetFunctionPointer(f"nvmlDeviceGet{kind}RunningProcesses{call.suffix}")
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == nv.NVML_SUCCESS:
        return []
    if ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
        raise nv.NVMLError(ret)
    count.value = count.value * 2 + 5
    buf = (call.struct * count.value)()
    ret = fn(handle, ctypes.byref(count), buf)
    if ret != nv.NVML_SUCCESS:
        raise nv.NVMLError(ret)
    out: list[tuple[int, int | None]] = []
    for entry in buf[: min(count.value, len(buf))]:
        used = int(entry.usedGpuMemory)
        out.append((int(entry.pid), None if used >= _ULLONG_MAX else used))
    return out
