"""Request bodies off the wire: bounded JSON, then exact types, each error a 400 naming its field.

Every body is hostile until checked. Size and nesting are bounded *before* ``json.loads``
runs (100,000 nested ``[`` would otherwise blow its recursion limit); ``NaN`` and
``Infinity`` are refused by the parser; then each endpoint's shape is checked with exact
types (``"no"`` is not a boolean, ``1.5`` is not a pid), ranges (a pid fits the kernel's
``PID_MAX_LIMIT``) and finite numbers. What passes can be handed to the store as is.

The record bodies (lease, renew, update, release, touch, in-flight, queue, job stop, a
holder) are decoded into the Structs declared once in ``core.record_shapes``
(``shaped``), and msgspec's error is said again the way every 400 here says it: the
field, then what it should be.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from gpuctl.adapters.store.codec import RecordError, decode_promise
from gpuctl.agent import http
from gpuctl.agent.http import HttpError
from gpuctl.core import record_shapes as shapes
from gpuctl.core.events import Event, event_from_dict
from gpuctl.core.json_kind import json_kind
from gpuctl.core.names import NAME_RULE, is_valid_name
from gpuctl.core.record import MAX_EXTRA_KEYS
from gpuctl.core.store_shapes import ENTRY_ID

# The HTTP reader's own limit (and a record file's, ``codec.MAX_RECORD_BYTES``): every
# body the request schemas allow fits under it (``MAX_TEXT``, ``MAX_EXTRA_TEXT``, tested
# against /openapi.json), so no body the schema allows gets a 413.
MAX_BODY_BYTES = http.MAX_BODY_BYTES
MAX_DEPTH = 16
MAX_TTL_S = shapes.MAX_TTL_S
MAX_TEXT = shapes.MAX_TEXT
MAX_EXTRA_TEXT = shapes.MAX_EXTRA_TEXT
MAX_SHORT_TEXT = shapes.MAX_SHORT_TEXT
MAX_EPOCH_S = shapes.MAX_EPOCH_S

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


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(field, f"expected true or false, got {json_kind(value)}")
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


# ---- the record bodies, decoded into their Structs (``core.record_shapes``)

S = TypeVar("S", bound=msgspec.Struct)


def shaped(data: Any, shape: type[S], field: str = "") -> S:
    """``data`` decoded into ``shape``, exact types (``strict``); BadRequest naming the
    field otherwise. A handle's or an attempt's known fields are typed by their own
    Struct (``shapes.Handle``, ``shapes.Attempt``), and its extra ones are short scalars."""
    try:
        out = msgspec.convert(data, shape, strict=True)
    except msgspec.ValidationError as err:
        raise _said_again(str(err), data, shape, field) from None
    update = out if isinstance(out, shapes.RecordUpdate) else getattr(out, "update", None)
    if isinstance(update, shapes.RecordUpdate):
        where = f"{field}." if field else ("" if update is out else "update.")
        for name, known in shapes.FREE_OBJECTS.items():
            value = getattr(update, name)
            if isinstance(value, dict):
                _free(value, known, f"{where}{name}")
    return out


def _free(value: dict[str, Any], known: type[msgspec.Struct], field: str) -> None:
    """A handle or an attempt as /openapi.json bounds it: its known fields typed, at most
    ``MAX_EXTRA_KEYS`` more, each a scalar of at most ``MAX_EXTRA_TEXT`` characters."""
    names = known.__struct_fields__
    extra = {k: v for k, v in value.items() if k not in names}
    if len(extra) > MAX_EXTRA_KEYS:
        raise BadRequest(field, f"{len(extra)} unknown fields, at most {MAX_EXTRA_KEYS}")
    shaped({k: v for k, v in value.items() if k in names}, known, field)
    for key, item in extra.items():
        try:
            msgspec.convert(item, shapes.ExtraValue, strict=True)
        except msgspec.ValidationError as err:
            raise _said_again(str(err), item, shapes.ExtraValue, f"{field}.{key}") from None


_KIND = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
_KIND |= {"object": "an object", "array": "an array", "null": "null"}
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)


def _said_again(message: str, data: Any, shape: Any, field: str) -> BadRequest:
    """msgspec's ``Expected `int` <= 4194304 - at `$.holder.pid``` as this module says
    every 400: ``holder.pid: 2147483648 is out of range (1..4194304)``."""
    m = _AT.match(message)
    assert m is not None
    msg, path = m["msg"], m["path"] or "$"
    key_of = re.match(r"`key` in `(.*)`$", path)
    parts = re.findall(r"\[\.\.\.\]|\[\d+\]|[^.\[\]]+", (key_of[1] if key_of else path)[1:])
    if "[...]" in parts:  # a value in a handle or an attempt: find its key
        at = parts.index("[...]")
        inner = _value_at(data, parts[:at])
        if isinstance(inner, dict):
            for key, item in inner.items():
                try:
                    msgspec.convert(item, shapes.FreeValue, strict=True)
                except msgspec.ValidationError as err:
                    prefix = _joined([field, *parts[:at], key] if field else [*parts[:at], key])
                    return _said_again(str(err), item, shapes.FreeValue, prefix)
        parts = parts[:at]
    where = _joined([field, *parts] if field else parts)
    unknown = re.match(r"Object contains unknown field `(.*)`$", msg)
    if unknown:
        if parts and parts[-1] == "update" and isinstance(shape, type):
            # The store's own words, so both store paths say the same.
            return BadRequest(where, f"bad record update: unknown update key {unknown[1]!r}")
        return BadRequest(f"{where}.{unknown[1]}" if where else unknown[1], "unknown field")
    missing = re.match(r"Object missing required field `(.*)`$", msg)
    if missing:
        return BadRequest(f"{where}.{missing[1]}" if where else missing[1], "missing")
    if key_of:
        return BadRequest(where, f"a key: {_problem(msg, None, None)}")
    value = _value_at(data, parts)
    return BadRequest(where, _problem(msg, value, _type_at(shape, parts)))


def _joined(parts: list[str]) -> str:
    """A field's path as the 400s say it: ``promise.devices[0]``."""
    return "".join(p if p.startswith("[") or i == 0 else f".{p}" for i, p in enumerate(parts))


