"""Record files and wire bodies to ``core.record`` data and back, through one schema.

Every record is checked against the tables below when it is read (a file, an agent's
answer) and before it is written, so a record that a hostile or broken writer left
cannot make a reader crash, or lie: a pid of 2**31 that overflows ``kill()``, a NaN or
1e308 time that makes a lease never expire, a ``"no"`` that reads as true, 100,000
nested lists. The schema is declared once as small field tables; each check returns the
value or raises ``RecordError`` naming where it failed (``at $.lease.pid: …``).

Standard library only: msgspec would do the same in C, but its import (about 18 ms)
would land on every ``gpuctl status``, and a record is a few dozen fields.

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
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from gpuctl.core.names import NAME_RE
from gpuctl.core.record import RECORD_SCHEMA, Failure, Holder, Lease, Phase, Record, SetAside

MAX_RECORD_BYTES: Final = 1 << 20
PID_MAX: Final = 1 << 22
TIME_MAX: Final = 4_102_444_800.0  # 2100-01-01T00:00:00Z
DURATION_MAX: Final = 10 * 365 * 86_400.0
MAX_ATTEMPTS_READ: Final = 64
MAX_EXTRA_KEYS: Final = 32
TEXT_MAX: Final = 64 * 1024  # an error message, a log tail
COUNT_MAX: Final = 2**31 - 1

_HEX = re.compile(r"[0-9a-f]{8,64}")
_URL = re.compile(r"https?://[^\s/?#]+[^\s]*", re.IGNORECASE)


class RecordError(ValueError):
    """A record (or a holder) that does not fit the schema, located: ``at $.lease.pid: …``."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"at {where}: {why}")
        self.where = where
        self.why = why


Check = Callable[[Any, str], Any]
_REQUIRED: Final = object()
_ABSENT: Final = object()  # an optional key that stays absent when it is not given


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(v),
        "an array"
        if isinstance(v, list)
        else "an object"
        if isinstance(v, dict)
        else type(v).__name__,
    )


