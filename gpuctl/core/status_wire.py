"""The agent's ``GET /status`` body, declared once: the Structs below are what the agent
serves (``Snapshot.to_wire``), what a client accepts (``parse_status``) and, through
``msgspec.json.schema_components``, the ``Status`` components of the agent's OpenAPI
document.

Every value an agent (or something pretending to be one) sends is checked: pids in
range, sizes non-negative integers below an exbibyte, percentages 0-100, flags exact
booleans (a ``"no"`` is not false). A body that fails is not a reading: the caller
reports the host UNKNOWN, never idle. Errors name the place (``processes[2].memory_mib:
...``). Keys an older agent does not send have defaults; keys a newer one adds are
ignored.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct
from msgspec.structs import replace

from gpuctl.core import snapshot as model
from gpuctl.core.names import NAME_PATTERN, is_valid_name
from gpuctl.core.pids import PID_MAX
from gpuctl.core.snapshot import STATUS_SCHEMA, Snapshot

__all__ = ["STATUS_COMPONENTS", "Status", "parse_status"]

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

Pid = Annotated[int, Meta(gt=0, lt=PID_MAX)]
Mib = Annotated[int, Meta(ge=0, le=MAX_MIB)]
Pct = Annotated[int, Meta(ge=0, le=100)]
GpuIndex = Annotated[int, Meta(ge=0, lt=MAX_GPUS)]
MigId = Annotated[int, Meta(ge=0, lt=MAX_MIG)]


class GpuProcess(Struct):
    """A process that holds GPU memory (or, ``on_gpu`` false, a server of ours that
    holds none yet)."""

    pid: Pid
    command: Annotated[
        str | None,
        Meta(
            description="Full command line (secret-looking values redacted); null where it "
            "cannot be read."
        ),
    ] = None
    memory_mib: Annotated[Mib | None, Meta(description="null where the driver cannot tell.")] = None
    user: str | None = None
    container: Annotated[str | None, Meta(description="Container id, null for a host process.")] = (
        None
    )
    gpu: Annotated[GpuIndex, Meta(description="The GPU's index.")] = 0
    on_gpu: Annotated[
        bool,
        Meta(
            description="false for a server of ours that holds no GPU memory yet (listed "
            "for clients that classify by processes)."
        ),
    ] = True
    sm_util_pct: Annotated[
        Pct | None, Meta(description="SM utilisation over the last second; null: unknown.")
    ] = None
    mig: Annotated[
        MigId | None,
        Meta(
            description="The MIG instance (GPU instance id) it runs in; null with MIG off, "
            "or where the driver does not say."
        ),
    ] = None


class MigInstance(Struct):
    """One MIG instance of a GPU with MIG on: its memory is its own."""

    id: Annotated[MigId, Meta(description="The GPU instance id.")]
    uuid: str | None = None
    memory_used_mib: Mib | None = None
    memory_total_mib: Mib | None = None


class GpuDevice(Struct):
    """One GPU as the probe saw it; null figures are unknown, never 0."""

    index: GpuIndex
    name: str | None = None
    uuid: str | None = None
    memory_used_mib: Mib | None = None
    memory_total_mib: Mib | None = None
    unified: Annotated[
        bool, Meta(description="The device has no memory figure of its own (GB10).")
    ] = False
    utilization_pct: Annotated[Pct | None, Meta(description="null: unknown.")] = None
    temperature_c: Annotated[
        Annotated[int, Meta(ge=-273, le=1000)] | None, Meta(description="null: unknown.")
    ] = None
    power_w: Annotated[
        Annotated[float, Meta(ge=0, le=1e6)] | None, Meta(description="null: unknown.")
    ] = None
    error: Annotated[
        str | None, Meta(description="Why this GPU could not be read; null when it was.")
    ] = None
    mig: Annotated[
        Annotated[list[MigInstance], Meta(max_length=MAX_MIG)] | None,
        Meta(
            description="With MIG on, its instances: a service fits on one instance (a "
            "service's devices = [0] means any instance of GPU 0), and the device's own "
            "memory figures are not admitted on. Empty with MIG off."
        ),
    ] = None


class StartingProcess(Struct):
    """A host process whose command line holds a ``match`` keyword, not on the GPU yet."""

    pid: Pid
    command: str
    user: str | None = None
    age_s: Annotated[
        Annotated[float, Meta(ge=-1e12, le=1e12)] | None,
        Meta(description="Seconds since it started, on the host's own clock."),
    ] = None


class HostIdentity(Struct):
    """Who the agent's machine is: a reboot changes its boot id."""

    hostname: str = ""
    boot_id: str = ""


class Server(Struct):
    """A server process the host's records name, and its service."""

    pid: Pid
    service: Annotated[str, Meta(pattern=NAME_PATTERN)]


