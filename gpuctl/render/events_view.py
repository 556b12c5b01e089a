"""``gpuctl events`` and ``gpuctl usage``: the journal in lines a person reads, and in
JSON whose shapes are declared here (msgspec Structs; ``schemas/events.schema.json``
and ``schemas/usage.schema.json`` are generated from them: ``gpuctl.render.schemas``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from gpuctl.core.events import Event, words
from gpuctl.core.safe_text import visible
from gpuctl.core.units import format_duration
from gpuctl.core.usage import Tally

EVENTS_SCHEMA = 1
USAGE_SCHEMA = 1


class EventRow(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One event (docs/reference/events.md)."""

    host: str  # the configured host it was read from
    id: int
    at: float
    kind: str
    service: str
    text: str  # the event in words, as the lines print it
    # A pooled service's hosts (null: one host); the key as in status (render.schemas).
    pool: list[str] | None
    cause: str | None = None
    job: bool = False
    before: str | None = None
    after: str | None = None
    decision: str | None = None
    reason: str | None = None
    by: str | None = None
    command: str | None = None
    who: dict[str, str] = {}
    figures: dict[str, float] = {}
    seen_on: str | None = None  # the machine that wrote it (its hostname)


class HostError(msgspec.Struct):
    host: str
    error: str


class EventsOut(msgspec.Struct):
    """``gpuctl events --json``."""

    schema: int
    since: float
    events: list[EventRow]
    errors: list[HostError] = []


class UsageRow(msgspec.Struct):
    """One row of ``gpuctl usage``: a service, a user or a UTC day."""

    key: str
    held_hours: float
    gib_hours: float | None  # budget × time held; None: some of it had no budget
    gib_hours_known: float  # the part with a budget
    unknown_hours: float  # held without a budget
    seen_gib_hours: float  # memory the probe measured × time
    cold_starts: int
    cold_start_median_s: float | None
    cold_start_total_s: float
    idle_before_stop_s: float
    preempted: int
    preempting: int
    jobs: int
    proxy_requests: int
    stops: dict[str, int]
    # --by service: a pooled service's hosts, its row summing them all (null: one host,
    # and every row of --by user or day); the key as in status (render.schemas).
    pool: list[str] | None = None


class UsageOut(msgspec.Struct):
    """``gpuctl usage --json``."""

    schema: int
    since: float
    by: str
    rows: list[UsageRow]
    errors: list[HostError] = []


def event_row(host: str, rid: int, e: Event, pool: list[str] | None = None) -> EventRow:
    return EventRow(
        host=host,
        id=rid,
        at=e.at,
        kind=e.kind.value,
        service=e.service,
        text=words(e),
        pool=pool,
        cause=e.cause.value if e.cause else None,
        job=e.job,
        before=e.before,
        after=e.after,
        decision=e.decision,
        reason=e.reason,
        by=e.by,
        command=e.command,
        who=dict(e.who),
        figures=dict(e.figures),
        seen_on=e.host or None,
    )


def event_line(host: str | None, e: Event, *, dated: bool) -> str:
    """``03:12:05 photos preempted by chat — alice via proxy`` (with the host before
    the words when several hosts are shown; the date when the span is over a day)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S" if dated else "%H:%M:%S", time.localtime(e.at))
    where = f"{host}: " if host else ""
    return visible(f"{stamp} {where}{words(e)}")


def usage_row(key: str, t: Tally, pool: list[str] | None = None) -> UsageRow:
    return UsageRow(
        pool=pool,
        key=key,
        held_hours=round(t.held_s / 3600, 4),
        gib_hours=None if t.unknown_hours > 0 else round(t.gib_hours, 4),
        gib_hours_known=round(t.gib_hours, 4),
        unknown_hours=round(t.unknown_hours, 4),
        seen_gib_hours=round(t.seen_gib_hours, 4),
        cold_starts=int(t.cold_starts),
        cold_start_median_s=_r(t.cold_median_s()),
        cold_start_total_s=round(t.cold_total_s, 3),
        idle_before_stop_s=round(t.idle_before_stop_s, 3),
        preempted=int(t.preempted),
        preempting=int(t.preempting),
        jobs=int(t.jobs),
        proxy_requests=int(t.proxy_requests),
        stops=dict(t.stops),
    )


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def usage_lines(rows: Sequence[UsageRow], by: str) -> list[str]:
    """A plain table: one line per row, widths fitted."""
    head = [by.upper(), "HELD", "GiB·h", "SEEN GiB·h", "COLD STARTS", "IDLE→STOP",
            "PREEMPTED/BY IT", "JOBS", "PROXY REQ"]  # fmt: skip
    table = [head]
    for r in rows:
        gib = f"{r.gib_hours:.1f}" if r.gib_hours is not None else (
            f"{r.gib_hours_known:.1f} + unknown ({r.unknown_hours:.1f} h)"
            if r.gib_hours_known
            else f"unknown ({r.unknown_hours:.1f} h)"
        )  # fmt: skip
        cold = (
            f"{r.cold_starts} (median {format_duration(r.cold_start_median_s)}, total "
            f"{format_duration(r.cold_start_total_s)})"
            if r.cold_starts
            else "0"
        )
        # Idle before a stop, over the stops for idleness (reclaim, yield); "-" when none
        # was: a 0s would read as stops that came the moment it went idle.
        idle_stops = r.stops.get("idle", 0) + r.stops.get("yield", 0)
        idle = format_duration(r.idle_before_stop_s) if idle_stops else "-"
        table.append([
            r.key, f"{r.held_hours:.1f} h", gib, f"{r.seen_gib_hours:.1f}", cold, idle,
            f"{r.preempted}/{r.preempting}", str(r.jobs), str(r.proxy_requests),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return [visible("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            for row in table]  # fmt: skip


def to_json(out: EventsOut | UsageOut | EventRow) -> Any:
    return msgspec.to_builtins(out)


def json_text(out: EventsOut | UsageOut) -> str | None:
    """The output as the CLI prints JSON (sorted keys, indented), encoded by msgspec: the
    generic printer takes seconds over 11,000 events. None when a string holds a lone
    surrogate (msgspec will not encode it): the caller's printer escapes those."""
    try:
        raw = msgspec.json.encode(out, order="sorted")
    except UnicodeEncodeError:
        return None
    return msgspec.json.format(raw, indent=2).decode()
