"""The ``nvidia-smi`` probe: the CSV fallback where NVML cannot be loaded from Python.

It runs two queries, each under a timeout (a hung driver makes ``nvidia-smi`` hang):

    nvidia-smi --query-gpu=index,uuid,memory.total,memory.used,name,utilization.gpu,\
        temperature.gpu,power.draw --format=csv,noheader,nounits
    nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits

Fields can read ``[N/A]``, ``[Not Supported]``, ``Not Supported`` or ``[Insufficient
Permissions]``; GB10 (unified memory) reports ``[N/A]`` for device memory while
``used_memory`` per process is real. The unified-memory rules are those of the NVML probe.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

import msgspec

from gpuctl.adapters.probes.common import (
    describe_processes,
    larger,
    memory_problem,
    unified_device,
    valid_pid,
)
from gpuctl.core.snapshot import GpuDevice, ProbeReading
from gpuctl.errors import NoGpuFound, ProbeError

GPU_COLUMNS = ("index", "uuid", "memory.total", "memory.used")
# What the view shows beside memory; each may read [N/A] (MIG has no utilisation) and
# then stays unknown.
EXTRA_COLUMNS = ("name", "utilization.gpu", "temperature.gpu", "power.draw")
QUERY_COLUMNS = GPU_COLUMNS + EXTRA_COLUMNS
APP_COLUMNS = ("gpu_uuid", "pid", "used_memory")
# Other names nvidia-smi accepts (and prints in headers) for the same field.
_ALIASES = {"used_gpu_memory": "used_memory", "memory_used": "used_memory"}
_NOT_AVAILABLE = {"n/a", "not supported", "insufficient permissions", "unknown error", ""}


class SmiGpu(msgspec.Struct, frozen=True):
    """One row of ``--query-gpu``; memory is None where nvidia-smi says N/A."""

    index: int
    uuid: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    # What nvidia-smi printed instead of a memory figure when that is an error
    # ("[Insufficient Permissions]", "[Unknown Error]"), not "this device has none" (N/A).
    memory_error: str | None = None
    name: str | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None


class SmiApp(msgspec.Struct, frozen=True):
    """One row of ``--query-compute-apps``."""

    gpu_uuid: str
    pid: int
    memory_mib: int | None


def parse_query_gpu(text: str, columns: Sequence[str] = GPU_COLUMNS) -> list[SmiGpu]:
    """Parse ``--query-gpu`` CSV (with or without header and units).

    Args:
        text: the output.
        columns: the fields as requested, in order; a header line overrides them.
            A missing ``index`` is the row number, a missing ``uuid`` is empty.

    Raises:
        ValueError: a row that does not fit the columns, or a number that is not one.
    """
    rows = []
    for n, row in enumerate(_rows(text, columns, QUERY_COLUMNS)):
        index = _int(row.get("index", ""), "index")
        raw = [row.get("memory.total", ""), row.get("memory.used", "")]
        errors = [v.strip() for v in raw if _is_error(v)]
        rows.append(
            SmiGpu(
                index=n if index is None else index,
                uuid=row.get("uuid", ""),
                memory_total_mib=_int(raw[0], "memory.total"),
                memory_used_mib=_int(raw[1], "memory.used"),
                memory_error=errors[0] if errors else None,
                name=_text(row.get("name", "")),
                utilization_pct=_optional(row.get("utilization.gpu", ""), int, 0, 100),
                temperature_c=_optional(row.get("temperature.gpu", ""), int, -273, 1000),
                power_w=_optional(row.get("power.draw", ""), float, 0, 1e5),
            )
        )
    return rows


def parse_compute_apps(text: str, columns: Sequence[str] = APP_COLUMNS) -> list[SmiApp]:
    """Parse ``--query-compute-apps`` CSV (with or without header and units).

    Args:
        text: the output.
        columns: the fields as requested, in order; a header line overrides them.

    Raises:
        ValueError: a row that does not fit, or a pid that is not a number: a process
            we cannot name still holds memory, so it must not vanish silently.
    """
    apps = []
    for row in _rows(text, columns, APP_COLUMNS):
        pid = _int(row.get("pid", ""), "pid")
        if pid is None:
            raise ValueError(f"unreadable pid {row.get('pid')!r}")
        apps.append(
            SmiApp(
                gpu_uuid=row.get("gpu_uuid", row.get("uuid", "")),
                pid=pid,
                memory_mib=_int(row.get("used_memory", ""), "used_memory"),
            )
        )
    return apps


def _rows(text: str, columns: Sequence[str], known: Sequence[str]) -> list[dict[str, str]]:
    """Rows as {column: field}; a line naming one of the ``known`` columns is a header."""
    names = [_column(c) for c in columns]
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line.lower().startswith("no running processes"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if any(_column(f) in known for f in fields):
            names = [_column(f) for f in fields]  # a header: "memory.total [MiB]" -> memory.total
            continue
        if len(fields) != len(names):
            raise ValueError(f"expected {len(names)} fields ({', '.join(names)}), got: {line!r}")
        out.append(dict(zip(names, fields, strict=True)))
    return out


def _column(name: str) -> str:
    base = name.split("[", 1)[0].strip().lower()
    return _ALIASES.get(base, base)


def _text(value: str) -> str | None:
    v = value.strip()
    return None if not v or v.startswith("[") or v.lower() in _NOT_AVAILABLE else v


def _optional(value: str, kind: type, low: float, high: float) -> Any:
    """A figure for the view (utilisation, temperature, power): None where nvidia-smi
    prints N/A or something that is not a number in range; unknown is never 0."""
    v = value.strip()
    for unit in ("%", "W", "C"):
        v = v.removesuffix(unit).strip()
    if not v or v.startswith("[") or v.lower() in _NOT_AVAILABLE:
        return None
    try:
        number = float(v)
    except ValueError:
        return None
    if not math.isfinite(number) or not low <= number <= high:
        return None
    return kind(number) if kind is float else round(number)


def _is_error(value: str) -> bool:
    """A field that says reading failed, as opposed to N/A or Not Supported (GB10)."""
    v = value.strip().strip("[]").strip().lower()
    return v in ("insufficient permissions", "unknown error") or v.startswith("gpu is lost")


def _int(value: str, column: str) -> int | None:
    v = value.strip()
    if v.startswith("[") or v.lower() in _NOT_AVAILABLE:
        return None
    if v.endswith("MiB"):  # --format=csv without nounits
        v = v[:-3].strip()
    try:
        number = int(v)
    except ValueError:
        raise ValueError(f"{column}: not a number: {value!r}") from None
    if number < 0:  # a size or a pid is never negative: garbage, not a reading
        raise ValueError(f"{column}: negative: {value!r}")
    return number


class NvidiaSmiProbe:
    """Reads the GPUs by running ``nvidia-smi``.

    Args:
        binary: the ``nvidia-smi`` to run (a name on PATH, or a path).
        timeout_s: how long one query may take.
        gpu_memory_mib: the total to report for unified memory; None means MemTotal.
    """

    name = "nvidia-smi"

    def __init__(
        self, binary: str = "nvidia-smi", timeout_s: float = 5.0, gpu_memory_mib: int | None = None
    ) -> None:
        self._binary = binary
        self._timeout_s = timeout_s
        self._gpu_memory_mib = gpu_memory_mib

    def close(self) -> None:
        """Nothing to release: every read runs its own process."""

    def read(self) -> ProbeReading:
        """Run both queries and combine them.

        Raises:
            NoGpuFound: the binary does not exist.
            ProbeError: it hung, failed, or printed something we cannot parse.
        """
        gpu_text = self._run("--query-gpu=" + ",".join(QUERY_COLUMNS))
        app_text = self._run("--query-compute-apps=" + ",".join(APP_COLUMNS))
        try:
            gpus = parse_query_gpu(gpu_text, QUERY_COLUMNS)
            apps = parse_compute_apps(app_text)
        except ValueError as e:
            raise ProbeError(f"unexpected nvidia-smi output: {e}") from e
        if not gpus:
            raise NoGpuFound("nvidia-smi lists no GPU", hint="check `nvidia-smi -L`")
        notes: list[str] = []
        index_of = {g.uuid: g.index for g in gpus}
        merged: dict[tuple[int, int], int | None] = {}
        for app in apps:
            if not valid_pid(app.pid):
                notes.append(f"dropped invalid pid {app.pid}")
                continue
            gpu = index_of.get(app.gpu_uuid)
            if gpu is None:  # a GPU that appeared between the two queries
                gpu = gpus[0].index
                notes.append(f"pid {app.pid}: unknown GPU {app.gpu_uuid!r}, shown on GPU {gpu}")
            key = (gpu, app.pid)
            merged[key] = larger(merged[key], app.memory_mib) if key in merged else app.memory_mib
        processes = describe_processes(merged)
        devices = []
        for g in gpus:
            if g.memory_error is not None:
                devices.append(
                    GpuDevice(g.index, uuid=g.uuid, error=f"nvidia-smi: {g.memory_error}")
                )
                continue
            problem = (
                memory_problem(g.memory_used_mib, g.memory_total_mib)
                if g.memory_used_mib is not None and g.memory_total_mib is not None
                else None
            )
            if problem:
                error = f"GPU {g.index}'s memory is unknown: {problem}"
                devices.append(GpuDevice(g.index, name=g.name, uuid=g.uuid, error=error))
                continue
            device = GpuDevice(
                g.index,
                g.memory_used_mib,
                g.memory_total_mib,
                name=g.name,
                uuid=g.uuid,
                utilization_pct=g.utilization_pct,
                temperature_c=g.temperature_c,
                power_w=g.power_w,
            )
            # GB10 prints [N/A]: that device is unified. (A total of 0 is not: see
            # memory_problem.)
            if g.memory_total_mib is None or g.memory_used_mib is None:
                device, note = unified_device(device, processes, self._gpu_memory_mib)
                notes.append(note)
            devices.append(device)
        if all(not d.readable for d in devices):
            raise ProbeError(
                f"nvidia-smi cannot read any GPU's memory ({devices[0].error})",
                hint="in a container: --pid=host (and NVIDIA_MIG_MONITOR_DEVICES=all on MIG)",
            )
        return ProbeReading.of_devices(self.name, processes, devices, notes)

    def _run(self, query: str) -> str:
        argv = [self._binary, query, "--format=csv,noheader,nounits"]
        name = os.path.basename(self._binary)
        try:
            # Own session: on timeout we kill the whole group, wrappers included.
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            raise NoGpuFound(
                f"{self._binary} not found",
                hint="install the NVIDIA driver; try `gpuctl demo`, or `--probe sim`",
            ) from e
        except OSError as e:
            raise ProbeError(f"cannot run {self._binary}: {e}") from e
        try:
            out, err = proc.communicate(timeout=self._timeout_s)
        except subprocess.TimeoutExpired as e:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            # A process stuck in the driver (state D) dies only when it leaves it: do not
            # wait for it beyond a moment, the caller must not hang with it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1.0)
            raise ProbeError(
                f"{name} did not answer within {self._timeout_s:g}s",
                hint="the driver may be hung or slow to initialise (enable persistence mode)",
            ) from e
        if proc.returncode != 0:
            lines = (err.strip() or out.strip()).splitlines()
            first = lines[0].strip() if lines else "(no message)"
            raise ProbeError(f"{name} failed (exit {proc.returncode}): {first}")
        return out
