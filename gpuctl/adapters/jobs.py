"""Stopping a ``gpuctl run`` job's CMD: it runs in its own session (its pid is its
process group), so the whole group gets SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from gpuctl.adapters import procinfo
from gpuctl.errors import LauncherError

# How long a preempted job gets between SIGTERM and SIGKILL to save its work.
JOB_GRACE_S = 10.0


def stop_job(handle: dict[str, Any], grace_s: float = JOB_GRACE_S) -> bool:
    """SIGTERM the job's process group, wait up to ``grace_s``, then SIGKILL. Returns
    whether it had to be killed.

    Raises:
        LauncherError: the job runs on another machine (its pid means nothing here), or
            its handle names no pid.
    """
    pid, started = handle.get("pid"), handle.get("pid_start")
    if not isinstance(pid, int):
        raise LauncherError("the job's record names no pid")
    here = procinfo.host_identity()
    if (handle.get("host"), handle.get("boot_id")) != (here.hostname, here.boot_id):
        raise LauncherError(
            f"job pid {pid} runs on {handle.get('host') or 'another machine'}, not here",
            hint="run the preempting command on the GPU host",
        )
    start = float(started) if isinstance(started, int | float) else None
    if not procinfo.is_same_process(pid, start):
        return False  # it has ended already (or its pid went to another process)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not procinfo.is_same_process(pid, start):
            return False
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return True
