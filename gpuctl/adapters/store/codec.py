"""Record files and wire bodies to ``core.record`` data and back, through one schema.

Every record is checked against the tables below when it is read (a file, an agent's
answer) and before it is written, so a record that a hostile or broken writer left
cannot make a reader crash, or lie: a pid of 2**31 that overflows ``kill()``, a NaN or
1e308 time that makes a lease never expire, a ``"no"`` that reads as true, 100,000
nested lists. The schema is declared once, below, as small field tables of the checks in
``schema``; each check returns the value or raises ``RecordError`` naming where it
failed (``at $.lease.pid: …``).

Every table is built from the shapes declared once as msgspec Structs
(``core.store_shapes``, ``core.record_shapes``; ``_fields_of``); the checks themselves
stay these small stdlib functions, which say where a file failed in the store's own
words. The few rules a Struct cannot say are overrides, named as such below: a
promise's GPUs each listed once, a run job's handle, the free keys of a handle or an
attempt, and ``salvage``.

Bounds (generous for what gpuctl writes, tight enough that nothing can overflow):

- pids 1 … 2**22 (``PID_MAX_LIMIT``, the most ``/proc/sys/kernel/pid_max`` can be);
- times (epoch seconds) 0 … 2100-01-01, finite; durations finite, within ±10 years;
- strings by field (service names as the agent's pattern, hex nonces, http(s) URLs);
  text that is not valid Unicode (lone surrogates) is refused;
- at most ``MAX_ATTEMPTS_READ`` attempts, ``MAX_EXTRA_KEYS`` free keys in a handle or an
  attempt, each a scalar; nothing nests deeper than the tables;
- a record file at most ``MAX_RECORD_BYTES``.
"""

from __future__ import annotations

import contextlib
import json
import re
from enum import Enum
from typing import Any, Final

import msgspec

from gpuctl.adapters.store.schema import (
    ABSENT,
    MAX_EXTRA_KEYS,
    REQUIRED,
    Check,
    RecordError,
    array,
    integer,
    nullable,
    number,
    obj,
    one_of,
    scalar,
    text,
)
from gpuctl.core import record_shapes, store_shapes
from gpuctl.core.pids import PID_MAX
from gpuctl.core.promise import MAX_DEVICE_INDEX, Promise
from gpuctl.core.queue import PRIORITY_MAX, QUEUE_TTL_MAX_S, Waiter
from gpuctl.core.record import (
    TIME_MAX,
    UNREADABLE_KEY,
    Failure,
    Holder,
    Lease,
    Phase,
    Record,
    SetAside,
    Voided,
)

__all__ = [
    "DURATION",
    "HOLDER_FIELDS",
    "LEASE_FIELDS",
    "MAX_RECORD_BYTES",
    "NONCE",
    "PID",
    "PID_MAX",
    "PRIORITY_MAX",
    "QUEUE_TTL_MAX_S",
    "RECORD_FIELDS",
    "SERVICE",
    "TIME",
    "TIME_MAX",
    "URL",
    "RecordError",
    "check_record",
    "decode_holder",
    "decode_lease",
    "decode_promise",
    "decode_record",
    "decode_set_aside",
    "decode_voided",
    "decode_waiter",
    "decode_waiters",
    "encode_record",
    "parse_json",
    "parse_record",
    "salvage",
]

MAX_RECORD_BYTES: Final = 1 << 20
# The longest mark salvage leaves in a handle (``UNREADABLE_KEY``): a list of names.
MARK_MAX: Final = 256
MAX_ATTEMPTS_READ: Final = store_shapes.MAX_ATTEMPTS_READ
TEXT_MAX: Final = store_shapes.TEXT_MAX  # an error message, a log tail
COUNT_MAX: Final = store_shapes.COUNT_MAX


# ---- the schema, once: built from the Structs (``core.store_shapes``)


