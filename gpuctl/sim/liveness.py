"""Who holds a claim's flock, and whether that process still lives (a zombie is dead).

``/proc/locks`` names each flock's holder in the reader's PID namespace, which is how a
host sees the real pid of a claim made in a container.
"""

from __future__ import annotations

import functools
import os


class LockTable:
    """Who holds which flock, from ``/proc/locks`` (Linux), read lazily once per scan.

    The kernel shows each locker's pid in the reader's PID namespace (0 when it lives
    outside it), which is how a host sees the real pid of a claim made in a container.
    """

    def __init__(self) -> None:
        self._entries: dict[int, list[tuple[int, int, int]]] | None = None
        self._reloaded = False

    def holder(self, st_dev: int, st_ino: int) -> int | None:
        """The locker's pid (0: outside our PID namespace), or None when not listed."""
        if self._entries is None:
            self._entries = read_proc_locks()
        found = self._lookup(st_dev, st_ino)
        if found is None and not self._reloaded:
            # Loaded before this lock was taken (a claim born during the scan): look again,
            # once, rather than judge a live claim by a pid from another namespace.
            self._reloaded = True
            self._entries = read_proc_locks()
            found = self._lookup(st_dev, st_ino)
        return found

    def _lookup(self, st_dev: int, st_ino: int) -> int | None:
        found = (self._entries or {}).get(st_ino)
        if not found:
            return None
        major, minor = os.major(st_dev), os.minor(st_dev)
        for maj, mnr, pid in found:
            if (maj, mnr) == (major, minor):
                return pid
        # Overlay file systems can show another device number than stat() does; one
        # lock on that inode number is still ours.
        return found[0][2] if len(found) == 1 else None


def read_proc_locks() -> dict[int, list[tuple[int, int, int]]]:
    """Parse ``/proc/locks`` into inode → [(major, minor, pid)]; empty where unreadable."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    entries: dict[int, list[tuple[int, int, int]]] = {}
    # "1: FLOCK  ADVISORY  WRITE 4459 fe:00:2146324 0 EOF"; "1: -> FLOCK ..." are waiters.
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            pid = int(parts[4])
            maj_s, min_s, ino_s = parts[5].split(":")
            entries.setdefault(int(ino_s), []).append((int(maj_s, 16), int(min_s, 16), pid))
        except ValueError:
            continue
    return entries


@functools.cache
def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), or None without /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie (a zombie has exited: where PID 1 does not
    reap orphans, ``kill(pid, 0)`` still succeeds on it)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
        return _kill0(pid)  # no /proc here (macOS): existence is all we can learn
    except OSError:
        return _kill0(pid)
    # The command name may contain spaces and parentheses; the state follows the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] not in ("Z", "X", "x")


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
