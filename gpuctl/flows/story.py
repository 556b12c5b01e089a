"""The flows' side of the journal (``core.events``, ``adapters.store.journal``): the event a
flow tells, with who tells it (entry point, user, pid, host), and ``tell`` for one that
rides on no record write.

Each hook in a flow is one line: ``event=story.ev(...)`` on the record write that
causes it, or ``story.tell(store, ...)``. The journal is a witness: nothing here raises.
"""

from __future__ import annotations

import contextlib
import contextvars
import getpass
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuctl.core.events import Event


# What the agent saw of the caller it runs a flow for (its peer, its token's role): the
# web view's buttons run the CLI's flows inside the agent, and an event they tell must
# say who asked, as one written through the agent does (``Event.seen_by``).
_SEEN: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "gpuctl_seen", default=None
)


@contextlib.contextmanager
def seen_as(seen: dict[str, str]) -> Iterator[None]:
    """Every event this thread tells meanwhile carries ``seen`` in its ``who``."""
    token = _SEEN.set(dict(seen))
    try:
        yield
    finally:
        _SEEN.reset(token)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def ev(
    kind: str,
    service: str,
    entry: str,
    *,
    at: float | None = None,
    cause: str | None = None,
    job: bool = False,
    before: object = None,
    after: object = None,
    decision: object = None,
    reason: str | None = None,
    by: str | None = None,
    command: str | None = None,
    **figures: float | None,
) -> Event:
    """An event told by this process (``entry``: the command or part that tells it).
    ``kind`` and ``cause`` in their words (``core.events.Kind``, ``Cause``: imported
    only here, so a command that tells nothing pays nothing for them). Phases and
    decisions may be enums (their value is kept); figures that are None (not
    measured) are left out, never written as 0."""
    from gpuctl.core.events import Cause, Event, Kind
    from gpuctl.core.redact import redact_command, redact_lines

    return Event(
        at=time.time() if at is None else at,
        kind=Kind(kind),
        service=service,
        host=socket.gethostname(),
        cause=Cause(cause) if cause is not None else None,
        job=job,
        before=_word(before),
        after=_word(after),
        decision=_word(decision),
        # Redacted here as the agent redacts what it is sent (``event_from_dict``): an
        # event written straight to the journal is read by the read-only token too.
        reason=redact_lines(reason) if reason else reason,
        by=redact_lines(by) if by else by,
        command=redact_command(command) if command else None,
        who={"entry": entry, "user": _user(), "pid": str(os.getpid()), **(_SEEN.get() or {})},
        figures={k: float(v) for k, v in figures.items() if v is not None},
    )


def _word(value: object) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "value", value))


def tell(store: Any, *events: Event) -> None:
    """Journal events that ride on no record write; never raises."""
    # ``Store.note`` never raises (each store counts and warns of what it drops); this
    # guard keeps a store that breaks that promise from failing the flow.
    with contextlib.suppress(Exception):  # a witness, not a gate
        store.note(*events)


def mib(value: int | None) -> float | None:
    return None if value is None else float(value)


_OOM = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "oom-kill")


def admitted(svc: Any, entry: str, verdict: Any, own: Any) -> Event:
    """Admission granted to a start (under the admission lock, after a fresh look)."""
    return ev(
        "admit",
        svc.name,
        entry,
        before=own.phase if own else None,
        decision=verdict.decision,
        reason=verdict.reason,
        budget_mib=mib(svc.memory_mib),
        priority=svc.priority,
    )


def refused(svc: Any, entry: str, verdict: Any) -> Event:
    """Admission refused (BUSY, PREEMPTABLE without --preempt, UNKNOWN)."""
    return ev(
        "refuse",
        svc.name,
        entry,
        decision=verdict.decision,
        reason=verdict.reason,
        budget_mib=mib(svc.memory_mib),
        priority=svc.priority,
    )


def ended(
    svc: Any,
    entry: str,
    outcome: Any,
    reason: str,
    *,
    log_tail: str,
    started_at: float,
    handle: dict[str, Any] | None,
    now: float | None = None,
    memory_mib: int | None = None,
) -> Event | None:
    """The end of a launch's wait: ``ready`` (with its cold-start time) or ``fail``
    (its exit code where the reason gives one, where its log is, and an out-of-memory
    seen in the log's tail); None for an outcome that ends nothing (a timeout).
    ``memory_mib``: what its processes held at the last look (None: not measured)."""
    now = time.time() if now is None else now
    word = str(getattr(outcome, "value", outcome))
    if word == "ready":
        return ev(
            "ready",
            svc.name,
            entry,
            before="starting",
            after="running",
            cold_start_s=round(now - started_at, 3),
            memory_mib=mib(memory_mib),
        )
    if word != "failed":
        return None
    tail = (log_tail or "").lower()
    code = _exit_code(reason)
    log = (handle or {}).get("log")
    return ev(
        "fail",
        svc.name,
        entry,
        before="starting",
        after="failed",
        reason=reason + (f"; log: {log}" if isinstance(log, str) else ""),
        exit_code=code,
        oom=1.0 if any(w in tail for w in _OOM) else None,
        after_s=round(now - started_at, 3),
    )


def _exit_code(reason: str) -> float | None:
    import re

    m = re.search(r"(?:exit(?:ed)?(?: with)?(?: code| status)?)\s+(-?\d+)", reason)
    return float(m.group(1)) if m else None


# ---- reading (``gpuctl events``, ``gpuctl usage``)


def host_events(
    store: Any, since: float, *, service: str | None = None, after_id: int = 0
) -> list[tuple[int, Event]]:
    """A host's journal from ``since``: its agent's (``GET /events``), or the files'
    here. Raises GpuctlError when the host cannot be read."""
    got: list[tuple[int, Event]] = store.events(since, service=service, after_id=after_id)
    return got


def host_usage(store: Any, since: float) -> dict[tuple[str, str, str], Any]:
    """A host's usage rows from ``since`` (``core.usage``), keyed (day, service, user)."""
    got: dict[tuple[str, str, str], Any] = store.usage(since)
    return got
