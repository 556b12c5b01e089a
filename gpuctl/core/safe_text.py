"""Text from outside (other processes' command lines, user names, record fields, an
agent's wire strings, error messages quoting them) made safe to show.

A command line is whatever its process put in argv: ``A\\x1b[2J\\x1b]0;pwn\\x07B``
printed raw clears the viewer's screen and retitles their terminal. One rule for the
terminal, one for JSON:

- ``visible``: C0 controls (``\\n`` and ``\\t`` included, unless ``keep_newlines``),
  DEL, C1 controls and the bidirectional overrides and isolates (which reorder what
  the reader sees) are shown as Python escapes (``\\x1b``, ``\\u202e``); a byte that
  was not UTF-8 (read with ``surrogateescape``: U+DC80..U+DCFF) as ``\\xff``, any other
  lone surrogate as ``\\udXXX``. A backslash stays as it is (Windows paths, regexes),
  so ``\\x1b`` typed literally reads the same as an escaped ESC: shown, never acted on.
- ``json_safe``: only the lone surrogates change, by the same backslash rule
  (backslashreplace: ``\\udcff`` becomes the four characters ``\\xff``), so the JSON
  is UTF-8 a strict parser accepts; controls stay data (JSON escapes them itself).

Rich markup is the renderer's part: external text goes in as ``Text``, never as a
markup string (``gpuctl.render.safe``).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

# C0 but newline, DEL, C1; bidi embeddings/overrides (202A-202E), isolates (2066-2069);
# lone surrogates. Tab is escaped too: it would shift a table's columns.
_UNSAFE_KEEP_NL = "[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
_UNSAFE = "[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
_SURROGATE = re.compile("[\ud800-\udfff]")


@cache
def _unsafe(keep_newlines: bool) -> re.Pattern[str]:
    # Compiled on first use: these two classes cost about 1 ms to compile, paid by every
    # CLI start when they were module constants, and ``status --json`` never needs them.
    return re.compile(_UNSAFE_KEEP_NL if keep_newlines else _UNSAFE)


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:
        return f"\\x{c - 0xDC00:02x}"  # surrogateescape's stand-in for a raw byte
    if c <= 0xFF:
        return f"\\x{c:02x}"
    return f"\\u{c:04x}"


def visible(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control, bidi override and lone surrogate escaped."""
    return _unsafe(keep_newlines).sub(_escape, text)


def json_safe(obj: Any) -> Any:
    """``obj`` (JSON-shaped) with lone surrogates in its strings and keys escaped."""
    if isinstance(obj, str):
        return _SURROGATE.sub(_escape, obj)
    if isinstance(obj, dict):
        return {json_safe(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
