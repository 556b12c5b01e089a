"""A small declarative checker for JSON values, standard library only.

Each check is a function ``(value, where) -> value`` that returns the value (an object
as a new dict) or raises ``RecordError`` saying where and why (``at $.lease.pid: …``).
Checks compose: ``obj`` takes a table of fields, ``array`` an item check,
``nullable`` any check. ``codec`` declares the record's tables with them.

Types are exact: ``true`` is not an integer, ``1.0`` is not a pid, ``"no"`` is not a
boolean; numbers are finite; strings are valid Unicode; nothing nests beyond the tables.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from gpuctl.core.json_kind import json_kind
from gpuctl.core.record import MAX_EXTRA_KEYS

__all__ = ["MAX_EXTRA_KEYS"]


class RecordError(ValueError):
    """A record (or a holder) that does not fit the schema, located: ``at $.lease.pid: …``."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"at {where}: {why}")
        self.where = where
        self.why = why


Check = Callable[[Any, str], Any]
REQUIRED: Final = object()
ABSENT: Final = object()  # an optional key that stays absent when it is not given


def integer(lo: int, hi: int) -> Check:
    def check(v: Any, at: str) -> int:
        # bool is an int to Python, never to a record: ``true`` is not pid 1.
        if type(v) is not int:
            raise RecordError(at, f"expected an integer, got {json_kind(v)}")
        if not lo <= v <= hi:
            raise RecordError(at, f"{v} is out of range ({lo}..{hi})")
        return v

    return check


def number(lo: float, hi: float) -> Check:
    def check(v: Any, at: str) -> float:
        if type(v) is not int and type(v) is not float:
            raise RecordError(at, f"expected a number, got {json_kind(v)}")
        if not math.isfinite(v):
            raise RecordError(at, f"{v} is not a finite number")
        if not lo <= v <= hi:
            raise RecordError(at, f"{v:g} is out of range ({lo:g}..{hi:g})")
        return float(v)

    return check


def text(max_len: int, *, min_len: int = 0, pattern: re.Pattern[str] | None = None) -> Check:
    def check(v: Any, at: str) -> str:
        if type(v) is not str:
            raise RecordError(at, f"expected a string, got {json_kind(v)}")
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


def one_of(*values: Any) -> Check:
    def check(v: Any, at: str) -> Any:
        # type() too: 1.0 == 1 and True == 1, but neither is schema 1.
        if not any(type(v) is type(x) and v == x for x in values):
            shown = ", ".join(json.dumps(x) for x in values)
            raise RecordError(at, f"{json.dumps(v)[:80]} is not one of {shown}")
        return v

    return check


def nullable(inner: Check) -> Check:
    def check(v: Any, at: str) -> Any:
        return None if v is None else inner(v, at)

    return check


def array(item: Check, max_len: int) -> Check:
    def check(v: Any, at: str) -> list[Any]:
        if type(v) is not list:
            raise RecordError(at, f"expected an array, got {json_kind(v)}")
        if len(v) > max_len:
            raise RecordError(at, f"{len(v)} items, at most {max_len}")
        return [item(x, f"{at}[{i}]") for i, x in enumerate(v)]

    return check


_ANY_KEY = text(64, min_len=1)


def scalar(v: Any, at: str) -> Any:
    """A free value in a handle or an attempt: a scalar, never a nest."""
    if v is None or type(v) is bool:
        return v
    if type(v) is int:
        return integer(-(2**53), 2**53)(v, at)
    if type(v) is float:
        return number(-1e15, 1e15)(v, at)
    if type(v) is str:
        return text(4096)(v, at)
    raise RecordError(at, f"expected a string, number, boolean or null, got {json_kind(v)}")


def obj(fields: Mapping[str, tuple[Check, Any]], *, extra: Check | None = None) -> Check:
    """An object with these fields ((check, default) each; ``REQUIRED`` has none).

    Unknown keys are refused, except where ``extra`` checks them (a launcher's handle
    may carry more than gpuctl reads).
    """

    table = tuple((name, inner, default) for name, (inner, default) in fields.items())
    # The children's paths, per parent path: formatted once, not on every read (the
    # agent checks every record on every /records).
    paths: dict[str, tuple[str, ...]] = {}

    def check(v: Any, at: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise RecordError(at, f"expected an object, got {json_kind(v)}")
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
            elif default is REQUIRED:
                raise RecordError(here, "missing")
            elif default is not ABSENT:
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
