"""Request bodies off the wire: bounded JSON, then exact types, each error a 400 naming its field.

Every body is hostile until checked. Size and nesting are bounded *before* ``json.loads``
runs (100,000 nested ``[`` would otherwise blow its recursion limit); ``NaN`` and
``Infinity`` are refused by the parser; then each endpoint's shape is checked with exact
types (``"no"`` is not a boolean, ``1.0`` is not a pid), ranges (a pid fits the kernel's
``PID_MAX_LIMIT``) and finite numbers. What passes can be handed to the store as is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from gpuctl.adapters.store import codec
from gpuctl.adapters.store.codec import (
    MEMORY_MAX_MIB,
    PRIORITY_MAX,
    QUEUE_ID,
    QUEUE_TTL_MAX_S,
    RecordError,
    decode_holder,
    decode_promise,
)
from gpuctl.adapters.store.schema import MAX_EXTRA_KEYS
from gpuctl.agent import http
from gpuctl.agent.http import HttpError
from gpuctl.core.json_kind import json_kind
from gpuctl.core.names import is_valid_name
from gpuctl.core.pids import PID_MAX
from gpuctl.core.record import INFLIGHT_TTL_MAX_S, LOG_TAIL_MAX, UPDATE_FIELDS, Phase

# The HTTP reader's own limit (and a record file's, ``codec.MAX_RECORD_BYTES``): every
# body the request schemas allow fits under it (``MAX_TEXT``, ``MAX_EXTRA_TEXT``, tested
# against /openapi.json), so no body the schema allows gets a 413.
MAX_BODY_BYTES = http.MAX_BODY_BYTES
MAX_DEPTH = 16
MAX_TTL_S = 7 * 24 * 3600.0
# A failure's error and log tail, an attempt's error: the store keeps no more than the
# last 16 KiB of a log tail (``core.record.LOG_TAIL_MAX``), so a client clips to it.
MAX_TEXT = LOG_TAIL_MAX
# A free value in a handle or an attempt (what a launcher adds): a name, a path.
MAX_EXTRA_TEXT = 1024
# The known fields of each (``codec.HANDLE_FIELDS`` + ``proof``; ``codec.ATTEMPT_FIELDS``).
HANDLE_KNOWN = frozenset(
    {
        "kind",
        "pid",
        "pid_start",
        "container_id",
        "container_name",
        "terminal",
        "log",
        "pid_ns",
        "proof",
    }
)
ATTEMPT_KNOWN = frozenset({"started", "ended", "duration_s", "launcher", "outcome", "error"})
MAX_SHORT_TEXT = 256
# Any time gpuctl writes is seconds since the epoch; 1e11 is the year 5138.
MAX_EPOCH_S = 1e11

_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class BadRequest(HttpError):
    """A 400 naming the field (``holder.pid``) and what it should be."""

    def __init__(self, field: str, problem: str) -> None:
        where = f"{field}: " if field else ""
        super().__init__(
            400, f"bad request body: {where}{problem}", "see /openapi.json for the request schemas"
        )
        self.field = field


def check_service_name(name: str) -> str:
    if not is_valid_name(name):
        raise HttpError(
            400,
            f"invalid service name {name[:120]!r}",
            "a name is 1-101 letters, digits, '_', '.' or '-', not starting with '.' or '-'",
        )
    return name


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _number_value(text: str) -> float | int:
    """JSON has one number type: ``12.0`` is the integer 12 (as JSON Schema says), so a
    pid written by a client that only has floats is still a pid. Fractions stay floats."""
    value = float(text)
    if value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return value


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (an empty body is ``{}``); BadRequest otherwise."""
    depth = 0
    for m in _STRUCTURE.finditer(body):
        token = m.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise BadRequest("", f"nested deeper than {MAX_DEPTH} levels")
        elif token in (b"]", b"}"):
            depth -= 1
    # The size before the empty test: 200 KiB of spaces is no empty body. (The depth
    # scan above is linear and says more about a deep body than its size would.)
    if len(body) > MAX_BODY_BYTES:
        raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes")
    if not body.strip():
        return {}
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_number_value)
    except RecursionError:  # unreachable after the depth bound; kept as a backstop
        raise BadRequest("", f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # also UnicodeDecodeError and over-long integers
        raise BadRequest("", f"not JSON ({err})") from None
    if not isinstance(data, dict):
        raise BadRequest("", f"expected a JSON object, got {json_kind(data)}")
    return data


# ---- field checkers: (value, field path) -> value, or BadRequest


def string(value: Any, field: str, *, max_len: int = MAX_SHORT_TEXT, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise BadRequest(field, f"expected a string, got {json_kind(value)}")
    if len(value) > max_len:
        raise BadRequest(field, f"longer than {max_len} characters")
    if not empty and not value:
        raise BadRequest(field, "must not be empty")
    return value


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(field, f"expected true or false, got {json_kind(value)}")
    return value


def pid(value: Any, field: str, *, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(field, f"expected an integer pid, got {json_kind(value)}")
    low = 0 if zero else 1
    if not low <= value <= PID_MAX:
        raise BadRequest(field, f"a pid is from {low} to {PID_MAX}, got {value}")
    return value


def number(value: Any, field: str, *, low: float = 0.0, high: float = MAX_EPOCH_S) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(field, f"expected a number, got {json_kind(value)}")
    as_float = float(value)
    if not math.isfinite(as_float) or not low <= as_float <= high:
        raise BadRequest(field, f"expected a finite number from {low:g} to {high:g}")
    return as_float


def ttl(value: Any, field: str = "ttl_s") -> float:
    seconds = number(value, field, low=0.0, high=MAX_TTL_S)
    if seconds <= 0:
        raise BadRequest(field, "must be more than 0 seconds")
    return seconds


def nullable(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def inner(value: Any, field: str) -> Any:
        return None if value is None else check(value, field)

    return inner


def obj(
    value: Any,
    field: str,
    fields: dict[str, Callable[[Any, str], Any]],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """An object with only ``fields`` (each checked), ``required`` ones present."""
    if not isinstance(value, dict):
        raise BadRequest(field, f"expected an object, got {json_kind(value)}")
    prefix = f"{field}." if field else ""
    for key in required:
        if key not in value:
            raise BadRequest(f"{prefix}{key}", "missing")
    out: dict[str, Any] = {}
    for key, item in value.items():
        check = fields.get(key)
        if check is None:
            raise BadRequest(f"{prefix}{key}", "unknown field")
        out[key] = check(item, f"{prefix}{key}")
    return out


def free_object(known: frozenset[str]) -> Callable[[Any, str], dict[str, Any]]:
    """A free-form object (a handle, an attempt) as /openapi.json bounds it: at most
    ``MAX_EXTRA_KEYS`` keys beyond ``known``, each free string at most
    ``MAX_EXTRA_TEXT`` characters (an ``error``: ``MAX_TEXT``); a ``pid`` in it must
    still be a pid, and its times finite. The store then checks its own schema."""

    def check(value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise BadRequest(field, f"expected an object, got {json_kind(value)}")
        extra = [k for k in value if k not in known]
        if len(extra) > MAX_EXTRA_KEYS:
            raise BadRequest(field, f"{len(extra)} unknown fields, at most {MAX_EXTRA_KEYS}")
        for key, item in value.items():
            most = MAX_TEXT if key == "error" else MAX_EXTRA_TEXT
            if isinstance(item, str) and key not in known - {"error"} and len(item) > most:
                raise BadRequest(f"{field}.{key}", f"{len(item)} characters, at most {most}")
        return _free_fields(value, field)

    return check


def _free_fields(value: dict[str, Any], field: str) -> dict[str, Any]:
    if "pid" in value and value["pid"] is not None:
        pid(value["pid"], f"{field}.pid")
    for key in ("pid_start", "started", "ended", "duration_s"):
        if key in value and value[key] is not None:
            number(value[key], f"{field}.{key}", low=-MAX_EPOCH_S)
    return value


# ---- the request bodies (openapi.py describes the same shapes)


def holder(value: Any, field: str) -> dict[str, Any]:
    """The store's own holder schema (``codec.HOLDER_FIELDS``): one rule on both paths."""
    try:
        decode_holder(value, at=f"$.{field}")
    except RecordError as err:
        raise BadRequest(err.where.removeprefix("$."), err.why) from None
    assert isinstance(value, dict)
    return value


def _codec(name: str) -> Callable[[Any, str], Any]:
    """One of the store's field checks (``codec.NONCE``, ``codec.URL``), as a wire check."""

    def check(value: Any, field: str) -> Any:
        try:
            return getattr(codec, name)(value, f"$.{field}")
        except codec.RecordError as err:
            raise BadRequest(err.where.removeprefix("$."), err.why) from None

    return check


health_url = _codec("URL")
_nonce = _codec("NONCE")


def failure(value: Any, field: str) -> dict[str, Any]:
    return obj(
        value,
        field,
        {
            "error": lambda v, f: string(v, f, max_len=MAX_TEXT),
            "log_tail": lambda v, f: string(v, f, max_len=MAX_TEXT),
        },
    )


def record_update(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, dict):
        for key in value:
            if key not in _UPDATE_KEYS:
                # The store's own words, so both store paths say the same.
                raise BadRequest(field, f"bad record update: unknown update key {key!r}")
    return obj(
        value,
        field,
        {
            "phase": _phase,
            "handle": nullable(free_object(HANDLE_KNOWN)),
            "attempt": free_object(ATTEMPT_KNOWN),
            "failure": nullable(failure),
            "touch": boolean,
            # Fields of the store's schema that this agent passes on (the store applies them).
            "start_nonce": nullable(_nonce),
            "health": nullable(health_url),
        },
    )


_UPDATE_KEYS = frozenset(UPDATE_FIELDS)  # declared once: core.record.RecordUpdate


def _phase(value: Any, field: str) -> str:
    if not isinstance(value, str) or value not in {p.value for p in Phase}:
        allowed = ", ".join(p.value for p in Phase)
        raise BadRequest(field, f"expected one of {allowed}")
    return value


def promise(value: Any, field: str) -> dict[str, Any]:
    """A start's promise, by the store's own schema (``codec.PROMISE_FIELDS``)."""
    try:
        decode_promise(value, at=f"$.{field}")
    except RecordError as err:
        raise BadRequest(err.where.removeprefix("$."), err.why) from None
    assert isinstance(value, dict)
    return value


def lease_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(
        data,
        "",
        {"holder": holder, "ttl_s": ttl, "promise": nullable(promise)},
        required=("holder", "ttl_s"),
    )


def renew_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(
        data,
        "",
        {"holder": lambda v, f: string(v, f, empty=False), "ttl_s": ttl},
        required=("holder", "ttl_s"),
    )


def holder_update(data: dict[str, Any]) -> dict[str, Any]:
    return obj(
        data,
        "",
        {"holder": lambda v, f: string(v, f, empty=False), "update": record_update},
        required=("holder", "update"),
    )


def release_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(
        data,
        "",
        {"holder": lambda v, f: string(v, f, empty=False), "update": nullable(record_update)},
        required=("holder",),
    )


# In-flight entries are files named by their holder's id (gpuctl's are uuid hex).
INFLIGHT_ID = re.compile(r"[A-Za-z0-9]{1,64}")


def inflight_id(value: Any, field: str) -> str:
    text = string(value, field)
    if not INFLIGHT_ID.fullmatch(text):
        raise BadRequest(field, "expected 1 to 64 ASCII letters and digits")
    return text


def inflight_ttl(value: Any, field: str = "ttl_s") -> float:
    """An in-flight entry's term: at most ``INFLIGHT_TTL_MAX_S`` (its user renews it
    while the request runs); a longer one would keep a server from reclaim for good."""
    seconds = number(value, field, low=0.0, high=INFLIGHT_TTL_MAX_S)
    if seconds <= 0:
        raise BadRequest(field, "must be more than 0 seconds")
    return seconds


def inflight_request(data: dict[str, Any]) -> dict[str, Any]:
    args = obj(data, "", {"holder": holder, "ttl_s": inflight_ttl}, required=("holder", "ttl_s"))
    inflight_id(args["holder"].get("id"), "holder.id")
    return args


def end_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(data, "", {"holder": inflight_id}, required=("holder",))


def touch_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(data, "", {"ready": boolean, "promise": nullable(promise)})


# ---- the wait queue (POST /records/_queue, …/leave): the store's own entry schema


def integer(value: Any, field: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(field, f"expected an integer, got {json_kind(value)}")
    if not low <= value <= high:
        raise BadRequest(field, f"expected an integer from {low} to {high}, got {value}")
    return value


def queue_id(value: Any, field: str) -> str:
    text = string(value, field)
    if not QUEUE_ID.fullmatch(text):
        raise BadRequest(field, "expected 1 to 64 ASCII letters and digits")
    return text


def _job_name(value: Any, field: str) -> str:
    text = string(value, field)
    if not is_valid_name(text):
        raise BadRequest(field, "expected a name: letters, digits, '_', '.', '-' (not first)")
    return text


def queue_join_request(data: dict[str, Any]) -> dict[str, Any]:
    def queue_ttl(value: Any, field: str) -> float:
        seconds = number(value, field, low=0.0, high=QUEUE_TTL_MAX_S)
        if seconds <= 0:
            raise BadRequest(field, "must be more than 0 seconds")
        return seconds

    args = obj(
        data,
        "",
        {
            "holder": holder,
            "ttl_s": queue_ttl,
            "name": _job_name,
            "priority": lambda v, f: integer(v, f, low=-PRIORITY_MAX, high=PRIORITY_MAX),
            "memory_mib": lambda v, f: integer(v, f, low=1, high=MEMORY_MAX_MIB),
        },
        required=("holder", "ttl_s", "name", "priority", "memory_mib"),
    )
    queue_id(args["holder"].get("id"), "holder.id")
    return args


def queue_leave_request(data: dict[str, Any]) -> dict[str, Any]:
    return obj(data, "", {"holder": queue_id}, required=("holder",))