def _integer(lo: int, hi: int) -> Check:
    def check(v: Any, at: str) -> int:
        # bool is an int to Python, never to a record: ``true`` is not pid 1.
        if type(v) is not int:
            raise RecordError(at, f"expected an integer, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise RecordError(at, f"{v} is out of range ({lo}..{hi})")
        return v

    return check


def _number(lo: float, hi: float) -> Check:
    def check(v: Any, at: str) -> float:
        if type(v) is not int and type(v) is not float:
            raise RecordError(at, f"expected a number, got {_type_name(v)}")
        if not math.isfinite(v):
            raise RecordError(at, f"{v} is not a finite number")
        if not lo <= v <= hi:
            raise RecordError(at, f"{v:g} is out of range ({lo:g}..{hi:g})")
        return float(v)

    return check


def _text(max_len: int, *, min_len: int = 0, pattern: re.Pattern[str] | None = None) -> Check:
    def check(v: Any, at: str) -> str:
        if type(v) is not str:
            raise RecordError(at, f"expected a string, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len:
            raise RecordError(at, f"length {len(v)} is out of range ({min_len}..{max_len})")
        if pattern is not None and not pattern.fullmatch(v):
            raise RecordError(at, f"{v[:80]!r} does not match {pattern.pattern}")
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordError(at, "not valid Unicode (a lone surrogate)") from None
        return v

    return check


def _one_of(*values: Any) -> Check:
    def check(v: Any, at: str) -> Any:
        # type() too: 1.0 == 1 and True == 1, but neither is schema 1.
        if not any(type(v) is type(x) and v == x for x in values):
            shown = ", ".join(json.dumps(x) for x in values)
            raise RecordError(at, f"{json.dumps(v)[:80]} is not one of {shown}")
        return v

    return check


def _nullable(inner: Check) -> Check:
    def check(v: Any, at: str) -> Any:
        return None if v is None else inner(v, at)

    return check


def _array(item: Check, max_len: int) -> Check:
    def check(v: Any, at: str) -> list[Any]:
        if type(v) is not list:
            raise RecordError(at, f"expected an array, got {_type_name(v)}")
        if len(v) > max_len:
            raise RecordError(at, f"{len(v)} items, at most {max_len}")
        return [item(x, f"{at}[{i}]") for i, x in enumerate(v)]

    return check


_ANY_KEY = _text(64, min_len=1)


def _scalar(v: Any, at: str) -> Any:
    """A free value in a handle or an attempt: a scalar, never a nest."""
    if v is None or type(v) is bool:
        return v
    if type(v) is int:
        return _integer(-(2**53), 2**53)(v, at)
    if type(v) is float:
        return _number(-1e15, 1e15)(v, at)
    if type(v) is str:
        return _text(4096)(v, at)
    raise RecordError(at, f"expected a string, number, boolean or null, got {_type_name(v)}")


def _object(fields: Mapping[str, tuple[Check, Any]], *, extra: Check | None = None) -> Check:
    """An object with these fields ((check, default) each; ``_REQUIRED`` has none).

    Unknown keys are refused, except where ``extra`` checks them (a launcher's handle
    may carry more than gpuctl reads).
    """

    table = tuple((name, inner, default) for name, (inner, default) in fields.items())
    # The children's paths, per parent path: formatted once, not on every read (the
    # agent checks every record on every /records).
    paths: dict[str, tuple[str, ...]] = {}

    def check(v: Any, at: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise RecordError(at, f"expected an object, got {_type_name(v)}")
        where = paths.get(at)
        if where is None:
            where = tuple(f"{at}.{name}" for name, _, _ in table)
            if len(paths) < 256:
                paths[at] = where
        out: dict[str, Any] = {}
        seen = 0
        for (name, inner, default), here in zip(table, where, strict=True):
            if name in v:
                out[name] = inner(v[name], here)
                seen += 1
            elif default is _REQUIRED:
                raise RecordError(here, "missing")
            elif default is not _ABSENT:
                out[name] = default
        if seen < len(v):
            unknown = [k for k in v if k not in fields]
            if extra is None:
                raise RecordError(f"{at}.{unknown[0]}", "unknown field")
            if len(unknown) > MAX_EXTRA_KEYS:
                raise RecordError(at, f"{len(unknown)} unknown fields, at most {MAX_EXTRA_KEYS}")
            for k in unknown:
                _ANY_KEY(k, f"{at} key")
                out[k] = extra(v[k], f"{at}.{k}")
        return out

    return check


# ---- the schema, once

PID = _integer(1, PID_MAX)
TIME = _number(0.0, TIME_MAX)
DURATION = _number(-DURATION_MAX, DURATION_MAX)
SERVICE = _text(101, min_len=1, pattern=NAME_RE)
NONCE = _text(64, min_len=8, pattern=_HEX)
URL = _text(2048, min_len=8, pattern=_URL)
_NAME_TEXT = _text(255)
_SHORT = _text(64)
_TEXT = _text(TEXT_MAX)

HOLDER_FIELDS: Final = {
    "id": (_text(128, min_len=1), _REQUIRED),
    "host": (_NAME_TEXT, _REQUIRED),
    "boot_id": (_SHORT, _REQUIRED),
    "pid": (PID, _REQUIRED),
    "pid_start": (_nullable(TIME), None),
    "entry": (_SHORT, _REQUIRED),
}
LEASE_FIELDS: Final = {
    "holder": HOLDER_FIELDS["id"],
    **{k: v for k, v in HOLDER_FIELDS.items() if k != "id"},
    "granted": (TIME, _REQUIRED),
    "expires": (TIME, _REQUIRED),
}
FAILURE_FIELDS: Final = {
    "at": (TIME, _REQUIRED),
    "error": (_TEXT, ""),
    "log_tail": (_TEXT, ""),
    "count": (_integer(1, COUNT_MAX), 1),
    "backoff_until": (TIME, 0.0),
}
HANDLE_FIELDS: Final = {
    "kind": (_text(32, min_len=1), _ABSENT),
    "pid": (_nullable(PID), _ABSENT),
    "pid_start": (_nullable(TIME), _ABSENT),
    "container_id": (_nullable(_text(128)), _ABSENT),
    "container_name": (_nullable(_NAME_TEXT), _ABSENT),
    "terminal": (_nullable(_NAME_TEXT), _ABSENT),
    "log": (_nullable(_text(4096)), _ABSENT),
}
# An attempt is the starter's own note (``flows.ensure._attempt``): its known keys are
# typed when present, and it may carry more scalars.
ATTEMPT_FIELDS: Final = {
    "started": (TIME, _ABSENT),
    "ended": (TIME, _ABSENT),
    "duration_s": (DURATION, _ABSENT),
    "launcher": (_text(32), _ABSENT),
    "outcome": (_text(32), _ABSENT),
    "error": (_nullable(_text(TEXT_MAX)), _ABSENT),
}

_HOLDER = _object(HOLDER_FIELDS)
_LEASE = _object(LEASE_FIELDS)
_FAILURE = _object(FAILURE_FIELDS)
_HANDLE = _object(HANDLE_FIELDS, extra=_scalar)
_ATTEMPT = _object(ATTEMPT_FIELDS, extra=_scalar)

RECORD_FIELDS: Final = {
    "schema": (_one_of(RECORD_SCHEMA), RECORD_SCHEMA),
    "service": (SERVICE, _REQUIRED),
    "phase": (_one_of(*(p.value for p in Phase)), Phase.STOPPED.value),
    "since": (TIME, 0.0),
    "last_used": (_nullable(TIME), None),
    "lease": (_nullable(_LEASE), None),
    "handle": (_nullable(_HANDLE), None),
    "attempts": (_array(_ATTEMPT, MAX_ATTEMPTS_READ), []),
    "failure": (_nullable(_FAILURE), None),
    "recovered": (_nullable(_text(4096)), None),
    "start_nonce": (_nullable(NONCE), None),
    "health": (_nullable(URL), None),
}
_RECORD = _object(RECORD_FIELDS)

SET_ASIDE_FIELDS: Final = {
    "service": (_text(255, min_len=1), _REQUIRED),
    "file": (_text(300, min_len=1), _REQUIRED),
    "at": (TIME, _REQUIRED),
    "size": (_integer(0, 2**62), _REQUIRED),
    "why": (_text(4096), _REQUIRED),
}
MAX_SET_ASIDE: Final = 10_000
_SET_ASIDE_LIST = _array(_object(SET_ASIDE_FIELDS), MAX_SET_ASIDE)


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
    )


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


def parse_record(raw: bytes) -> Record:
    """A record file's bytes as a ``Record``: never anything but a record or a RecordError.

    Raises:
        RecordError: too big, not UTF-8, not JSON, nested too deep, or off the schema.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError("$", f"{len(raw)} bytes, at most {MAX_RECORD_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("$", f"not UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RecordError("$", f"not JSON: {e}") from None
    except RecursionError:
        # A string of "[" deeper than Python's stack: no record nests like that.
        raise RecordError("$", "nested too deep") from None
    return decode_record(data)


def salvage(raw: bytes, service: str) -> Record:
    """What can be kept of a record file that failed the schema: every top-level field
    that passes on its own (a lease only whole). The file itself is set aside; this is
    the fresh record that replaces it.

    Keeping what is sound keeps what a reader must not lose: a start under way (phase
    ``starting`` with its nonce, or its recorded server) still counts after a lease
    with a pid of 2**31 is dropped, rather than the service reading as stopped and IDLE.
    A file that is not a JSON object, or names another service, keeps nothing.
    """
    try:
        if len(raw) > MAX_RECORD_BYTES:
            return Record(service)
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return Record(service)
    if type(data) is not dict or data.get("service") != service:
        return Record(service)
    kept: dict[str, Any] = {"service": service}
    for name, (check, _) in RECORD_FIELDS.items():
        if name in data and name not in ("service", "recovered"):
            with contextlib.suppress(RecordError):
                kept[name] = check(data[name], f"$.{name}")
    return decode_record(kept)


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
