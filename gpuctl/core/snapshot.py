"""What a reading of a host holds (the snapshot: its GPUs, their processes, the host's
identity), shared by every layer, and the agent's wire format (``GET /status``).

``Snapshot.to_wire`` writes the body of ``GET /status``; the Structs of
``gpuctl.core.status_wire`` declare it, and its ``parse_status`` validates strictly: an
agent that answers something else is treated as unavailable (UNKNOWN), never as an idle GPU.

Memory is per GPU (``GpuDevice``): a service fits on one device, so summing devices
would let two half-free GPUs look like one free one. The host-wide figures
(``memory_used_mib``, ``memory_total_mib``) stay for the original API's clients; they
are sums over the devices that could be read.

Unknown stays None, never 0: a utilisation, temperature or memory figure that the
driver did not give is None on the wire and "?" on screen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec.structs import replace

STATUS_SCHEMA = 1

# Memory a GPU reports in use with no process on it that is still not anybody's: the
# driver's own. Memory info v2 reports 0 MiB used on an idle H100, H200 and L40S, and
# 17-26 MiB on an idle MIG instance (tests/fixtures/nvidia-smi); v1, which drivers
# before 510 answer (gpustat #141), adds the driver's reserve, 434-614 MiB on those
# boards. 1 GiB covers both with room to spare, and is less than any model server
# holds: memory beyond it that no listed process accounts for is some process's we
# cannot see (another PID namespace, a MIG instance hidden from us), so it is held.
DRIVER_RESERVE_MIB = 1024


class GpuProcess(msgspec.Struct, frozen=True):
    """One process that holds GPU memory.

    ``command`` is None when it cannot be read (another PID namespace, no permission);
    such a process stays in the list with its memory. ``memory_mib`` is None where NVML
    cannot tell (WDDM, some MIG setups). ``on_gpu`` False marks an entry the agent adds
    for the original API's clients (a server of ours that has no CUDA context yet): it
    holds nothing, and gpuctl's own accounting skips it (it reads ``starting``).
    ``sm_util_pct`` is the process's share of the streaming multiprocessors over the
    last second, where NVML gives it.
    """

    pid: int
    command: str | None
    memory_mib: int | None
    user: str | None = None
    container: str | None = None
    gpu: int = 0
    on_gpu: bool = True
    sm_util_pct: int | None = None
    # The MIG instance (its GPU instance id) the process runs in; None: MIG is off, or
    # the driver did not say (then it may be on any instance of its GPU).
    mig: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "command": self.command,
            "memory_mib": self.memory_mib,
            "user": self.user,
            "container": self.container,
            "gpu": self.gpu,
            "on_gpu": self.on_gpu,
            "sm_util_pct": self.sm_util_pct,
            "mig": self.mig,
        }


class MigInstance(msgspec.Struct, frozen=True):
    """One MIG instance of a GPU with MIG on: memory is its own (a process sees only its
    instance's), so admission counts each instance apart, as one small GPU."""

    id: int  # the GPU instance id (nvidia-smi's "GI ID")
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    uuid: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "uuid": self.uuid,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
        }


class GpuDevice(msgspec.Struct, frozen=True):
    """One GPU as a probe saw it.

    ``error`` is set when this GPU could not be read (lost, no permission, its process
    list unsupported): its memory and processes are then unknown, and nothing may be
    decided about it. ``unified`` is true only for a device that says it has no memory
    figure of its own (GB10); its total comes from the config or MemTotal and its "used"
    is what its processes hold.
    """

    index: int
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    unified: bool = False
    name: str | None = None
    uuid: str | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    error: str | None = None
    # MIG on: its instances, each its own memory (empty: MIG off). The device's own
    # figures stay for the view and the host's sums; admission reads the instances.
    mig: tuple[MigInstance, ...] = ()

    @property
    def readable(self) -> bool:
        return self.error is None

    def to_wire(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "unified": self.unified,
            "utilization_pct": self.utilization_pct,
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "error": self.error,
            "mig": [m.to_wire() for m in self.mig],
        }


