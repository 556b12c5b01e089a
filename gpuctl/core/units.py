"""Sizes and durations: parse what users write, format what users read.

Sizes are kept in MiB (NVML's and nvidia-smi's unit). ``80GiB``, ``80G`` and
``80GB`` all mean 80 GiB: GPU memory is sold and reported in binary units, and a
user who writes ``80GB`` for an 80 GiB card means the card. A size without a unit is
refused: ``memory = 20`` is 20 GiB meant far more often than 20 MiB.

Every parser refuses what would poison arithmetic downstream: ``inf`` and ``nan``
(``float()`` accepts both), values that overflow to infinity (``1e400``), negatives,
zero unless the caller says zero means something, and values past a sane bound
(``time.sleep(1e300)`` raises OverflowError; an exabyte GPU is a typo).
"""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE | re.ASCII)
_SIZE_MIB = {"b": 1 / 2**20, "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0**2}

_DUR_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", re.IGNORECASE | re.ASCII)
_DUR_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_RE = re.compile(r"\s*\d+(?:\.\d+)?\s*", re.ASCII)

# Longer than any size or duration anyone writes ("1h 30m 15s 250ms" is 16).
_MAX_TEXT = 64
# One PiB: far above any GPU or shared-memory size, far below int overflow anywhere.
MAX_SIZE_MIB = 1024**3
# One year: longer than any timeout or idle period anyone means; `time.sleep`,
# `threading.Event.wait` and deadlines stay finite and representable.
MAX_DURATION_S = 365 * 86400.0


def parse_size_mib(text: str | int | float, *, allow_zero: bool = False) -> int:
    """Parse ``80GiB`` / ``30G`` / ``512MiB`` / ``1.5T`` into MiB.

    Every size needs its unit: a bare number (``20``, ``"20"``, ``20.5``) is refused with
    both readings (``"20GiB"`` or ``"20MiB"``), since whoever writes ``memory = 20`` most
    likely means GiB, and a 20 MiB budget fits beside anything. This is the one parser of
    sizes: the config, the CLI's options and the sim all refuse the same way. Raises
    ValueError with a message fit for a user: the value must be finite, at least 1 MiB (or
    exactly 0 with ``allow_zero``) and at most 1 PiB.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size like '80GiB', got {_shown(text)}")
    if is_bare_number(text):
        raise ValueError(bare_number_message(text))
    if not isinstance(text, str):
        raise ValueError(f"expected a size like '80GiB', got {_shown(text)}")
    m = _SIZE_RE.fullmatch(text) if len(text) <= _MAX_TEXT else None
    if not m or not m.group(2):
        raise ValueError(f"expected a size like '80GiB' or '512MiB', got {_shown(text)}")
    value = float(m.group(1))
    mib = value * _SIZE_MIB[m.group(2)[0].lower()]
    shown = _shown(text)
    if math.isnan(mib):
        raise ValueError(f"expected a size like '80GiB', got {shown}")
    if mib < 0:
        raise ValueError(f"a size must be positive, got {shown}")
    if mib > MAX_SIZE_MIB:
        raise ValueError(f"a size must be at most 1024TiB, got {shown}")
    result = round(mib)
    if result == 0 and not (allow_zero and mib == 0):
        raise ValueError(f"a size must be at least 1MiB, got {shown}")
    return result


def is_bare_number(value: object) -> bool:
    """Whether a size was written without a unit (``20``, ``"20"``, ``20.5``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    return isinstance(value, str) and len(value) <= _MAX_TEXT and bool(_NUMBER_RE.fullmatch(value))


def bare_number_message(value: object) -> str:
    """Why a bare number is refused as a size, naming both readings: ``a size needs its
    unit, got 20: write "20GiB" or "20MiB"``. A fraction's MiB reading is rounded up (a
    budget rounded up never promises too little)."""
    text = str(value).strip() if not isinstance(value, float) else f"{value:g}"
    if len(text) > 24 or not _NUMBER_RE.fullmatch(text):
        # 1e-300, a huge integer: no "GiB" form the size syntax could read back.
        return f"a size needs its unit, like '80GiB' or '512MiB', got {_shown(value)}"
    whole = max(1, math.ceil(float(text)))
    return f'a size needs its unit, got {_shown(value)}: write "{text}GiB" or "{whole}MiB"'


def parse_duration_s(text: str | int | float, *, allow_zero: bool = False) -> float:
    """Parse ``30m`` / ``600s`` / ``1h30m`` / ``250ms`` into seconds. A bare number is seconds.

    Raises ValueError with a message fit for a user: the value must be finite, more than
    0 (or exactly 0 with ``allow_zero``) and at most 365 days.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a duration like '30m', got {_shown(text)}")
    if isinstance(text, int):
        total = float(text) if abs(text) < 2**63 else (-math.inf if text < 0 else math.inf)
    elif isinstance(text, float):
        total = text
    elif isinstance(text, str):
        total = _duration_text(text)
    else:
        raise ValueError(f"expected a duration like '30m', got {_shown(text)}")
    return _check_duration(total, _shown(text), allow_zero)


def _duration_text(text: str) -> float:
    s = text.strip()
    if len(s) > _MAX_TEXT:
        # Scanning a long run of digits for a unit is quadratic; no duration is this long.
        raise ValueError(f"expected a duration like '30m', '600s' or '1h30m', got {_shown(text)}")
    if _NUMBER_RE.fullmatch(s):
        return float(s)
    pos = 0
    total = 0.0
    for m in _DUR_RE.finditer(s):
        if s[pos : m.start()].strip():
            break
        total += float(m.group(1)) * _DUR_S[m.group(2).lower()]
        pos = m.end()
    if pos == 0 or s[pos:].strip():
        if s.lstrip().startswith("-"):
            raise ValueError(f"a duration cannot be negative, got {_shown(text)}")
        raise ValueError(f"expected a duration like '30m', '600s' or '1h30m', got {_shown(text)}")
    return total


MIN_DURATION_S = 0.001


def _check_duration(total: float, shown: str, allow_zero: bool) -> float:
    if math.isnan(total):
        raise ValueError(f"expected a duration like '30m', got {shown}")
    if total < 0:
        raise ValueError(f"a duration cannot be negative, got {shown}")
    if total > MAX_DURATION_S:
        raise ValueError(f"a duration must be at most 365d, got {shown}")
    if total == 0 and not allow_zero:
        raise ValueError(f"a duration must be more than 0, got {shown}")
    if 0 < total < MIN_DURATION_S:
        # 1e-300 s passed as "more than 0": no timeout or wait of gpuctl's is that short.
        raise ValueError(f"a duration must be at least 1ms, got {shown}")
    return total


def _shown(value: object) -> str:
    """A value for an error message, cut short: input can be a huge string or a deep list."""
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= 60 else text[:57] + "..."


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


def plural(n: int, word: str) -> str:
    """``1 host``, ``2 hosts``, ``0 services``: a count and its noun (regular plurals)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
