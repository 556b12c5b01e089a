"""The record's shapes on the wire, each declared once as a msgspec Struct.

A holder, a launcher's handle, a start attempt, a start failure, the record update and
the agent's request bodies (lease, renew, update, release, touch, in-flight, queue, job
stop) are declared here, with their bounds (``Annotated[..., Meta(...)]``); the store's
own shapes (a record, a lease, a promise, a waiter) are in ``core.store_shapes``, the
agent's answers in ``core.answer_shapes``. The rest is generated from them:

- the agent's request check decodes each body into its Struct (``gpuctl.agent.wire``);
- the agent's OpenAPI components are ``msgspec.json.schema_components`` of them
  (``gpuctl.agent.openapi_records``);
- the record file codec takes its holder, lease, handle and attempt tables from them
  (``gpuctl.adapters.store.codec``);
- a record update crosses the store as a ``RecordUpdate``, and ``apply_update`` applies it.

msgspec is a declaration library with no I/O, so the core may use it (``core/ruff.toml``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec.structs import replace

from gpuctl.core.names import NAME_PATTERN
from gpuctl.core.queue import PRIORITY_MAX, QUEUE_TTL_MAX_S
from gpuctl.core.record import (
    BACKOFF_FIRST_S,
    DURATION_MAX,
    INFLIGHT_TTL_MAX_S,
    LOG_TAIL_MAX,
    MAX_EXTRA_KEYS,
    Phase,
    Record,
    clip,
)
from gpuctl.core.record import (
    Holder as HolderValue,
)
from gpuctl.core.redact import redact_lines
from gpuctl.core.store_shapes import (
    MEMORY_MAX_MIB,
    EntryId,
    HostKey,
    Nonce,
    Pid,
    Promise,
    Time,
    Url,
)

__all__ = [
    "MAX_EPOCH_S",
    "MAX_EXTRA_TEXT",
    "MAX_GRACE_S",
    "MAX_SHORT_TEXT",
    "MAX_TEXT",
    "UNSET",
    "Attempt",
    "ExtraValue",
    "Handle",
    "Holder",
    "HolderUpdate",
    "InflightEnd",
    "InflightRequest",
    "JobStopRequest",
    "LeaseRequest",
    "QueueJoin",
    "QueueLeave",
    "RecordUpdate",
    "ReleaseRequest",
    "RenewRequest",
    "StartFailure",
    "TouchRequest",
    "UnsetType",
    "apply_update",
]

# A failure's error and log tail, an attempt's error: the store keeps no more than the
# last 16 KiB of a log tail, so a client clips to it (``RecordUpdate.fitted``).
MAX_TEXT: Final = LOG_TAIL_MAX
# A free value in a handle or an attempt (what a launcher adds): a name, a path.
MAX_EXTRA_TEXT: Final = 1024
# A holder's id where a body names it alone (renew, update, release).
MAX_SHORT_TEXT: Final = 256
# A lease's term: finite, at most a week.
MAX_TTL_S: Final = 7 * 24 * 3600.0
# Any time gpuctl writes is seconds since the epoch; 1e11 is the year 5138.
MAX_EPOCH_S: Final = 1e11
# The longest a job stop waits between SIGTERM and SIGKILL (``agent.job_stop``).
MAX_GRACE_S: Final = 300.0

Duration = Annotated[float, Meta(ge=-DURATION_MAX, le=DURATION_MAX)]
Ttl = Annotated[
    float,
    Meta(
        gt=0,
        le=MAX_TTL_S,
        description="Seconds until the lease expires by itself (finite, at most a week).",
    ),
]
HolderId = Annotated[
    str, Meta(min_length=1, max_length=MAX_SHORT_TEXT, description="The holder's id (Holder.id).")
]
Kind = Annotated[str, Meta(min_length=1, max_length=32)]
Short = Annotated[str, Meta(max_length=32)]
Name = Annotated[str, Meta(max_length=255)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
# A field of a handle or an attempt: a scalar, never a nest. One gpuctl does not read
# (``ExtraValue``) is a short text at most; the known ones are typed by their Struct.
FreeKey = Annotated[str, Meta(min_length=1, max_length=64)]
FreeValue = (
    None
    | bool
    | Annotated[int, Meta(ge=-(2**53), le=2**53)]
    | Annotated[float, Meta(ge=-1e15, le=1e15)]
    | Annotated[str, Meta(max_length=MAX_TEXT)]
)
ExtraValue = (
    None
    | bool
    | Annotated[int, Meta(ge=-(2**53), le=2**53)]
    | Annotated[float, Meta(ge=-1e15, le=1e15)]
    | Annotated[str, Meta(max_length=MAX_EXTRA_TEXT)]
)


class Holder(Struct, forbid_unknown_fields=True, kw_only=True):
    """Who asks for a lease: a fresh id per call, and its process (``core.record.Holder``)."""

    id: Annotated[str, Meta(min_length=1, max_length=128)]
    host: Name
    boot_id: Annotated[str, Meta(max_length=64)]
    pid: Pid
    pid_start: Time | None = None
    entry: Annotated[str, Meta(max_length=64)]

    def value(self) -> HolderValue:
        return HolderValue(self.id, self.host, self.boot_id, self.pid, self.pid_start, self.entry)


class Handle(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What the launcher needs to find its server again: the fields gpuctl reads. A
    handle may carry up to ``MAX_EXTRA_KEYS`` more (``FreeValue`` each)."""

    kind: Kind | UnsetType = UNSET
    pid: Pid | UnsetType | None = UNSET
    pid_start: Time | UnsetType | None = UNSET
    container_id: Annotated[str, Meta(max_length=128)] | UnsetType | None = UNSET
    container_name: Name | UnsetType | None = UNSET
    terminal: Name | UnsetType | None = UNSET
    log: Annotated[str, Meta(max_length=4096)] | UnsetType | None = UNSET
    # A namespace's inode number (32 bits on Linux); bounded as every JSON integer the
    # agent takes is (``agent.wire``: at most 2**53, what a double holds exactly).
    pid_ns: Annotated[int, Meta(ge=0, le=2**53)] | UnsetType | None = UNSET
    proof: Annotated[str, Meta(max_length=4096)] | UnsetType | None = UNSET
    # A Slurm job id (digits, or an array's ``12_3``).
    job_id: Annotated[str, Meta(max_length=64, pattern=r"^[0-9][0-9_+]*$")] | UnsetType | None = (
        UNSET
    )


