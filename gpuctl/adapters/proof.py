"""The proof a process carries that gpuctl started it: marks in its environment.

A record is writable by every write-token holder and every member of the state folder's
group, so the pid it names proves nothing: before any signal, the process must carry in
its own environment the marks its start put there (a random nonce the record also
keeps). Another user's process never carries them, whatever a record says; a process
whose environment cannot be read is not signalled either.

::

    tr '\\0' '\\n' </proc/PID/environ | grep -x GPUCTL_START_NONCE=<nonce>
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from gpuctl.errors import Unproven

# A nonce shorter than this could be guessed (or be empty): it proves nothing.
MIN_NONCE_LEN = 16


def require_env(
    pid: int,
    marks: Mapping[str, object],
    what: str,
    hint: str,
    *,
    lacks: str = "the marks its start put there",
    proc_root: str = "/proc",
) -> None:
    """Refuse unless ``pid``'s environment carries every ``NAME=value`` of ``marks``.

    Args:
        what: the process the marks would make it, for the message ("run.x's CMD").
        hint: the fix, for the message.
        lacks: what the marks are, for the message.

    Raises:
        Unproven: a mark is missing, a value is too short to prove anything, or the
            environment cannot be read: never signal it.
    """
    weak = [
        k
        for k, v in marks.items()
        if not isinstance(v, str) or not v or (k.endswith("_NONCE") and len(v) < MIN_NONCE_LEN)
    ]
    if not marks or weak:
        raise Unproven(f"pid {pid} is not known to be {what}: its record has no proof", hint)
    try:
        entries = set(_environ(pid, proc_root).split(b"\0"))
    except OSError as e:
        raise Unproven(
            f"cannot read pid {pid}'s environment ({e.strerror or e}): "
            f"not signalling what may not be {what}",
            "run gpuctl (or the agent) as the user who runs it, or as root",
        ) from None
    if not {f"{k}={v}".encode() for k, v in marks.items()} <= entries:
        raise Unproven(
            f"pid {pid} is not {what} (its environment lacks {lacks})",
            hint,
        )


# A process in the middle of its exec shows an empty environment for a moment (the
# kernel swaps its memory): read it again for up to this long before judging.
_EXEC_GRACE_S = 0.5


def _environ(pid: int, proc_root: str) -> bytes:
    """``/proc/PID/environ``; read again while it is empty, for up to ``_EXEC_GRACE_S``
    (a server gpuctl just spawned may still be inside its exec; an empty environment
    never carries a proof anyway, so waiting costs only that moment)."""
    deadline = time.monotonic() + _EXEC_GRACE_S
    while True:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            data = f.read()
        if data or time.monotonic() >= deadline:
            return data
        time.sleep(0.02)


def has_env(pid: int, name: str, proc_root: str = "/proc") -> bool:
    """Whether ``pid``'s environment sets ``name`` (False where it cannot be read)."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            return any(e.startswith(f"{name}=".encode()) for e in f.read().split(b"\0"))
    except OSError:
        return False
