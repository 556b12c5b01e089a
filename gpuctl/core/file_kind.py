"""What a path that should be a regular file is instead, in words for an error.

gpuctl reads and writes only regular files under its folders (records, locks, logs,
token files); anything else (a FIFO that would block a read, a device, a folder) is
refused by name, so the message says what was found there."""

from __future__ import annotations

import stat


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a folder"``, ``"a socket"``, ``"a device"``, or ``"not a
    regular file"`` for anything else that is not one, from ``st_mode``."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_regular(mode: int) -> str:
    """What was found, for "it is …": ``"a FIFO, not a regular file"``."""
    kind = file_kind(mode)
    return f"{kind}, not a regular file" if kind != "not a regular file" else kind