class StartingProcess(msgspec.Struct, frozen=True):
    """A host process whose command line matches a service keyword but is not on the GPU yet."""

    pid: int
    command: str
    user: str | None = None
    # Seconds since it started, on the host's own clock (no skew with the caller's).
    age_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "command": self.command, "user": self.user, "age_s": self.age_s}


class HostIdentity(msgspec.Struct, frozen=True):
    """Who a machine is: its hostname and the kernel's boot id (a reboot changes it)."""

    hostname: str
    boot_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "boot_id": self.boot_id}


class Snapshot(msgspec.Struct, frozen=True):
    """What a probe saw on one GPU host at one moment.

    ``devices`` holds the per-GPU figures that admission uses. ``memory_total_mib`` and
    ``memory_used_mib`` are their sums over the readable devices (the original API's
    fields); the total is None when no device and no config can tell.
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
    devices: tuple[GpuDevice, ...] = ()
    # (pid, service) for the servers the host's records name (by handle or start nonce)
    # and the processes they forked: the agent knows them on its host; a client knows
    # only the handles' pids.
    servers: tuple[tuple[int, str], ...] = ()
    # What the probe wants a person to know about this reading (a simulated GPU whose
    # gpu.json overrides the total asked for, NVML read through nvidia-smi): shown by
    # `gpuctl status`, never part of a decision.
    notes: tuple[str, ...] = ()
    # The host's store promises the GPU though no process shows it yet: a lease is held
    # (a start between taking it and its server existing, a stop whose memory has not
    # come back) or a record says ``starting``. The agent sets it from the records at
    # each answer; parsed back, it is an agent's ``is_idle: false`` that nothing listed
    # explains. Only ``is_idle`` reads it (gpuctl's own decisions read the records).
    promised: bool = False

    @property
    def is_idle(self) -> bool:
        """Nothing holds or is about to hold any GPU: no process listed, every GPU read,
        no memory beyond the driver's reserve that no process accounts for (a process we
        cannot see holds it), and no lease or ``starting`` record (``promised``)."""
        return (
            not self.processes
            and not self.promised
            and all(
                d.readable
                and all(
                    used is not None and used <= DRIVER_RESERVE_MIB
                    for used in (d.memory_used_mib, *(m.memory_used_mib for m in d.mig))
                )
                for d in self.devices
            )
        )

    @property
    def gpu_processes(self) -> tuple[GpuProcess, ...]:
        """The processes that hold GPU memory (not the agent's ``on_gpu: false`` entries)."""
        return tuple(p for p in self.processes if p.on_gpu)

    def device_list(self) -> tuple[GpuDevice, ...]:
        """The per-GPU figures; an agent too old to send them gives one device of the
        host's figures, or, with several GPUs, devices that cannot be told apart."""
        if self.devices:
            return self.devices
        if self.gpus <= 1:
            return (
                GpuDevice(
                    0, self.memory_used_mib, self.memory_total_mib, unified=self.unified_memory
                ),
            )
        why = "the agent reports no per-GPU memory (upgrade it)"
        return tuple(GpuDevice(i, error=why) for i in range(self.gpus))

    def device(self, index: int) -> GpuDevice | None:
        return next((d for d in self.device_list() if d.index == index), None)

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
            "devices": [d.to_wire() for d in self.devices],
            "processes": [p.to_wire() for p in self.processes],
            "host": self.host.to_wire() if self.host else None,
            "state_dir": self.state_dir,
            "servers": [{"pid": pid, "service": name} for pid, name in self.servers],
            "notes": list(self.notes),
        }
        if self.starting is not None:
            out["starting"] = [s.to_wire() for s in self.starting]
        return out