class Status(Struct):
    """What the probe saw (``GET /status``)."""

    processes: list[GpuProcess]
    is_idle: Annotated[
        bool,
        Meta(
            description="True only when `processes` is empty, every GPU could be read, no "
            "GPU holds more than the driver's reserve (1024 MiB) that no process accounts "
            "for, and no record of the host's store holds a lease or says `starting` (read "
            "at each answer). So it can be false with `processes` empty: a start between "
            "taking its lease and its server existing, or memory held by processes this "
            "agent cannot see (MIG, another PID namespace)."
        ),
    ]
    schema: Annotated[int, Meta(extra_json_schema={"const": STATUS_SCHEMA})] = STATUS_SCHEMA
    memory_used_mib: Mib | None = None
    memory_total_mib: Annotated[
        Mib | None, Meta(description="From the device, else the configured --gpu-memory.")
    ] = None
    unified_memory: bool = False
    probe: Annotated[str, Meta(examples=["nvml", "nvidia-smi", "sim"])] = "?"
    taken_at: Annotated[
        str,
        Meta(
            description="UTC, e.g. 2026-11-29T10:00:00Z.", extra_json_schema={"format": "date-time"}
        ),
    ] = ""
    gpus: Annotated[int, Meta(ge=0, le=MAX_GPUS)] | None = None
    devices: Annotated[
        Annotated[list[GpuDevice], Meta(max_length=MAX_GPUS)] | None,
        Meta(
            description="Per GPU: a service fits on one GPU, so admission reads these; the "
            "memory fields above are their sums over readable GPUs."
        ),
    ] = None
    host: HostIdentity | None = None
    state_dir: str | None = None
    starting: Annotated[
        list[StartingProcess] | None,
        Meta(description="With ?match= only: matching, not on the GPU yet."),
    ] = None
    servers: Annotated[
        Annotated[list[Server], Meta(max_length=MAX_SERVERS)] | None,
        Meta(
            description="Whose each server process is: the pids the records name (by the "
            "launcher's handle, or a start's GPUCTL_START_NONCE in /proc/<pid>/environ) and "
            "the processes they forked, whatever their command lines say."
        ),
    ] = None
    notes: Annotated[
        Annotated[list[str], Meta(max_length=MAX_NOTES)] | None,
        Meta(
            description="What the probe wants a person to know about this reading, e.g. a "
            "simulated GPU whose gpu.json is not the --gpu-memory asked for. Never part of "
            "a decision."
        ),
    ] = None


# The top-level Structs of the wire; the OpenAPI document takes their components.
STATUS_COMPONENTS = (Status,)


def parse_status(data: object) -> Snapshot:
    """Parse an agent's ``/status`` body. Raises ValueError naming the first bad place."""
    try:
        s = msgspec.convert(data, Status, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(_located(str(e))) from None
    processes = tuple(
        model.GpuProcess(
            pid=p.pid,
            command=p.command,
            memory_mib=p.memory_mib,
            user=p.user,
            container=p.container,
            gpu=p.gpu,
            on_gpu=p.on_gpu,
            sm_util_pct=p.sm_util_pct,
            mig=p.mig,
        )
        for p in s.processes
    )
    devices = tuple(
        model.GpuDevice(
            index=d.index,
            memory_used_mib=d.memory_used_mib,
            memory_total_mib=d.memory_total_mib,
            unified=d.unified,
            name=d.name,
            uuid=d.uuid,
            utilization_pct=d.utilization_pct,
            temperature_c=d.temperature_c,
            power_w=d.power_w,
            error=d.error,
            mig=tuple(
                model.MigInstance(m.id, m.memory_used_mib, m.memory_total_mib, m.uuid)
                for m in d.mig or ()
            ),
        )
        for d in s.devices or ()
    )
    # Idle with a process listed or a GPU unread is a lie; not idle with nothing listed
    # is the agent's to say (its store promises the GPU, or memory no process accounts
    # for is held), and ``promised`` keeps that word. An older agent's "idle" beside
    # unattributed memory is accepted, and the Snapshot, counting that memory, is not idle.
    if s.is_idle and not (not processes and all(d.readable for d in devices)):
        raise ValueError("is_idle disagrees with processes")
    # The schema's pattern is searched (``$`` passes a trailing newline): the one name
    # rule decides.
    for i, srv in enumerate(s.servers or ()):
        if not is_valid_name(srv.service):
            raise ValueError(f"servers[{i}].service: not a service name: {srv.service[:40]!r}")
    snap = Snapshot(
        memory_used_mib=s.memory_used_mib,
        memory_total_mib=s.memory_total_mib,
        unified_memory=s.unified_memory,
        probe=s.probe,
        taken_at=s.taken_at,
        processes=processes,
        starting=None
        if s.starting is None
        else tuple(
            model.StartingProcess(pid=x.pid, command=x.command, user=x.user, age_s=x.age_s)
            for x in s.starting
        ),
        host=model.HostIdentity(s.host.hostname, s.host.boot_id) if s.host else None,
        state_dir=s.state_dir,
        gpus=len(devices) if devices else (s.gpus if s.gpus is not None else 1),
        devices=devices,
        servers=tuple((e.pid, e.service) for e in s.servers or ()),
        notes=tuple(n[:MAX_NOTE_CHARS] for n in s.notes or ()),
    )
    return replace(snap, promised=True) if not s.is_idle and snap.is_idle else snap


def _located(message: str) -> str:
    """msgspec's ``Expected ... - at `$.a[0].b``` as ``a[0].b: Expected ...``."""
    what, sep, where = message.rpartition(" - at `$")
    if not sep:
        return message
    return f"{where.rstrip('`').lstrip('.')}: {what}"
