"""What each service cost, from the journal's events: pure arithmetic, no I/O.

A service is *held* from the event that loads it (``launch``, ``resume``, ``wake``) to
the one that ends it (``stop``, ``fail``, or any event whose phase after is
``stopped`` or ``failed``). While held it costs its budget × time in GiB-hours, and
its measured memory × time where a ``ready`` event carried a reading. A held span
without a budget counts as *unknown* hours, never as 0 GiB-hours.

Rows are keyed (UTC day, service, user): the user is the one whose event loaded it; a
preemption caused is counted for the preemptor (the stop's ``by``) and its user. A span
that crosses midnight is split at it, so a closed day's rows are final and the journal
keeps them (``daily`` rows) when its events are pruned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from gpuctl.core.events import Cause, Event, Kind

DAY_S = 86400.0
_OPENS = frozenset({Kind.LAUNCH, Kind.RESUME, Kind.WAKE})
_ENDS = frozenset({Kind.STOP, Kind.FAIL})
_ENDED_PHASES = frozenset({"stopped", "failed"})
# The cold starts one row keeps for its median (the rest count in the total only).
MAX_COLD_KEPT = 1000


def day_of(t: float) -> str:
    """The UTC day ``t`` falls in, as YYYY-MM-DD."""
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def day_start(t: float) -> float:
    return t - (t % DAY_S)


class Held(msgspec.Struct):
    """A service loaded since ``since``, not yet stopped."""

    since: float
    user: str
    budget_mib: float | None = None
    memory_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "user": self.user,
            "budget_mib": self.budget_mib,
            "memory_mib": self.memory_mib,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Held:
        return Held(float(d["since"]), str(d["user"]), d.get("budget_mib"), d.get("memory_mib"))


class Tally(msgspec.Struct):
    """One row's totals."""

    held_s: float = 0.0
    gib_hours: float = 0.0
    unknown_hours: float = 0.0  # held without a budget
    seen_gib_hours: float = 0.0
    seen_hours: float = 0.0  # of held_s, the part with a memory reading
    cold_starts: int = 0
    cold_total_s: float = 0.0
    cold_kept: list[float] = msgspec.field(default_factory=list)
    idle_before_stop_s: float = 0.0
    preempted: int = 0
    preempting: int = 0
    jobs: int = 0
    proxy_requests: int = 0
    stops: dict[str, int] = msgspec.field(default_factory=dict)

    def add(self, other: Tally) -> None:
        for name in _SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cold_kept = (self.cold_kept + other.cold_kept)[-MAX_COLD_KEPT:]
        for cause, n in other.stops.items():
            self.stops[cause] = self.stops.get(cause, 0) + n

    def cold_median_s(self) -> float | None:
        import statistics  # here: its import costs every reader of the journal 7 ms

        return statistics.median(self.cold_kept) if self.cold_kept else None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Tally:
        """The totals in ``d`` (other keys ignored). ValueError for a value of the wrong
        kind: a daily row forged in the file, or an agent's answer, must not poison a
        sum (``"x"`` for a time, ``NaN``, a key named like a method)."""
        t = Tally()
        for name in _SUMS:
            if name in d:
                setattr(t, name, _finite(d[name], name))
        kept = d.get("cold_kept", [])
        stops = d.get("stops", {})
        if not isinstance(kept, list) or not isinstance(stops, dict):
            raise ValueError("cold_kept must be a list and stops an object")
        t.cold_kept = [_finite(x, "cold_kept") for x in kept[-MAX_COLD_KEPT:]]
        t.stops = {str(k): int(_finite(v, "stops")) for k, v in stops.items()}
        return t


_SUMS = (
    "held_s",
    "gib_hours",
    "unknown_hours",
    "seen_gib_hours",
    "seen_hours",
    "cold_starts",
    "cold_total_s",
    "idle_before_stop_s",
    "preempted",
    "preempting",
    "jobs",
    "proxy_requests",
)


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: not a finite number: {str(value)[:40]!r}")
    return value


