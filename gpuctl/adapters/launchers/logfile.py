"""A server's log file: opened without following a symbolic link, private whatever the umask.

A log that is a symbolic link (planted, or left over) would make the server write into
another file, and its tail would be copied into the record. ``O_NOFOLLOW`` refuses it.
The mode is set with ``fchmod``, which the umask does not narrow or widen: 0600, or 0640
in a setgid folder (one shared through a group, as a shared state folder is).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuctl.errors import StartFailed

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def log_mode(folder: Path) -> int:
    """0640 where the folder is shared through its group (setgid), else 0600."""
    try:
        shared = bool(os.stat(folder).st_mode & stat.S_ISGID)
    except OSError:
        shared = False
    return 0o640 if shared else 0o600


def open_log(path: Path, service: str) -> int:
    """Open (create) ``path`` for appending; return the descriptor.

    Raises:
        StartFailed: the log is a symbolic link, or cannot be created.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, _FLAGS, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StartFailed(
                f"the log {path} of {service} is a symbolic link; gpuctl does not follow it",
                hint=f"remove the link, or set services.{service}.log to a plain file",
            ) from None
        raise StartFailed(f"cannot open the log {path}: {e.strerror or e}") from None
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, log_mode(path.parent))
    except OSError:
        os.close(fd)
        raise
    return fd


def tail_file(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a file, reading only its end ('' for a symbolic link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        try:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
        except OSError:
            return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])
