"""Pids a test started, killed at its end only while the same process still holds them.

A suite run spawns tens of thousands of processes; with the kernel's default pid_max
(32768) the pid space wraps within a run. A cleanup that kills a remembered pid (or its
process group) after that process ended may hit an unrelated process that took the number,
another test's proxy or agent, started in a session of its own (so its group id is its
pid). Each pid is kept with its start time, and killed only while they still agree.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator

import psutil


class OwnPids:
    """``append(pid)`` as a list would; ``kill_all()`` at the end."""

    def __init__(self) -> None:
        self._started: list[tuple[int, float]] = []

    def append(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self._started.append((pid, psutil.Process(pid).create_time()))

    def extend(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.append(pid)

    def __iter__(self) -> Iterator[int]:
        return (pid for pid, _ in self._started)

    def __len__(self) -> int:
        return len(self._started)

    def kill_all(self, *, group: bool = False) -> None:
        """SIGKILL each still-same process (``group``: its process group too, when it
        leads one). A zombie is left for its parent to reap."""
        for pid, started in self._started:
            try:
                proc = psutil.Process(pid)
                if proc.create_time() != started or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                leads = os.getpgid(pid) == pid
            except (psutil.Error, OSError):
                continue
            with contextlib.suppress(OSError):
                if group and leads:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
