"""Failpoints: named places in a start where a test can pause or kill gpuctl on purpose.

The races that matter happen in windows of milliseconds (a server spawned, its caller
not yet done recording it). A test switches a failpoint on through the environment of
the gpuctl it runs, and so lands in that window every time::

    GPUCTL_FAILPOINTS='ensure.after_spawn=pause' gpuctl ensure vllm &
    # ... wait for "gpuctl failpoint ensure.after_spawn: pause" on its stderr, then
    kill -9 $!

Actions: ``pause`` (print that line, then sleep until a signal ends the process; SIGINT
raises KeyboardInterrupt as Ctrl-C does), ``kill`` (SIGKILL itself), ``interrupt``
(raise KeyboardInterrupt), ``sleep:<seconds>`` (a delay, to widen a window), ``stop``
(print ``gpuctl failpoint NAME: stop (pid N)``, then SIGSTOP itself: the test does
something in that window, then sends SIGCONT and the process goes on). With
``GPUCTL_FAILPOINTS_DIR`` set, a paused process also creates ``<dir>/<name>.<pid>``.

The same variable shortens a duration that a test would otherwise wait out in a
subprocess it cannot reach (``seconds``): ``GPUCTL_FAILPOINTS='run_queue.ttl=seconds:6'``
(the run queue's TTL), ``ensure.backoff=seconds:<s>`` (the first back-off after a failed
start, read by the process that writes the record: the agent, or the caller without one),
``store.lock_timeout=seconds:<s>`` (how long the store waits for a service's file lock).

Unset (always, outside tests), ``hit`` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

ENV = "GPUCTL_FAILPOINTS"
DIR_ENV = "GPUCTL_FAILPOINTS_DIR"

_active: dict[str, str] | None = None


def _parse(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.replace(",", ";").split(";"):
        name, sep, action = item.strip().partition("=")
        if name and sep:
            out[name.strip()] = action.strip()
    return out


def hit(name: str) -> None:
    """Run the action switched on for ``name``, if any."""
    global _active  # noqa: PLW0603  (parsed once per process)
    if _active is None:
        _active = _parse(os.environ.get(ENV, ""))
    action = _active.get(name)
    if not action:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "stop":
        sys.stderr.write(f"gpuctl failpoint {name}: stop (pid {os.getpid()})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if action.startswith("sleep:"):
        time.sleep(float(action.removeprefix("sleep:")))
        return
    if action == "pause":
        where = os.environ.get(DIR_ENV)
        if where:
            Path(where, f"{name}.{os.getpid()}").touch()
        sys.stderr.write(f"gpuctl failpoint {name}: pause (pid {os.getpid()})\n")
        sys.stderr.flush()
        while True:
            time.sleep(3600)


def seconds(name: str, default: float) -> float:
    """``default``, or the duration a test set for ``name`` (``NAME=seconds:<s>``): a TTL
    or a back-off shortened so the test waits seconds for it, not a quarter of a minute."""
    global _active  # noqa: PLW0603  (parsed once per process)
    if _active is None:
        _active = _parse(os.environ.get(ENV, ""))
    action = _active.get(name, "")
    return float(action.removeprefix("seconds:")) if action.startswith("seconds:") else default


def reset() -> None:
    """Read ``GPUCTL_FAILPOINTS`` again on the next hit (for in-process tests)."""
    global _active  # noqa: PLW0603
    _active = None
