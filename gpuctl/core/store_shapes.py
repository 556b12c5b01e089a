"""The store's shapes, each declared once as a msgspec Struct: a record and what it holds
(a lease, a failure, a promise), a set-aside record file, a voided lease, a wait-queue
entry.

Each is declared here with its bounds (``Annotated[..., Meta(...)]``); the rest is
generated from them:

- the record file codec's field tables (``gpuctl.adapters.store.codec``, ``_fields_of``),
  the checks, the store's own stdlib ones, and a field's default the value a reader fills
  in where a file an older release wrote lacks it;
- the agent's OpenAPI components (``gpuctl.agent.openapi_records``), where the store
  writes every field, so an answer's schema requires them all.

A rule a Struct cannot say (a promise's GPUs are each listed once; a run job's handle
carries its budget) is the codec's, named there as an override.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, get_args

from msgspec import Meta, Struct

from gpuctl.core.names import NAME_PATTERN
from gpuctl.core.pids import PID_MAX
from gpuctl.core.promise import MAX_DEVICE_INDEX
from gpuctl.core.queue import PRIORITY_MAX, QUEUE_TTL_MAX_S
from gpuctl.core.record import DURATION_MAX, RECORD_SCHEMA, TIME_MAX, Phase

__all__ = [
    "ENTRY_ID",
    "MAX_ATTEMPTS_READ",
    "MEMORY_MAX_MIB",
    "QUEUE_TTL_MAX_S",
    "SEQ_MAX",
    "VOIDED_KINDS",
    "EntryId",
    "Failure",
    "HostKey",
    "Lease",
    "Nonce",
    "Pid",
    "Promise",
    "QueueLease",
    "Record",
    "ServiceName",
    "SetAside",
    "Time",
    "Url",
    "Voided",
    "Waiter",
]

MAX_ATTEMPTS_READ: Final = 64
TEXT_MAX: Final = 64 * 1024  # an error message, a log tail, as a record file may hold it
COUNT_MAX: Final = 2**31 - 1
MEMORY_MAX_MIB: Final = 1 << 40
SEQ_MAX: Final = 2**53

Pid = Annotated[int, Meta(ge=1, le=PID_MAX, description="A process id (1 … PID_MAX_LIMIT).")]
Time = Annotated[float, Meta(ge=0, le=TIME_MAX, description="Seconds since the epoch.")]
Priority = Annotated[
    int, Meta(ge=-PRIORITY_MAX, le=PRIORITY_MAX, description="Higher is served first.")
]
Nonce = Annotated[
    str,
    Meta(
        min_length=8,
        max_length=64,
        pattern="^[0-9a-f]{8,64}$",
        description="The nonce a start puts in its server's environment.",
    ),
]
# \x1c-\x1f and \x85 spelled out, as Python's \s holds them and JSON Schema's (ECMA's)
# does not.
Url = Annotated[
    str,
    Meta(
        min_length=8,
        max_length=2048,
        pattern=r"^[hH][tT][tT][pP][sS]?://[^\s\x1c-\x1f\x85/?#]+[^\s\x1c-\x1f\x85]*$",
        description="The URL that tells the server answers (http or https).",
    ),
]
ServiceName = Annotated[
    str,
    Meta(min_length=1, max_length=101, pattern=NAME_PATTERN, description="A service's name."),
]
# A pool host by identity (``core.pool.host_key``): hex of a digest of its agent's
# hostname, boot id and state folder, the same whatever a config calls the host.
HostKey = Annotated[
    str,
    Meta(
        min_length=32,
        max_length=32,
        pattern="^[0-9a-f]{32}$",
        description="A host by identity: a digest of its hostname, boot id and state folder.",
    ),
]
# An in-flight or queue entry's holder id names its file: letters and digits only
# (gpuctl's are uuid hex). JSON Schema's ``$`` ends the text; Python matches it in full.
ENTRY_ID: Final = re.compile(r"[A-Za-z0-9]{1,64}")
EntryId = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=f"^{ENTRY_ID.pattern}$",
        description="The holder's id: it names the entry's file (uuid hex does).",
    ),
]


class Lease(Struct, forbid_unknown_fields=True, kw_only=True):
    """The right to start (or stop) a service; only the holder launches."""

    holder: Annotated[
        str, Meta(min_length=1, max_length=128, description="The holder's id (Holder.id).")
    ]
    host: Annotated[str, Meta(max_length=255, description="The holder's hostname.")]
    boot_id: Annotated[str, Meta(max_length=64, description="The holder's kernel boot id.")]
    pid: Pid
    pid_start: (
        Annotated[
            float,
            Meta(
                ge=0,
                le=TIME_MAX,
                description="The holder process's start time: a reused pid is not it.",
            ),
        ]
        | None
    ) = None
    entry: Annotated[str, Meta(max_length=64, description="ensure, proxy, cron, …")]
    granted: Time
    expires: Time


class QueueLease(Lease, kw_only=True):
    """Who waits in the queue, as a lease: ``expires`` is its heartbeat's term."""

    holder: EntryId


