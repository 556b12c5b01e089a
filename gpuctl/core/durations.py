"""What a start costs: the durations of a service's successful starts, from its record.

Each start ``ensure`` makes is kept in the record's ``attempts`` (the last
``MAX_ATTEMPTS_KEPT``), with its launcher, outcome and ``duration_s``; the successful
ones are the start durations. Their median is what the next start is expected to take:
``ensure`` draws a progress bar with an ETA from it, the agent's ``/metrics`` shows
them as a histogram, and preemption will price a victim by it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from gpuctl.core.record import Record
from gpuctl.core.units import format_duration

# Buckets of gpuctl_start_duration_seconds: from a small model's seconds to a cold vLLM
# start on a DGX Spark (5-6 minutes, up to ten for the largest).
START_BUCKETS_S = (5.0, 15.0, 30.0, 60.0, 120.0, 240.0, 360.0, 600.0, 900.0, 1800.0)
EXPECTED_FROM_LAST = 5


def start_durations(record: Record | None) -> list[float]:
    """The durations of the record's successful starts, oldest first."""
    return [d for _, d in start_attempts(record)]


def expected_start_s(record: Record | None) -> float | None:
    """The median of the last few successful starts; None before the first one."""
    recent = start_durations(record)[-EXPECTED_FROM_LAST:]
    return statistics.median(recent) if recent else None


def progress(elapsed_s: float, expected_s: float | None) -> tuple[float | None, str]:
    """(fraction done, words) for a start ``elapsed_s`` in, expected to take ``expected_s``.

    ``3m12s of ~5m40s · 56%``; past the expected time the fraction stays below 1 and
    the words say so (``6m05s, ~5m40s expected``). Without an expectation: (None, '').
    """
    if expected_s is None or expected_s <= 0:
        return None, ""
    fraction = elapsed_s / expected_s
    if fraction >= 1:
        return 0.99, f"{format_duration(elapsed_s)}, ~{format_duration(expected_s)} expected"
    pct = int(fraction * 100)
    return fraction, f"{format_duration(elapsed_s)} of ~{format_duration(expected_s)} · {pct}%"


def start_attempts(record: Record | None) -> list[tuple[float | None, float]]:
    """(when it ended, duration) of the record's successful starts, oldest first: its end
    time tells one start from another (None where the attempt has none)."""
    if record is None:
        return []
    out: list[tuple[float | None, float]] = []
    for a in record.attempts:
        d, ended = a.get("duration_s"), a.get("ended", a.get("started"))
        if (
            a.get("outcome") == "ready"
            and isinstance(d, int | float)
            and not isinstance(d, bool)
            and math.isfinite(d)
            and d >= 0
        ):
            at = (
                float(ended)
                if isinstance(ended, int | float) and not isinstance(ended, bool)
                else None
            )
            out.append((at, float(d)))
    return out


class StartTally:
    """``gpuctl_start_duration_seconds`` as a Prometheus histogram must be: counts and
    sums that only grow while the process lives.

    A record keeps only its last ``MAX_ATTEMPTS_KEPT`` attempts, so a histogram drawn
    from them alone stops growing at that count and its sum falls as old starts drop
    out. The tally folds in each successful start once: all a record holds when it
    first sees the service, then those that ended after the newest it has counted.
    More starts of one service than a record keeps, between two reads, lose the oldest
    of them; nothing ever comes off.
    """

    __slots__ = ("_newest", "_tally")

    def __init__(self) -> None:
        self._newest: dict[str, float] = {}
        # service -> (bucket counts, not cumulative; sum; count)
        self._tally: dict[str, tuple[list[int], float, int]] = {}

    def fold(self, records: Sequence[Record]) -> None:
        """Count the starts in ``records`` not counted yet."""
        for r in records:
            attempts = start_attempts(r)
            if not attempts:
                continue
            newest = self._newest.get(r.service)
            if newest is None:
                fresh = attempts
            else:
                fresh = [(t, d) for t, d in attempts if t is not None and t > newest]
            times = [t for t, _ in attempts if t is not None]
            self._newest[r.service] = max([*times, newest if newest is not None else -math.inf])
            if not fresh:
                continue
            counts, total, n = self._tally.get(r.service, ([0] * len(START_BUCKETS_S), 0.0, 0))
            for _, d in fresh:
                i = next((j for j, b in enumerate(START_BUCKETS_S) if d <= b), None)
                if i is not None:
                    counts[i] += 1
                total += d
                n += 1
            self._tally[r.service] = (counts, total, n)

    def histograms(self) -> list[tuple[str, list[tuple[str, int]], float, int]]:
        """(service, cumulative buckets with ``+Inf`` last, sum, count), by service."""
        out = []
        for svc in sorted(self._tally):
            counts, total, n = self._tally[svc]
            running, buckets = 0, []
            for b, c in zip(START_BUCKETS_S, counts, strict=True):
                running += c
                buckets.append((f"{b:g}", running))
            buckets.append(("+Inf", n))
            out.append((svc, buckets, total, n))
        return out


def histogram(durations: list[float]) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets (``le`` label, count), ``+Inf`` last."""
    out = [(f"{b:g}", sum(1 for d in durations if d <= b)) for b in START_BUCKETS_S]
    out.append(("+Inf", len(durations)))
    return out