def _value_at(data: Any, parts: list[str]) -> Any:
    for part in parts:
        if part.startswith("["):
            i = int(part[1:-1])
            data = data[i] if isinstance(data, list) and i < len(data) else None
        else:
            data = data.get(part) if isinstance(data, dict) else None
    return data


def _type_at(shape: Any, parts: list[str]) -> Any:
    """The declared type (``msgspec.inspect``) at ``parts`` under ``shape``, or None."""
    t: Any = msgspec.inspect.type_info(shape)
    for part in [*parts, ""]:
        while True:
            if isinstance(t, msgspec.inspect.Metadata):
                t = t.type
            elif isinstance(t, msgspec.inspect.UnionType):
                kinds = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
                t = kinds[0] if len(kinds) == 1 else t
                if len(kinds) != 1:
                    break
            else:
                break
        if not part:
            return t
        if part.startswith("["):
            t = t.item_type if isinstance(t, msgspec.inspect.ListType) else None
            continue
        if not isinstance(t, msgspec.inspect.StructType):
            return None
        t = next((f.type for f in t.fields if f.encode_name == part), None)
    return t


def _problem(msg: str, value: Any, t: Any) -> str:
    """What the value should be, in words."""
    got = re.match(r"Expected `(.*)`, got `(.*)`$", msg)
    if got:
        want = " or ".join(_KIND.get(k, k) for k in got[1].split(" | "))
        return f"expected {want}, got {json_kind(value) if value is not None else got[2]}"
    if msg.startswith("Invalid enum value") and isinstance(t, msgspec.inspect.EnumType):
        return f"expected one of {', '.join(str(e.value) for e in t.cls)}"
    inspect = msgspec.inspect
    if isinstance(t, inspect.IntType | inspect.FloatType) and isinstance(value, int | float):
        low = f"{t.ge}" if t.ge is not None else f"more than {t.gt}"
        high = f"{t.le}" if t.le is not None else f"less than {t.lt}"
        if isinstance(t, inspect.FloatType):
            low = f"{t.ge:g}" if t.ge is not None else f"more than {t.gt:g}"
            high = f"{t.le:g}" if t.le is not None else f"less than {t.lt:g}"
        shown = value if isinstance(value, int) else f"{value:g}"
        return f"{shown} is out of range ({low}..{high})"
    if isinstance(t, inspect.StrType) and isinstance(value, str):
        if "matching regex" in msg:
            return f"{value[:80]!r} does not match {t.pattern}"
        return f"length {len(value)} is out of range ({t.min_length or 0}..{t.max_length})"
    return msg[:1].lower() + msg[1:]


def promise(value: Any, field: str) -> dict[str, Any]:
    """A start's promise, by the store's own schema (``codec.PROMISE_FIELDS``)."""
    try:
        decode_promise(value, at=f"$.{field}")
    except RecordError as err:
        raise BadRequest(err.where.removeprefix("$."), err.why) from None
    assert isinstance(value, dict)
    return value


def event(value: Any, field: str) -> Event:
    """A journal event (``core.events``), checked and bounded."""
    try:
        return event_from_dict(value)
    except ValueError as err:
        where, _, why = str(err).partition(": ")
        raise BadRequest(where if where.startswith("event") else field, why or str(err)) from None


