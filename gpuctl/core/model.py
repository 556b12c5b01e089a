"""Plain data shared by every layer, and the agent's wire format (DESIGN §5).

``Snapshot.to_wire`` / ``Snapshot.from_wire`` are the contract of ``GET /status``.
``from_wire`` validates strictly: an agent that answers something else is treated as
unavailable (UNKNOWN), never as an idle GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATUS_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process that holds GPU memory.

    ``command`` is None when it cannot be read (another PID namespace, no permission);
    such a process stays in the list with its memory. ``memory_mib`` is None where NVML
    cannot tell (WDDM, some MIG setups).
    """

    pid: int
    command: str | None
    memory_mib: int | None
    user: str | None = None
    container: str | None = None
    gpu: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "command": self.command,
            "memory_mib": self.memory_mib,
            "user": self.user,
            "container": self.container,
            "gpu": self.gpu,
        }


@dataclass(frozen=True, slots=True)
class StartingProcess:
    """A host process whose command line matches a service keyword but is not on the GPU yet."""

    pid: int
    command: str
    user: str | None = None
    # Seconds since it started, on the host's own clock (no skew with the caller's).
    age_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "command": self.command, "user": self.user, "age_s": self.age_s}


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """Who a machine is: its hostname and the kernel's boot id (a reboot changes it)."""

    hostname: str
    boot_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "boot_id": self.boot_id}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a probe saw on one GPU host at one moment.

    ``memory_total_mib`` is None when neither the device nor the config can tell.
    ``memory_used_mib`` is the device figure, or the sum of the processes where the
    device does not report one (unified memory).
    """

    memory_used_mib: int | None
    memory_total_mib: int | None
    unified_memory: bool
    probe: str
    taken_at: str
    processes: tuple[GpuProcess, ...] = ()
    starting: tuple[StartingProcess, ...] | None = None
    host: HostIdentity | None = None
    state_dir: str | None = None
    gpus: int = 1

    @property
    def is_idle(self) -> bool:
        return not self.processes

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": STATUS_SCHEMA,
            "is_idle": self.is_idle,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "unified_memory": self.unified_memory,
            "probe": self.probe,
            "taken_at": self.taken_at,
            "gpus": self.gpus,
            "processes": [p.to_wire() for p in self.processes],
            "host": self.host.to_wire() if self.host else None,
            "state_dir": self.state_dir,
        }
        if self.starting is not None:
            out["starting"] = [s.to_wire() for s in self.starting]
        return out

    @classmethod
    def from_wire(cls, data: object) -> Snapshot:
        """Parse an agent's ``/status`` body. Raises ValueError naming the first bad field."""
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        procs_raw = _req(data, "processes", list)
        processes = tuple(_proc(p, i) for i, p in enumerate(procs_raw))
        is_idle = _req(data, "is_idle", bool)
        if is_idle != (not processes):
            raise ValueError("is_idle disagrees with processes")
        starting: tuple[StartingProcess, ...] | None = None
        if data.get("starting") is not None:
            starting = tuple(_starting(s, i) for i, s in enumerate(_req(data, "starting", list)))
        host = None
        if isinstance(data.get("host"), dict):
            h = data["host"]
            host = HostIdentity(
                hostname=str(h.get("hostname", "")), boot_id=str(h.get("boot_id", ""))
            )
        return cls(
            memory_used_mib=_opt_int(data, "memory_used_mib"),
            memory_total_mib=_opt_int(data, "memory_total_mib"),
            unified_memory=bool(data.get("unified_memory", False)),
            probe=str(data.get("probe", "?")),
            taken_at=str(data.get("taken_at", "")),
            processes=processes,
            starting=starting,
            host=host,
            state_dir=data.get("state_dir") if isinstance(data.get("state_dir"), str) else None,
            gpus=data["gpus"] if isinstance(data.get("gpus"), int) else 1,
        )


def _req(d: dict[str, Any], key: str, typ: type) -> Any:
    if key not in d:
        raise ValueError(f"missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ValueError(f"field {key!r} should be {typ.__name__}, got {type(v).__name__}")
    return v


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"field {key!r} should be a number or null")
    return int(v)


def _proc(p: object, i: int) -> GpuProcess:
    if not isinstance(p, dict):
        raise ValueError(f"processes[{i}] should be an object")
    try:
        pid = _req(p, "pid", int)
    except ValueError as e:
        raise ValueError(f"processes[{i}]: {e}") from None
    cmd = p.get("command")
    user = p.get("user")
    ctr = p.get("container")
    gpu = p.get("gpu", 0)
    return GpuProcess(
        pid=pid,
        command=cmd if isinstance(cmd, str) else None,
        memory_mib=_opt_int(p, "memory_mib"),
        user=user if isinstance(user, str) else None,
        container=ctr if isinstance(ctr, str) else None,
        gpu=gpu if isinstance(gpu, int) else 0,
    )


def _starting(s: object, i: int) -> StartingProcess:
    if not isinstance(s, dict):
        raise ValueError(f"starting[{i}] should be an object")
    try:
        pid = _req(s, "pid", int)
        cmd = _req(s, "command", str)
    except ValueError as e:
        raise ValueError(f"starting[{i}]: {e}") from None
    user = s.get("user")
    age = s.get("age_s")
    return StartingProcess(
        pid=pid,
        command=cmd,
        user=user if isinstance(user, str) else None,
        age_s=float(age) if isinstance(age, int | float) and not isinstance(age, bool) else None,
    )


@dataclass(frozen=True, slots=True)
class ProbeReading:
    """What a GPU probe returns before the agent adds host identity and ``starting``.

    ``memory_total_mib``/``memory_used_mib`` are None where the device cannot tell
    (GB10 unified memory answers "Not Supported").
    """

    probe: str
    processes: tuple[GpuProcess, ...]
    memory_used_mib: int | None
    memory_total_mib: int | None
    unified_memory: bool = False
    gpus: int = 1
    notes: tuple[str, ...] = field(default=())


def reading_memory(reading: ProbeReading, gpu_memory_mib: int | None) -> tuple[int, int | None]:
    """(used, total-or-None) MiB of a reading, the one rule every observer applies.

    Where the device gives no "used" (unified memory), the processes' sum is the truth
    (host RAM use would count the OS as GPU use, nvtop #511); where it gives no total,
    the configured ``gpu_memory_mib`` stands in.
    """
    used = reading.memory_used_mib
    if used is None:
        used = sum(p.memory_mib or 0 for p in reading.processes)
    total = reading.memory_total_mib
    if total is None:
        total = gpu_memory_mib
    return used, total


def snapshot_from_reading(
    reading: ProbeReading,
    *,
    taken_at: str,
    starting: tuple[StartingProcess, ...] | None = None,
    host: HostIdentity | None = None,
    state_dir: str | None = None,
    gpu_memory_mib: int | None = None,
) -> Snapshot:
    """The one way from a probe reading to a ``Snapshot``: the agent's ``/status`` and the
    direct (agent-less) path both build theirs here, so they cannot disagree.

    ``starting`` None means "not asked"; processes already on the GPU are dropped from it.
    """
    used, total = reading_memory(reading, gpu_memory_mib)
    if starting is not None:
        on_gpu = {p.pid for p in reading.processes}
        starting = tuple(s for s in starting if s.pid not in on_gpu)
    return Snapshot(
        memory_used_mib=used,
        memory_total_mib=total,
        unified_memory=reading.unified_memory,
        probe=reading.probe,
        taken_at=taken_at,
        processes=reading.processes,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpus=reading.gpus,
    )
