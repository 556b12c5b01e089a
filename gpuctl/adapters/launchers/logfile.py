"""A server's log file: opened without following a symbolic link, private whatever the umask,
and rotated by size.

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
# A server that runs for weeks must not fill the disk: past this size its log is rotated
# (at its next start, and by each `gpuctl reclaim` on the host), keeping this many old ones.
LOG_MAX_BYTES = 64 * 2**20
LOG_KEEP = 3


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
        rotate(path)
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


def rotate(path: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> bool:
    """Rotate ``path`` when it is larger than ``max_bytes``: ``.1`` … ``.{keep}``.

    Copy, then truncate (logrotate's ``copytruncate``): the running server keeps its
    descriptor, opened with ``O_APPEND`` (``>>`` in a shell), so its next line lands at
    the start of the emptied file. Symbolic links are never followed or rotated. Returns
    whether it rotated; never raises (a log it cannot rotate is left as it is).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
            return False
        for n in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.is_file() and not older.is_symlink():
                os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
        first = path.with_name(f"{path.name}.1")
        if first.is_symlink():
            return False
        out = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(out, stat.S_IMODE(st.st_mode))
            os.lseek(fd, 0, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(out)
        os.ftruncate(fd, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def rotate_all(folder: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> list[str]:
    """Rotate every ``*.log`` in ``folder`` over ``max_bytes``; returns the ones rotated."""
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.name.endswith(".log"))
    except OSError:
        return []
    return [n for n in names if rotate(folder / n, max_bytes, keep)]