def _check_of(t: msgspec.inspect.Type) -> Check:
    """The stdlib check of one declared field type (``core.record_shapes``,
    ``core.store_shapes``)."""
    inspect = msgspec.inspect
    if isinstance(t, inspect.Metadata):  # a description: no check of its own
        return _check_of(t.type)
    if isinstance(t, inspect.UnionType):
        # (msgspec leaves UNSET out of a field's union: it is never on the wire.)
        inner = [u for u in t.types if not isinstance(u, inspect.NoneType)]
        assert len(inner) == 1, f"one type per field, and null: {t}"
        check = _check_of(inner[0])
        return nullable(check) if len(inner) < len(t.types) else check
    if isinstance(t, inspect.IntType):
        assert t.ge is not None and t.le is not None, f"a bounded integer: {t}"
        return integer(t.ge, t.le)
    if isinstance(t, inspect.FloatType):
        assert t.ge is not None and t.le is not None, f"a bounded number: {t}"
        return number(t.ge, t.le)
    if isinstance(t, inspect.StrType):
        assert t.max_length is not None, f"a bounded string: {t}"
        # Anchored for JSON Schema; matched here in full (``$`` would pass a last "\n").
        pattern = re.compile(t.pattern.removeprefix("^").removesuffix("$")) if t.pattern else None
        return text(t.max_length, min_len=t.min_length or 0, pattern=pattern)
    if isinstance(t, inspect.BoolType):
        return one_of(True, False)
    if isinstance(t, inspect.LiteralType):
        return one_of(*t.values)
    if isinstance(t, inspect.EnumType):
        return one_of(*(e.value for e in t.cls))
    if isinstance(t, inspect.ListType):
        assert t.max_length is not None, f"a bounded list: {t}"
        return array(_check_of(t.item_type), t.max_length)
    if isinstance(t, inspect.StructType):
        return _NESTED.get(t.cls) or obj(_fields_of(t.cls))
    raise TypeError(f"no store check for {t}: name an override (_fields_of)")


def _fields_of(shape: type[msgspec.Struct], **overrides: Check) -> dict[str, tuple[Check, Any]]:
    """A field table (check, default) from a Struct: a required field is ``REQUIRED``,
    one that defaults to ``UNSET`` stays ``ABSENT``, another takes its default (what a
    reader fills in where a file an older release wrote lacks it). ``overrides``: the
    checks of the fields whose rule the Struct cannot say."""
    info = msgspec.inspect.type_info(shape)
    assert isinstance(info, msgspec.inspect.StructType)
    assert set(overrides) <= {f.encode_name for f in info.fields}, overrides
    out: dict[str, tuple[Check, Any]] = {}
    for f in info.fields:
        if f.required:
            default: Any = REQUIRED
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        elif f.default in (msgspec.UNSET, msgspec.NODEFAULT):
            default = ABSENT
        else:
            default = f.default.value if isinstance(f.default, Enum) else f.default
        check = overrides.get(f.encode_name)
        out[f.encode_name] = (check if check is not None else _check_of(f.type), default)
    return out


# The nested Structs whose check carries an override: a field of their type uses it.
_NESTED: dict[type[msgspec.Struct], Check] = {}

SERVICE = _check_of(msgspec.inspect.type_info(store_shapes.ServiceName))
QUEUE_ID = store_shapes.ENTRY_ID
MEMORY_MAX_MIB: Final = store_shapes.MEMORY_MAX_MIB
SEQ_MAX: Final = store_shapes.SEQ_MAX

HOLDER_FIELDS: Final = _fields_of(record_shapes.Holder)
LEASE_FIELDS: Final = _fields_of(store_shapes.Lease)
FAILURE_FIELDS: Final = _fields_of(store_shapes.Failure)
HANDLE_FIELDS: Final = _fields_of(record_shapes.Handle)
# An attempt is the starter's own note (``flows.ensure.launch._attempt``): its known keys are
# typed when present, and it may carry more scalars.
ATTEMPT_FIELDS: Final = _fields_of(record_shapes.Attempt)

PID = LEASE_FIELDS["pid"][0]
TIME = LEASE_FIELDS["granted"][0]
DURATION = ATTEMPT_FIELDS["duration_s"][0]

