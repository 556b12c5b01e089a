"""The one timestamp form of everything gpuctl prints or serves: ISO-8601 UTC with
milliseconds, ``2026-11-29T10:00:00.123Z``."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def iso_utc(t: float | None = None) -> str:
    """``t`` (seconds since the epoch; default now) in the one form."""
    when = datetime.fromtimestamp(time.time() if t is None else t, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def normalise_iso(text: str | None) -> str | None:
    """Another ISO-8601 timestamp (an older agent's, without milliseconds) in the one form;
    text that does not parse is returned as it is, never dropped."""
    if not text:
        return text
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return iso_utc(when.timestamp())
