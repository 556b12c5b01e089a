"""``replace``: a copy of a value with some fields changed, for both kinds of value class.

gpuctl's values and bags of ports are msgspec Structs (their classes are built in C: a
dataclass costs about 0.5 ms of CPU to create, and a command imports ~90 of them at
every start); ``gpuctl.sim`` keeps to the standard library and its dataclasses, and a
caller may hand in its own. One ``replace`` serves both, so a caller never has to know
which kind a value is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

import msgspec

T = TypeVar("T")


def replace(obj: T, /, **changes: Any) -> T:
    """``obj`` with ``changes`` applied (a Struct or a dataclass; the original is kept)."""
    if isinstance(obj, msgspec.Struct):
        return msgspec.structs.replace(obj, **changes)
    return cast(T, dataclasses.replace(cast(Any, obj), **changes))