_HOLDER = obj(HOLDER_FIELDS)
_LEASE = obj(LEASE_FIELDS)
_ANY_HANDLE = obj(HANDLE_FIELDS, extra=scalar)
# Override: a `gpuctl run` job's handle is its spec (``core.jobs.job_spec``): its budget
# and priority are typed here, on every read, so a budget of "80GiB" is set aside and
# reported like a bad pid, never read as a job that holds nothing.
RUN_HANDLE_FIELDS: Final = {
    "memory_mib": integer(0, 1 << 40),
    "priority": integer(-(2**53), 2**53),  # job_spec caps it to the config's range
}
_RUN_HANDLE_OPTIONAL: Final = {
    "preemptible": one_of(True, False),
    "host": text(255),
    "boot_id": text(64),
}


def _handle(v: Any, at: str) -> dict[str, Any]:
    out: dict[str, Any] = _ANY_HANDLE(v, at)
    if out.get("kind") == "run":
        for name, check in RUN_HANDLE_FIELDS.items():
            if name not in out:
                raise RecordError(f"{at}.{name}", "missing (a run job's handle)")
            check(out[name], f"{at}.{name}")
        for name, check in _RUN_HANDLE_OPTIONAL.items():
            if name in out:
                check(out[name], f"{at}.{name}")
    return out


_HANDLE = _handle
# Override: a handle and an attempt are open objects, their known keys typed by their
# Struct (``core.record_shapes``), and at most ``MAX_EXTRA_KEYS`` more scalars.
_ATTEMPT = obj(ATTEMPT_FIELDS, extra=scalar)

# What a start promises (``core.record.Promise``): every client counts the service by
# these figures, so they are as strictly typed as a pid. The bounds are the config's.
_DEVICE_LIST = array(integer(0, MAX_DEVICE_INDEX), MAX_DEVICE_INDEX + 1)


def _devices(v: Any, at: str) -> list[int]:
    """Override: GPU indexes as the config allows them: at least one, none twice (an
    empty list would promise memory on no GPU at all)."""
    out: list[int] = _DEVICE_LIST(v, at)
    if not out:
        raise RecordError(at, "an empty list (null: any one GPU)")
    if len(set(out)) != len(out):
        raise RecordError(at, f"a GPU is listed twice: {out}")
    return out


PROMISE_FIELDS: Final = _fields_of(store_shapes.Promise, devices=nullable(_devices))
_PROMISE = _NESTED[store_shapes.Promise] = obj(PROMISE_FIELDS)

RECORD_FIELDS: Final = _fields_of(
    store_shapes.Record,
    handle=nullable(_HANDLE),
    attempts=array(_ATTEMPT, MAX_ATTEMPTS_READ),
)
_RECORD = obj(RECORD_FIELDS)
NONCE = RECORD_FIELDS["start_nonce"][0]
URL = RECORD_FIELDS["health"][0]

SET_ASIDE_FIELDS: Final = _fields_of(store_shapes.SetAside)
MAX_SET_ASIDE: Final = 10_000
_SET_ASIDE_LIST = array(obj(SET_ASIDE_FIELDS), MAX_SET_ASIDE)

# A lease or entry found forged (``core.record.Voided``; ``GET /records/_voided``).
VOIDED_KINDS: Final = store_shapes.VOIDED_KINDS
VOIDED_FIELDS: Final = _fields_of(store_shapes.Voided)
_VOIDED_LIST = array(obj(VOIDED_FIELDS), MAX_SET_ASIDE)

# A wait-queue entry (``core.queue.Waiter``): its holder's id names its file, so it is
# letters and digits only (gpuctl's are uuid hex).
WAITER_FIELDS: Final = _fields_of(store_shapes.Waiter)
MAX_WAITERS: Final = 10_000
_WAITER = obj(WAITER_FIELDS)
_WAITER_LIST = array(_WAITER, MAX_WAITERS)


# ---- decoding


def decode_record(data: Any, at: str = "$") -> Record:
    """A parsed JSON value as a ``Record``.

    Raises:
        RecordError: it does not fit the schema (the message says where and why).
    """
    v = _RECORD(data, at)
    lease = v["lease"]
    failure = v["failure"]
    return Record(
        service=v["service"],
        phase=Phase(v["phase"]),
        since=v["since"],
        last_used=v["last_used"],
        lease=_lease(lease) if lease is not None else None,
        handle=v["handle"],
        attempts=tuple(v["attempts"]),
        failure=Failure(**failure) if failure is not None else None,
        recovered=v["recovered"],
        start_nonce=v["start_nonce"],
        health=v["health"],
        promise=_promise(v["promise"]) if v["promise"] is not None else None,
        runs_on=v["runs_on"],
    )