class ProbeReading(msgspec.Struct, frozen=True):
    """What a GPU probe returns before the agent adds host identity and ``starting``.

    ``devices`` are the per-GPU figures (empty from a probe that only knows host-wide
    ones: then one device of those). ``memory_total_mib``/``memory_used_mib`` are the
    host-wide sums, None where the device cannot tell (GB10 unified memory answers
    "Not Supported"). Build one from devices with ``ProbeReading.of_devices``.
    """

    probe: str
    processes: tuple[GpuProcess, ...]
    memory_used_mib: int | None
    memory_total_mib: int | None
    unified_memory: bool = False
    gpus: int = 1
    notes: tuple[str, ...] = msgspec.field(default=())
    devices: tuple[GpuDevice, ...] = ()

    @classmethod
    def of_devices(
        cls,
        probe: str,
        processes: Sequence[GpuProcess],
        devices: Sequence[GpuDevice],
        notes: Sequence[str] = (),
    ) -> ProbeReading:
        """A reading whose host-wide figures are the sums over the readable devices."""
        used, total = _sums(devices)
        return cls(
            probe=probe,
            processes=tuple(processes),
            memory_used_mib=used,
            memory_total_mib=total,
            unified_memory=any(d.unified for d in devices),
            gpus=len(devices),
            notes=tuple(notes),
            devices=tuple(devices),
        )

    def device_list(self) -> tuple[GpuDevice, ...]:
        if self.devices:
            return self.devices
        return tuple(
            GpuDevice(
                i,
                self.memory_used_mib if self.gpus == 1 else None,
                self.memory_total_mib if self.gpus == 1 else None,
                unified=self.unified_memory,
            )
            for i in range(max(self.gpus, 1))
        )


def _sums(devices: Sequence[GpuDevice]) -> tuple[int | None, int | None]:
    readable = [d for d in devices if d.readable]
    used = [d.memory_used_mib for d in readable]
    total = [d.memory_total_mib for d in readable]
    return (
        sum(u for u in used if u is not None) if readable and None not in used else None,
        sum(t for t in total if t is not None) if readable and None not in total else None,
    )


def device_figures(reading: ProbeReading, gpu_memory_mib: int | None) -> tuple[GpuDevice, ...]:
    """Each device with the one rule every observer applies to its memory.

    Where a device gives no "used" (unified memory), what its processes hold is the truth
    (host RAM use would count the OS as GPU use, nvtop #511), so one of them whose memory
    is unknown makes the device's unknown; where it gives no total, the configured
    ``gpu_memory_mib`` stands in. An unreadable device stays unknown.
    """
    out = []
    for d in reading.device_list():
        if not d.readable:
            out.append(d)
            continue
        used = d.memory_used_mib
        if used is None:
            mine = [p for p in reading.processes if p.gpu == d.index and p.on_gpu]
            unknown = [p.pid for p in mine if p.memory_mib is None]
            if unknown:
                why = (
                    f"unified memory: the driver does not say how much pid {unknown[0]} "
                    "holds, so its free memory is unknown"
                )
                out.append(replace(d, error=why))
                continue
            used = sum(p.memory_mib or 0 for p in mine)
        total = d.memory_total_mib if d.memory_total_mib is not None else gpu_memory_mib
        out.append(replace(d, memory_used_mib=used, memory_total_mib=total))
    return tuple(out)


def reading_memory(reading: ProbeReading, gpu_memory_mib: int | None) -> tuple[int, int | None]:
    """(used, total-or-None) MiB of a reading, host-wide: the sums of ``device_figures``
    over the readable devices."""
    used, total = _sums(device_figures(reading, gpu_memory_mib))
    return used or 0, total


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
    devices = device_figures(reading, gpu_memory_mib)
    used, total = _sums(devices)
    if starting is not None:
        on_gpu = {p.pid for p in reading.processes if p.on_gpu}
        starting = tuple(s for s in starting if s.pid not in on_gpu)
    return Snapshot(
        memory_used_mib=used if used is not None else 0,
        memory_total_mib=total,
        unified_memory=any(d.unified for d in devices),
        probe=reading.probe,
        taken_at=taken_at,
        processes=reading.processes,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpus=len(devices),
        devices=devices,
        notes=reading.notes,
    )
