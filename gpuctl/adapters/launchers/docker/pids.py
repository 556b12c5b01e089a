"""The host pid of a container's server: behind Docker's init, not the init itself."""

from __future__ import annotations

import time
from typing import Any

# The init process Docker injects with ``init=True``; the server is its only child.
_INIT_NAMES = ("docker-init", "tini", "tini-static")


def server_pid(ct: Any, init_pid: int, *, local: bool) -> int:
    """The host pid of the server: the only child of Docker's init, else ``State.Pid``.

    With ``init=True`` and a private PID namespace, ``State.Pid`` is ``docker-init``, not
    the server; the server is what the GPU probe reports and what ``match`` keywords see.
    With ``pid_mode = "host"`` Docker adds no init, and ``State.Pid`` is the server.
    """
    if init_pid <= 0:
        return 0
    deadline = time.monotonic() + 1.0
    while True:
        child = _init_child(ct, init_pid, local=local)
        if child is not None:
            return child or init_pid
        if time.monotonic() >= deadline:
            return init_pid
        time.sleep(0.02)  # the init forks its child right after it starts


def _init_child(ct: Any, init_pid: int, *, local: bool) -> int | None:
    """The init's single child; 0 when ``init_pid`` is no init or cannot be read; None when
    the init has no child yet."""
    kids: list[int]
    if local:
        import psutil

        try:
            proc = psutil.Process(init_pid)
            if proc.name() not in _INIT_NAMES:
                return 0
            kids = [c.pid for c in proc.children()]
        except (psutil.Error, OSError):
            return 0
    else:
        # A remote engine: ask it (``docker top``; the engine runs ps on its host).
        try:
            top = ct.top()
            titles = [t.upper() for t in top["Titles"]]
            i_pid, i_ppid, i_cmd = titles.index("PID"), titles.index("PPID"), titles.index("CMD")
            rows = top["Processes"] or []
            init = [r for r in rows if r[i_pid] == str(init_pid)]
            if not init or not any(n in init[0][i_cmd] for n in _INIT_NAMES):
                return 0
            kids = [int(r[i_pid]) for r in rows if r[i_ppid] == str(init_pid)]
        except Exception:
            return 0
    if len(kids) == 1:
        return kids[0]
    return None if not kids else 0