def _promise(v: dict[str, Any]) -> Promise:
    devices = v["devices"]
    return Promise(
        memory_mib=v["memory_mib"],
        priority=v["priority"],
        devices=tuple(devices) if devices is not None else None,
        kind=v["kind"],
        resume=v["resume"],
        health_timeout_s=v["health_timeout_s"],
        yield_after_s=v["yield_after_s"],
    )


def decode_promise(data: Any, at: str = "$.promise") -> Promise:
    """A start's promise on its own (the agent's lease and touch bodies carry one)."""
    return _promise(_PROMISE(data, at))


def _lease(v: dict[str, Any]) -> Lease:
    return Lease(
        v["holder"],
        v["host"],
        v["boot_id"],
        v["pid"],
        v["pid_start"],
        v["entry"],
        v["granted"],
        v["expires"],
    )


def decode_lease(data: Any, at: str = "$") -> Lease:
    """A lease on its own (an in-flight entry has a lease's shape)."""
    return _lease(_LEASE(data, at))


def decode_holder(data: Any, at: str = "$.holder") -> Holder:
    """A lease request's holder (the agent's ``POST /records/{svc}/lease`` body)."""
    return Holder(**_HOLDER(data, at))


def decode_set_aside(data: Any, at: str = "$.set_aside") -> list[SetAside]:
    """The agent's list of set-aside record files (``GET /records``)."""
    return [SetAside(**v) for v in _SET_ASIDE_LIST(data, at)]


def decode_voided(data: Any, at: str = "$.voided") -> list[Voided]:
    """The agent's list of voided leases and entries (``GET /records/_voided``)."""
    return [Voided(**v) for v in _VOIDED_LIST(data, at)]


def decode_waiter(data: Any, at: str = "$") -> Waiter:
    """A wait-queue entry (a file in ``queue/``, or one in the agent's answer)."""
    return _waiter(_WAITER(data, at))


def decode_waiters(data: Any, at: str = "$.queue") -> list[Waiter]:
    """The agent's list of waiters (``GET /records/_queue``), in its order."""
    return [_waiter(v) for v in _WAITER_LIST(data, at)]


def _waiter(v: dict[str, Any]) -> Waiter:
    return Waiter(
        v["name"], v["priority"], v["memory_mib"], v["seq"], v["since"], _lease(v["holder"])
    )