class Attempt(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One start attempt, the starter's own note (``flows.ensure.launch._attempt``): the
    fields gpuctl reads. It may carry up to ``MAX_EXTRA_KEYS`` more."""

    started: Time | UnsetType = UNSET
    ended: Time | UnsetType = UNSET
    duration_s: Duration | UnsetType = UNSET
    launcher: Short | UnsetType = UNSET
    outcome: Short | UnsetType = UNSET
    error: Text | UnsetType | None = UNSET


class StartFailure(Struct, forbid_unknown_fields=True):
    """A failed start: phase failed, count + 1, a back-off."""

    error: Text = ""
    log_tail: Text = ""


FreeHandle = Annotated[
    dict[FreeKey, FreeValue],
    Meta(
        max_length=len(Handle.__struct_fields__) + MAX_EXTRA_KEYS,
        description="What the launcher needs to find its server again (a Handle).",
    ),
]
FreeAttempt = Annotated[
    dict[FreeKey, FreeValue],
    Meta(
        max_length=len(Attempt.__struct_fields__) + MAX_EXTRA_KEYS,
        description="Appended to the attempts (an Attempt).",
    ),
]
# The free objects and the Struct that types their known fields.
FREE_OBJECTS: Final[dict[str, type[Struct]]] = {"handle": Handle, "attempt": Attempt}


class RecordUpdate(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A holder's change to a record; every field is optional, and one left ``UNSET``
    changes nothing.

    ``phase``; ``handle`` (what the launcher needs to find its server; ``None`` clears
    it); ``attempt`` (appended to the attempts); ``failure`` (records a failed start with
    its back-off; ``None`` clears it); ``touch`` (last_used = now); ``start_nonce`` (the
    hex nonce a start puts in its server's environment; ``None`` clears it); ``health``
    (the URL the agent may poll to see the server answer; ``None`` clears it);
    ``runs_on`` (a pool's record: the host its copy was started on). On the
    wire it is a JSON object of the fields set (``to_wire``).
    """

    phase: Phase | UnsetType = UNSET
    handle: FreeHandle | UnsetType | None = UNSET
    attempt: FreeAttempt | UnsetType = UNSET
    failure: StartFailure | UnsetType | None = UNSET
    touch: bool = False
    start_nonce: Nonce | UnsetType | None = UNSET
    health: Url | UnsetType | None = UNSET
    runs_on: HostKey | UnsetType | None = UNSET

    def __bool__(self) -> bool:
        return self != _NOTHING

    @classmethod
    def from_wire(cls, data: Any) -> RecordUpdate:
        """The typed value of a JSON update, exact types (``"no"`` is not a boolean).

        Raises:
            ValueError: an unknown key or a bad value, naming where.
        """
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as err:
            raise ValueError(f"bad record update: {err}") from None

    def checked(self) -> RecordUpdate:
        """This update, checked against its declaration as the agent checks it (a Struct
        built in Python is not): ``"no"`` is no ``touch``.

        Raises:
            ValueError: ``update.touch: …``, naming the field. A value inside a handle or
                an attempt is left to the store's record check, which names its key.
        """
        try:
            msgspec.convert(msgspec.to_builtins(self), RecordUpdate, strict=True)
        except msgspec.ValidationError as err:
            text = str(err)
            if "[...]" in text:
                return self
            msg, _, path = text.partition(" - at `")
            raise ValueError(f"update{path.rstrip('`').removeprefix('$')}: {msg}") from None
        return self

    def to_wire(self) -> dict[str, Any]:
        """The JSON form: only the fields set (``touch`` only when true)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def fitted(self) -> RecordUpdate:
        """Cut to what the store keeps (a failure's error and log tail, an attempt's
        error, at most ``LOG_TAIL_MAX`` characters each): the agent's request schema
        allows no more, so a 60 KiB log tail still records the failure."""
        out = self
        f = self.failure
        if isinstance(f, StartFailure):
            fitted = StartFailure(f.error[:LOG_TAIL_MAX], f.log_tail[-LOG_TAIL_MAX:])
            out = msgspec.structs.replace(out, failure=fitted)
        a = self.attempt
        error = a.get("error") if isinstance(a, dict) else None
        if isinstance(a, dict) and isinstance(error, str):
            out = msgspec.structs.replace(out, attempt={**a, "error": error[:LOG_TAIL_MAX]})
        return out


_NOTHING: Final = RecordUpdate()


class LeaseRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/lease``: who asks, for how long, and what the start it
    is for promises (a ``Promise``, kept in the record; the store's schema checks it)."""

    holder: Holder
    ttl_s: Ttl
    promise: Annotated[
        Promise | None,
        Meta(description="What the start this lease is for promises (kept in the record)."),
    ] = None
    # The journal's event riding on this write: its own check (``core.events``) reads it.
    event: dict[str, Any] | UnsetType = UNSET


class RenewRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/lease/renew``: the holder's id and the new time to live."""

    holder: HolderId
    ttl_s: Ttl


class HolderUpdate(Struct, forbid_unknown_fields=True):
    """``PATCH /records/{service}``: who asks, and what changes."""

    holder: HolderId
    update: RecordUpdate
    # The journal's event riding on this write: its own check (``core.events``) reads it.
    event: dict[str, Any] | UnsetType = UNSET


class ReleaseRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/lease/release``: the holder's id and a last update."""

    holder: HolderId
    update: RecordUpdate | None = None
    # The journal's event riding on this write: its own check (``core.events``) reads it.
    event: dict[str, Any] | UnsetType = UNSET


class TouchRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/touch``: whether the caller saw it answer (an empty body
    is a plain touch)."""

    ready: Annotated[
        bool,
        Meta(
            description="The caller saw the server answer: a record still starting becomes "
            "running (a stopped one stays stopped)."
        ),
    ] = False
    promise: Annotated[
        Promise | None,
        Meta(
            description="The caller's figures for the service: written only into a record "
            "that has none (one an older release wrote)."
        ),
    ] = None


class EntryHolder(Holder, forbid_unknown_fields=True, kw_only=True):
    """A holder whose id names a file: an in-flight or queue entry's."""

    id: EntryId


# An in-flight or queue entry's holder, and its term: renewed while it lasts, so a
# longer one would keep a server from reclaim (or the queue's head waiting) for good.
EntryHolderField = Annotated[
    EntryHolder, Meta(description="As for a lease; the id names the entry's file.")
]
_LAPSES = "Seconds until the entry lapses unless renewed (at most {:g})."
InflightTtl = Annotated[
    float, Meta(gt=0, le=INFLIGHT_TTL_MAX_S, description=_LAPSES.format(INFLIGHT_TTL_MAX_S))
]
QueueTtl = Annotated[
    float, Meta(gt=0, le=QUEUE_TTL_MAX_S, description=_LAPSES.format(QUEUE_TTL_MAX_S))
]


class InflightRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/inflight`` (and ``…/renew``): who uses it, for how long
    at most. A longer term would keep a server from reclaim for good: its user renews
    it while the request runs."""

    holder: EntryHolderField
    ttl_s: InflightTtl


class InflightEnd(Struct, forbid_unknown_fields=True):
    """``POST /records/{service}/inflight/end``: the holder's id, and how long its entry
    stays as a lingering one (``core.record.LINGER_ENTRY``; 0: it goes now)."""

    holder: EntryId
    linger_s: Annotated[
        float,
        Meta(
            ge=0,
            le=INFLIGHT_TTL_MAX_S,
            description="Seconds the entry lingers: counted as no request in flight, "
            "but reclaim keeps the service, a preemption waits until it lapses, and "
            f"its holder may count itself again under a stop (at most {INFLIGHT_TTL_MAX_S:g}).",
        ),
    ] = 0.0


class QueueJoin(Struct, forbid_unknown_fields=True):
    """``POST /records/_queue``: who waits, for how long at most, and what."""

    holder: EntryHolderField
    ttl_s: QueueTtl
    name: Annotated[str, Meta(min_length=1, max_length=101, pattern=NAME_PATTERN)]
    priority: Annotated[int, Meta(ge=-PRIORITY_MAX, le=PRIORITY_MAX)]
    memory_mib: Annotated[int, Meta(ge=1, le=MEMORY_MAX_MIB)]


class QueueLeave(Struct, forbid_unknown_fields=True):
    """``POST /records/_queue/leave``: the holder's id."""

    holder: EntryId


class JobStopRequest(Struct, forbid_unknown_fields=True):
    """``POST /records/{job}/stop``: the lease holder, the job's pid and its start time as
    the record names them, and the grace period between SIGTERM and SIGKILL."""

    holder: HolderId
    pid: Pid
    pid_start: Annotated[
        float,
        Meta(
            ge=0,
            le=MAX_EPOCH_S,
            description="The pid's start time, as the job's record names it.",
        ),
    ]
    grace_s: (
        Annotated[
            float,
            Meta(
                ge=0,
                le=MAX_GRACE_S,
                description="Seconds between SIGTERM and SIGKILL (default 10).",
            ),
        ]
        | UnsetType
    ) = UNSET


def apply_update(
    record: Record, update: RecordUpdate, now: float, *, first_backoff_s: float = BACKOFF_FIRST_S
) -> Record:
    """Apply a holder's update to a record (the one patch language of both store paths).

    ``first_backoff_s``: the back-off after a first failure (``backoff_s``); the store
    passes 10 s unless a test shortened or lengthened it (``gpuctl.failpoints.seconds``).

    The store checks the result against its schema before it writes it
    (``gpuctl.adapters.store.codec``).
    """
    out = record
    if not isinstance(update.phase, UnsetType):
        out = out.with_phase(update.phase, now)
    if not isinstance(update.handle, UnsetType):
        out = replace(out, handle=update.handle)
    if not isinstance(update.attempt, UnsetType):
        out = out.with_attempt(_clipped(update.attempt))
    if update.failure is None:
        out = replace(out, failure=None)
    elif isinstance(update.failure, StartFailure):
        error, tail = update.failure.error, update.failure.log_tail
        # A server's log and error can echo its command line: its secrets stay out.
        out = out.failed(
            now, clip(redact_lines(error)), redact_lines(tail[-LOG_TAIL_MAX:]), first_backoff_s
        )
    if update.touch:
        out = out.touched(now)
    if not isinstance(update.start_nonce, UnsetType):
        out = replace(out, start_nonce=update.start_nonce)
    if not isinstance(update.health, UnsetType):
        out = replace(out, health=update.health)
    if not isinstance(update.runs_on, UnsetType):
        out = replace(out, runs_on=update.runs_on)
    return out


def _clipped(attempt: dict[str, Any]) -> dict[str, Any]:
    return {k: clip(redact_lines(v)) if isinstance(v, str) else v for k, v in attempt.items()}