def events_request(data: dict[str, Any]) -> list[Event]:
    """``POST /events``: events that ride on no record write (at most ``MAX_EVENTS``)."""
    args = obj(data, "", {"events": lambda v, f: v}, required=("events",))
    items = args["events"]
    if not isinstance(items, list) or len(items) > MAX_EVENTS:
        raise BadRequest("events", f"expected a list of at most {MAX_EVENTS} events")
    return [event(item, f"events[{i}]") for i, item in enumerate(items)]


MAX_EVENTS = 16


def _event_of(data: dict[str, Any]) -> dict[str, Event]:
    """The journal's event riding on a record write, checked (none when not sent)."""
    return {"event": event(data["event"], "event")} if "event" in data else {}


def holder(value: Any, field: str) -> dict[str, Any]:
    """A holder (``shapes.Holder``), as the dict it came in."""
    shaped(value, shapes.Holder, field)
    assert isinstance(value, dict)
    return value


def lease_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder`` (as it came), ``ttl_s``, ``promise`` (a dict or None)."""
    body = shaped(data, shapes.LeaseRequest)
    if body.promise is not None:
        promise(data["promise"], "promise")
    return {
        "holder": data["holder"],
        "ttl_s": body.ttl_s,
        "promise": data.get("promise"),
        **_event_of(data),
    }


def renew_request(data: dict[str, Any]) -> dict[str, Any]:
    body = shaped(data, shapes.RenewRequest)
    return {"holder": body.holder, "ttl_s": body.ttl_s}


def holder_update(data: dict[str, Any]) -> dict[str, Any]:
    """``holder`` (its id) and ``update`` (a ``RecordUpdate``)."""
    body = shaped(data, shapes.HolderUpdate)
    return {"holder": body.holder, "update": body.update, **_event_of(data)}


def release_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder`` (its id) and ``update`` (a ``RecordUpdate``, or None)."""
    body = shaped(data, shapes.ReleaseRequest)
    return {"holder": body.holder, "update": body.update, **_event_of(data)}


# In-flight and queue entries are files named by their holder's id (gpuctl's are uuid
# hex): ``shapes.EntryId``, matched in full here.
INFLIGHT_ID = ENTRY_ID


def _entry_id(value: str, field: str) -> str:
    """Override: msgspec matches a pattern with ``re.search``, whose ``$`` passes a last
    newline; a file name must match in full."""
    if not ENTRY_ID.fullmatch(value):
        raise BadRequest(field, f"{value[:80]!r} does not match ^{ENTRY_ID.pattern}$")
    return value


def inflight_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder`` (as it came) and ``ttl_s``."""
    body = shaped(data, shapes.InflightRequest)
    _entry_id(body.holder.id, "holder.id")
    return {"holder": data["holder"], "ttl_s": body.ttl_s}


def end_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder``: the entry's holder id; ``linger_s``: how long it lingers."""
    body = shaped(data, shapes.InflightEnd)
    return {"holder": _entry_id(body.holder, "holder"), "linger_s": body.linger_s}


def touch_request(data: dict[str, Any]) -> dict[str, Any]:
    """``ready`` and ``promise`` (a dict or None), where the body has them."""
    body = shaped(data, shapes.TouchRequest)
    if body.promise is not None:
        promise(data["promise"], "promise")
    return {k: data[k] for k in ("ready", "promise") if k in data}


# ---- the wait queue (POST /records/_queue, …/leave): the store's own entry schema


def queue_join_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder`` (as it came), ``ttl_s``, ``name``, ``priority``, ``memory_mib``."""
    body = shaped(data, shapes.QueueJoin)
    _entry_id(body.holder.id, "holder.id")
    if not is_valid_name(body.name):  # Override: in full, as ``_entry_id``.
        raise BadRequest("name", f"expected a name: {NAME_RULE}")
    return {
        "holder": data["holder"],
        "ttl_s": body.ttl_s,
        "name": body.name,
        "priority": body.priority,
        "memory_mib": body.memory_mib,
    }


def queue_leave_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder``: the entry's holder id."""
    return {"holder": _entry_id(shaped(data, shapes.QueueLeave).holder, "holder")}


def job_stop_request(data: dict[str, Any]) -> dict[str, Any]:
    """``holder``, ``pid``, ``pid_start`` and, where the body has it, ``grace_s``."""
    body = shaped(data, shapes.JobStopRequest)
    out: dict[str, Any] = {"holder": body.holder, "pid": body.pid, "pid_start": body.pid_start}
    if not isinstance(body.grace_s, shapes.UnsetType):
        out["grace_s"] = body.grace_s
    return out