def parse_json(raw: bytes, limit: int = MAX_RECORD_BYTES) -> Any:
    """A store file's bytes as JSON data: the one reader of every file the store reads
    (records, queue and in-flight entries), so none can crash a reader.

    Raises:
        RecordError: over ``limit`` bytes, not UTF-8, not JSON, or nested too deep.
    """
    if len(raw) > limit:
        raise RecordError("$", f"{len(raw)} bytes, at most {limit}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("$", f"not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise RecordError("$", f"not JSON: {e}") from None
    except RecursionError:
        # A string of "[" deeper than Python's stack: no store file nests like that.
        raise RecordError("$", "nested too deep") from None


def parse_record(raw: bytes) -> Record:
    """A record file's bytes as a ``Record``: never anything but a record or a RecordError.

    Raises:
        RecordError: too big, not UTF-8, not JSON, nested too deep, or off the schema.
    """
    return decode_record(parse_json(raw))


def salvage(raw: bytes, service: str, now: float | None = None) -> Record:
    """What can be kept of a record file that failed the schema: every top-level field
    that passes on its own (a lease only whole). The file itself is set aside; this is
    the fresh record that replaces it.

    Keeping what is sound keeps what a reader must not lose: a start under way (phase
    ``starting`` with its nonce, or its recorded server) still counts after a lease
    with a pid of 2**31 is dropped, rather than the service reading as stopped and IDLE.
    A file that is not a JSON object, or names another service, keeps nothing.

    ``now``: where no sound phase is kept, the record is ``stopped`` since ``now`` (the
    set-aside), whatever ``since`` the file said: readers take a ``stopped`` record that
    began at a set-aside as one that may hide a start (``core.record.hidden_by_set_aside``).
    """
    kept = _sound_fields(raw, service)
    if "phase" not in kept and now is not None:
        kept["since"] = now
    return decode_record(kept)


# A nonce anywhere in a file too broken to parse (cut short, say): it still finds the
# server that start spawned, which is all ``stop`` and ``ensure`` need of it.
_NONCE_IN_TEXT = re.compile(r'"start_nonce"\s{0,8}:\s{0,8}"([0-9a-f]{1,128})"')


def _sound_fields(raw: bytes, service: str) -> dict[str, Any]:
    kept: dict[str, Any] = {"service": service}
    if len(raw) > MAX_RECORD_BYTES:
        return kept
    # Leniently: a BOM before it, or a byte that is not UTF-8 inside one string (a
    # failure's error), spoils one field at most, not the start the record stands for.
    text = raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        nonce = _NONCE_IN_TEXT.search(text)
        if nonce is not None and service_named(text, service):
            with contextlib.suppress(RecordError):
                kept["start_nonce"] = RECORD_FIELDS["start_nonce"][0](nonce.group(1), "$")
        return kept
    if type(data) is not dict or data.get("service") != service:
        return kept
    for name, (check, _) in RECORD_FIELDS.items():
        if name in data and name not in ("service", "recovered"):
            with contextlib.suppress(RecordError):
                kept[name] = check(data[name], f"$.{name}")
    if "handle" not in kept and data.get("handle") is not None:
        kept["handle"] = _sound_handle(data["handle"])
    return kept


def _sound_handle(handle: Any) -> dict[str, Any]:
    """The fields of a handle that pass on their own (a pre-nonce record's one bad field
    must not lose the pid that finds its server), marked with the names of those that
    did not (``core.record.UNREADABLE_KEY``): a reader treats what it cannot use whole as
    unknown, never as no server (``core.record.unreadable_handle``)."""
    if type(handle) is not dict:
        return {UNREADABLE_KEY: "*"}
    out: dict[str, Any] = {}
    dropped: list[str] = []
    extras = 0
    for key, value in handle.items():
        if not isinstance(key, str) or key == UNREADABLE_KEY:
            continue
        known = key in HANDLE_FIELDS
        if not known and extras >= MAX_EXTRA_KEYS - 1:  # room for the mark
            dropped.append(key)
            continue
        try:
            out[key] = (HANDLE_FIELDS[key][0] if known else scalar)(value, f"$.handle.{key}")
        except RecordError:
            dropped.append(key)
            continue
        if not known:
            extras += 1
    try:
        return dict(_HANDLE({**out, UNREADABLE_KEY: _names(dropped)}, "$.handle"))
    except RecordError:
        # A run job's handle without a sound budget: its pid would count as holding
        # nothing, so nothing of it is kept but the mark (the service reads UNKNOWN).
        return {UNREADABLE_KEY: _names([*dropped, *out])}


def _names(dropped: list[str]) -> str:
    """The dropped fields' names as one mark value, within a handle value's bound."""
    text = ",".join(n.replace(",", "_") for n in dropped) or "*"
    return text if len(text) <= MARK_MAX else text[: MARK_MAX - 3] + "..."


def service_named(text: str, service: str) -> bool:
    """Whether a broken record's text names ``service`` (its nonce is only kept then)."""
    return re.search(r'"service"\s{0,8}:\s{0,8}' + re.escape(json.dumps(service)), text) is not None


# ---- encoding


def check_record(record: Record) -> dict[str, Any]:
    """The record as JSON data, checked against the schema before it is written or sent.

    Raises:
        RecordError: a field holds what no reader would accept (an update gone wrong).
    """
    d = record.to_dict()
    _RECORD(d, "$")
    return d


def encode_record(record: Record) -> str:
    """The record file's text (sorted keys, so diffs and fixtures read well)."""
    return json.dumps(check_record(record), sort_keys=True, indent=1, allow_nan=False)
