"""Parsing the agent's ``GET /status`` body into a ``Snapshot``, strictly.

Every value an agent (or something pretending to be one) sends is checked: pids in
range, sizes finite and non-negative, percentages 0-100, flags exact booleans (a
``"no"`` is not false). A body that fails is not a reading: the caller reports the host
UNKNOWN, never idle. Errors name the field (``processes[2].memory_mib``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gpuctl.core.names import is_valid_name
from gpuctl.core.pids import PID_MAX
from gpuctl.core.snapshot import (
    GpuDevice,
    GpuProcess,
    HostIdentity,
    MigInstance,
    Snapshot,
    StartingProcess,
)

# A MiB figure beyond an exbibyte is not memory, it is garbage (or 1e308).
MAX_MIB = 2**40
MAX_GPUS = 1024
# NVML's largest MIG layout has 7 instances; GPU instance ids stay small.
MAX_MIG = 64
# Recorded servers and their children: a host runs a handful of services.
MAX_SERVERS = 65536
# A probe's notes are a few lines for a person; a longer one is cut, more of them refused.
MAX_NOTES = 64
MAX_NOTE_CHARS = 1000


def parse_status(data: object) -> Snapshot:
    """Parse an agent's ``/status`` body. Raises ValueError naming the first bad field."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    procs_raw = _req(data, "processes", list)
    processes = tuple(_proc(p, f"processes[{i}]") for i, p in enumerate(procs_raw))
    devices: tuple[GpuDevice, ...] = ()
    if data.get("devices") is not None:
        raw = _req(data, "devices", list)
        if len(raw) > MAX_GPUS:
            raise ValueError(f"devices: more than {MAX_GPUS} GPUs")
        devices = tuple(_device(d, f"devices[{i}]") for i, d in enumerate(raw))
    is_idle = _req(data, "is_idle", bool)
    # Idle with a process listed or a GPU unread is a lie; not idle with nothing listed
    # is the agent's to say (its store promises the GPU, or memory no process accounts
    # for is held), and ``promised`` keeps that word. An older agent's "idle" beside
    # unattributed memory is accepted, and the Snapshot, counting that memory, is not idle.
    if is_idle and not (not processes and all(d.readable for d in devices)):
        raise ValueError("is_idle disagrees with processes")
    starting: tuple[StartingProcess, ...] | None = None
    if data.get("starting") is not None:
        starting = tuple(
            _starting(s, f"starting[{i}]") for i, s in enumerate(_req(data, "starting", list))
        )
    host = None
    if isinstance(data.get("host"), dict):
        h = data["host"]
        host = HostIdentity(hostname=str(h.get("hostname", "")), boot_id=str(h.get("boot_id", "")))
    gpus = _int(data, "gpus", "gpus", 0, MAX_GPUS)
    unified = data.get("unified_memory", False)
    if not isinstance(unified, bool):
        raise ValueError("unified_memory: should be true or false")
    servers: tuple[tuple[int, str], ...] = ()
    if data.get("servers") is not None:
        raw_servers = _req(data, "servers", list)
        if len(raw_servers) > MAX_SERVERS:
            raise ValueError(f"servers: more than {MAX_SERVERS} entries")
        servers = tuple(_server(e, f"servers[{i}]") for i, e in enumerate(raw_servers))
    notes: tuple[str, ...] = ()
    if data.get("notes") is not None:  # absent from agents before it
        raw_notes = _req(data, "notes", list)
        if len(raw_notes) > MAX_NOTES:
            raise ValueError(f"notes: more than {MAX_NOTES} entries")
        for i, n in enumerate(raw_notes):
            if not isinstance(n, str):
                raise ValueError(f"notes[{i}] should be a string, got {type(n).__name__}")
        notes = tuple(n[:MAX_NOTE_CHARS] for n in raw_notes)
    snap = Snapshot(
        memory_used_mib=_mib(data, "memory_used_mib", "memory_used_mib"),
        memory_total_mib=_mib(data, "memory_total_mib", "memory_total_mib"),
        unified_memory=unified,
        probe=str(data.get("probe", "?")),
        taken_at=str(data.get("taken_at", "")),
        processes=processes,
        starting=starting,
        host=host,
        state_dir=data.get("state_dir") if isinstance(data.get("state_dir"), str) else None,
        gpus=len(devices) if devices else (gpus if gpus is not None else 1),
        devices=devices,
        servers=servers,
        notes=notes,
    )
    return replace(snap, promised=True) if not is_idle and snap.is_idle else snap