Key = tuple[str, str, str]  # (day, service, user)


def _user(e: Event) -> str:
    return e.who.get("user", "") or "?"


def _span(rows: dict[Key, Tally], service: str, h: Held, start: float, end: float) -> None:
    """Add ``h``'s held time between ``start`` and ``end`` to its rows, split by day."""
    t = start
    while t < end:
        cut = min(end, day_start(t) + DAY_S)
        dt = cut - t
        row = rows.setdefault((day_of(t), service, h.user), Tally())
        row.held_s += dt
        if h.budget_mib is None:
            row.unknown_hours += dt / 3600
        else:
            row.gib_hours += h.budget_mib / 1024 * dt / 3600
        if h.memory_mib is not None:
            row.seen_gib_hours += h.memory_mib / 1024 * dt / 3600
            row.seen_hours += dt / 3600
        t = cut


def fold(
    events: Iterable[Event],
    start: float,
    end: float,
    carry: dict[str, Held] | None = None,
) -> tuple[dict[Key, Tally], dict[str, Held]]:
    """The rows of ``events`` (in time order) between ``start`` and ``end``, and what is
    still held at ``end``. ``carry``: what was held at ``start`` (or before the first
    event: a span is counted only from ``start``)."""
    rows: dict[Key, Tally] = {}
    held: dict[str, Held] = dict(carry or {})

    def point(e: Event, service: str | None = None, user: str | None = None) -> Tally:
        h = held.get(e.service)
        who = user or (h.user if h is not None and service is None else _user(e))
        return rows.setdefault((day_of(e.at), service or e.service, who), Tally())

    for e in events:
        if e.at >= end:
            break
        counted = e.at >= start
        f = e.figures
        if e.kind in _OPENS and e.service not in held:
            held[e.service] = Held(e.at, _user(e), f.get("budget_mib"), f.get("memory_mib"))
            if e.kind is Kind.LAUNCH and e.job and counted:
                point(e).jobs += 1
        elif e.kind is Kind.READY and e.service in held and "memory_mib" in f:
            h = held[e.service]
            if counted:
                _span(rows, e.service, h, max(start, h.since), e.at)
            held[e.service] = Held(e.at, h.user, h.budget_mib, f["memory_mib"])
        if e.kind is Kind.READY and counted and "cold_start_s" in f:
            row = point(e)
            row.cold_starts += 1
            row.cold_total_s += f["cold_start_s"]
            row.cold_kept = [*row.cold_kept, f["cold_start_s"]][-MAX_COLD_KEPT:]
        if e.kind is Kind.PROXY and counted:
            point(e).proxy_requests += int(f.get("requests_served", 0))
        if e.kind is Kind.STOP and counted:
            row = point(e)
            cause = e.cause.value if e.cause else "other"
            row.stops[cause] = row.stops.get(cause, 0) + 1
            if e.cause is Cause.PREEMPTED:
                row.preempted += 1
                if e.by:
                    point(e, e.by, _user(e)).preempting += 1
            if e.cause in (Cause.IDLE, Cause.YIELD):
                row.idle_before_stop_s += f.get("idle_s", 0.0)
        if (e.kind in _ENDS or (e.after or "") in _ENDED_PHASES) and e.service in held:
            h = held.pop(e.service)
            if e.at > start:
                _span(rows, e.service, h, max(start, h.since), e.at)
    for service, h in held.items():
        if end > start:
            _span(rows, service, h, max(start, h.since), end)
    return rows, {
        s: Held(max(h.since, end), h.user, h.budget_mib, h.memory_mib) for s, h in held.items()
    }


def group(rows: dict[Key, Tally], by: str) -> dict[str, Tally]:
    """Rows summed by ``service``, ``user`` or ``day``."""
    index = {"day": 0, "service": 1, "user": 2}[by]
    out: dict[str, Tally] = {}
    for key in sorted(rows):
        out.setdefault(key[index], Tally()).add(rows[key])
    return out
