"""Sizes and durations: parse what users write, format what users read.

Sizes are kept in MiB (NVML's and nvidia-smi's unit). ``80GiB``, ``80G`` and
``80GB`` all mean 80 GiB: GPU memory is sold and reported in binary units, and a
user who writes ``80GB`` for an 80 GiB card means the card.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_MIB = {"b": 1 / 2**20, "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0**2}

_DUR_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", re.IGNORECASE)
_DUR_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size_mib(text: str | int | float) -> int:
    """Parse ``80GiB`` / ``30G`` / ``512MiB`` / ``1.5T`` into MiB.

    A bare number is MiB. Raises ValueError with a message fit for a user.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size like '80GiB', got {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return int(text)
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"expected a size like '80GiB' or '512MiB', got {text!r}")
    value = float(m.group(1))
    unit = (m.group(2) or "m")[0].lower()
    return round(value * _SIZE_MIB[unit])


def parse_duration_s(text: str | int | float) -> float:
    """Parse ``30m`` / ``600s`` / ``1h30m`` / ``250ms`` into seconds. A bare number is seconds."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration like '30m', got {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"a duration cannot be negative: {text}")
        return float(text)
    s = text.strip()
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {text!r}")
        return value
    pos = 0
    total = 0.0
    for m in _DUR_RE.finditer(s):
        if s[pos : m.start()].strip():
            break
        total += float(m.group(1)) * _DUR_S[m.group(2).lower()]
        pos = m.end()
    if pos == 0 or s[pos:].strip():
        raise ValueError(f"expected a duration like '30m', '600s' or '1h30m', got {text!r}")
    return total


def format_mib(mib: float | None) -> str:
    """``81920`` → ``80.0 GiB``; ``None`` → ``n/a``."""
    if mib is None:
        return "n/a"
    if abs(mib) >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB"


def format_duration(seconds: float | None) -> str:
    """``3725`` → ``1h02m``; ``42`` → ``42s``; ``None`` → ``-``."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 0:
        return "-" + format_duration(-seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"