def _req(d: dict[str, Any], key: str, typ: type, within: str = "") -> Any:
    """A required field of exactly ``typ``; ``within`` names the enclosing object."""
    at = f"{within}: " if within else ""
    if key not in d:
        raise ValueError(f"{at}missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ValueError(f"{at}field {key!r} should be {typ.__name__}, got {type(v).__name__}")
    return v


def _number(d: dict[str, Any], key: str, where: str, low: float, high: float) -> float | None:
    """An optional finite number within [low, high]; None when absent or null."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"field {where!r} should be a number or null")
    if not math.isfinite(v) or not low <= v <= high:
        raise ValueError(f"field {where!r} is out of range: {v!r}")
    return float(v)


def _int(d: dict[str, Any], key: str, where: str, low: int, high: int) -> int | None:
    v = _number(d, key, where, low, high)
    return None if v is None else int(v)


def _mib(d: dict[str, Any], key: str, where: str) -> int | None:
    return _int(d, key, where, 0, MAX_MIB)


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else None


def _pid(d: dict[str, Any], where: str) -> int:
    pid: int = _req(d, "pid", int, where)
    if not 0 < pid < PID_MAX:
        raise ValueError(f"field '{where}.pid' is out of range: {pid}")
    return pid


def _proc(p: object, where: str) -> GpuProcess:
    if not isinstance(p, dict):
        raise ValueError(f"{where} should be an object")
    on_gpu = p.get("on_gpu", True)
    if not isinstance(on_gpu, bool):
        raise ValueError(f"field '{where}.on_gpu' should be true or false")
    gpu = _int(p, "gpu", f"{where}.gpu", 0, MAX_GPUS - 1)
    return GpuProcess(
        pid=_pid(p, where),
        command=_opt_str(p, "command"),
        memory_mib=_mib(p, "memory_mib", f"{where}.memory_mib"),
        user=_opt_str(p, "user"),
        container=_opt_str(p, "container"),
        gpu=gpu if gpu is not None else 0,
        on_gpu=on_gpu,
        sm_util_pct=_int(p, "sm_util_pct", f"{where}.sm_util_pct", 0, 100),
        mig=_int(p, "mig", f"{where}.mig", 0, MAX_MIG - 1),
    )


def _device(d: object, where: str) -> GpuDevice:
    if not isinstance(d, dict):
        raise ValueError(f"{where} should be an object")
    index: int = _req(d, "index", int, where)
    if not 0 <= index < MAX_GPUS:
        raise ValueError(f"field '{where}.index' is out of range: {index}")
    unified = d.get("unified", False)
    if not isinstance(unified, bool):
        raise ValueError(f"field '{where}.unified' should be true or false")
    error = d.get("error")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"field '{where}.error' should be a string or null")
    return GpuDevice(
        index=index,
        memory_used_mib=_mib(d, "memory_used_mib", f"{where}.memory_used_mib"),
        memory_total_mib=_mib(d, "memory_total_mib", f"{where}.memory_total_mib"),
        unified=unified,
        name=_opt_str(d, "name"),
        uuid=_opt_str(d, "uuid"),
        utilization_pct=_int(d, "utilization_pct", f"{where}.utilization_pct", 0, 100),
        temperature_c=_int(d, "temperature_c", f"{where}.temperature_c", -273, 1000),
        power_w=_number(d, "power_w", f"{where}.power_w", 0, 1e6),
        error=error,
        mig=_instances(d, where),
    )


def _instances(d: dict[str, Any], where: str) -> tuple[MigInstance, ...]:
    """A device's MIG instances (absent from agents before them: MIG off)."""
    if d.get("mig") is None:
        return ()
    raw = _req(d, "mig", list, where)
    if len(raw) > MAX_MIG:
        raise ValueError(f"{where}.mig: more than {MAX_MIG} instances")
    out = []
    for i, m in enumerate(raw):
        at = f"{where}.mig[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at} should be an object")
        ident: int = _req(m, "id", int, at)
        if not 0 <= ident < MAX_MIG:
            raise ValueError(f"field '{at}.id' is out of range: {ident}")
        out.append(
            MigInstance(
                id=ident,
                memory_used_mib=_mib(m, "memory_used_mib", f"{at}.memory_used_mib"),
                memory_total_mib=_mib(m, "memory_total_mib", f"{at}.memory_total_mib"),
                uuid=_opt_str(m, "uuid"),
            )
        )
    return tuple(out)


def _starting(s: object, where: str) -> StartingProcess:
    if not isinstance(s, dict):
        raise ValueError(f"{where} should be an object")
    cmd: str = _req(s, "command", str, where)
    return StartingProcess(
        pid=_pid(s, where),
        command=cmd,
        user=_opt_str(s, "user"),
        age_s=_number(s, "age_s", f"{where}.age_s", -1e12, 1e12),
    )


def _server(e: object, where: str) -> tuple[int, str]:
    if not isinstance(e, dict):
        raise ValueError(f"{where} should be an object")
    service: str = _req(e, "service", str, where)
    if not is_valid_name(service):
        raise ValueError(f"field '{where}.service' is not a service name: {service[:40]!r}")
    return _pid(e, where), service