class Failure(Struct, forbid_unknown_fields=True):
    """A failed start: when, why, and the back-off before the next one."""

    at: Time
    error: Annotated[str, Meta(max_length=TEXT_MAX)] = ""
    log_tail: Annotated[str, Meta(max_length=TEXT_MAX)] = ""
    count: Annotated[int, Meta(ge=1, le=COUNT_MAX, description="Consecutive failed starts.")] = 1
    backoff_until: Annotated[
        float,
        Meta(
            ge=0,
            le=TIME_MAX,
            description="No new start before this (10 s, doubling, at most 300 s).",
        ),
    ] = 0.0


Budget = Annotated[int, Meta(ge=1, le=MEMORY_MAX_MIB, description="A memory budget in MiB.")]
Seconds = Annotated[float, Meta(ge=0, le=DURATION_MAX)]


class Promise(Struct, forbid_unknown_fields=True):
    """What a start promises the host, written with its lease: every client counts the
    service at these figures, whatever its own config says of it (``core.promise``)."""

    memory_mib: Annotated[Budget | None, Meta(description="Its memory budget in MiB; null: none.")]
    priority: Priority
    devices: Annotated[
        Annotated[
            list[Annotated[int, Meta(ge=0, le=MAX_DEVICE_INDEX)]],
            Meta(min_length=1, max_length=MAX_DEVICE_INDEX + 1),
        ]
        | None,
        Meta(description="The GPUs it may land on, each once; null: any one."),
    ] = None
    kind: Literal["server", "batch"] = "server"
    resume: bool = False
    health_timeout_s: Seconds = 600.0
    yield_after_s: Annotated[
        Seconds | None,
        Meta(description="Unused this long, it yields to a preempting start; null: never."),
    ] = None


# The record file's schema version (``core.record.RECORD_SCHEMA``), as a type.
RecordSchema = Literal[1]
assert get_args(RecordSchema) == (RECORD_SCHEMA,), "RecordSchema names RECORD_SCHEMA"


class Record(Struct, forbid_unknown_fields=True, kw_only=True):
    """A service's record on this host: its phase, lease, handle and history."""

    schema: RecordSchema = 1
    service: ServiceName
    phase: Phase = Phase.STOPPED
    since: Annotated[float, Meta(ge=0, le=TIME_MAX, description="When the phase last changed.")] = (
        0.0
    )
    last_used: Annotated[Time | None, Meta(description="When it was last used.")] = None
    lease: Annotated[
        Lease | None,
        Meta(description="A live lease, else null (expired and void ones read as null)."),
    ] = None
    handle: Annotated[
        dict[str, Any] | None,
        Meta(description="What the launcher needs to find the server again (a Handle)."),
    ] = None
    attempts: Annotated[
        list[dict[str, Any]],
        Meta(max_length=MAX_ATTEMPTS_READ, description="The last start attempts (Attempt each)."),
    ] = []
    failure: Failure | None = None
    recovered: Annotated[
        Annotated[str, Meta(max_length=4096)] | None,
        Meta(description="Set once when a broken record file was set aside."),
    ] = None
    start_nonce: Annotated[
        Nonce | None, Meta(description="The last start's GPUCTL_START_NONCE (finds its server).")
    ] = None
    health: Url | None = None
    promise: Annotated[
        Promise | None,
        Meta(description="What its last start promised; null from an older release."),
    ] = None
    runs_on: Annotated[
        HostKey | None,
        Meta(
            description="A pool's record on its coordinator (`_pool.<service>`): the host "
            "its copy was started on, by identity; null elsewhere."
        ),
    ] = None


class SetAside(Struct, forbid_unknown_fields=True):
    """A record file that failed validation, kept beside the records."""

    service: Annotated[str, Meta(min_length=1, max_length=255)]
    file: Annotated[str, Meta(min_length=1, max_length=300, description="Its name in records/.")]
    at: Annotated[float, Meta(ge=0, le=TIME_MAX, description="When it was set aside.")]
    size: Annotated[int, Meta(ge=0, le=2**62)]
    why: Annotated[str, Meta(max_length=4096, description="Where it failed the schema.")]


VoidedKind = Literal["lease", "inflight", "queue", "more"]
VOIDED_KINDS: Final[tuple[str, ...]] = get_args(VoidedKind)


class Voided(Struct, forbid_unknown_fields=True):
    """A lease or entry found forged (`gpuctl locks` shows it)."""

    kind: VoidedKind
    service: Annotated[str, Meta(min_length=1, max_length=255)]
    file: Annotated[
        str, Meta(min_length=1, max_length=300, description="Where it is, under the state folder.")
    ]
    host: Annotated[str, Meta(max_length=255, description="Its holder's.")]
    pid: Annotated[int, Meta(ge=0, le=PID_MAX)]
    at: Annotated[float, Meta(ge=0, le=TIME_MAX, description="When it was set aside (or granted).")]
    why: Annotated[str, Meta(max_length=4096)]


class Waiter(Struct, forbid_unknown_fields=True):
    """One caller in the wait queue (``core.queue.Waiter``)."""

    name: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=101,
            pattern=NAME_PATTERN,
            description="The job's record name (run.<name>).",
        ),
    ]
    priority: Priority
    memory_mib: Annotated[int, Meta(ge=1, le=MEMORY_MAX_MIB)]
    seq: Annotated[
        int,
        Meta(
            ge=1,
            le=SEQ_MAX,
            description="Arrival order on this host (first come, first served among equal "
            "priorities).",
        ),
    ]
    since: Annotated[float, Meta(ge=0, le=TIME_MAX, description="When it joined.")]
    holder: QueueLease
