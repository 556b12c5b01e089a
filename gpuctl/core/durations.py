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

from gpuctl.core.record import Record
from gpuctl.core.units import format_duration

# Buckets of gpuctl_start_duration_seconds: from a small model's seconds to a cold vLLM
# start on a DGX Spark (5-6 minutes, up to ten for the largest).
START_BUCKETS_S = (5.0, 15.0, 30.0, 60.0, 120.0, 240.0, 360.0, 600.0, 900.0, 1800.0)
EXPECTED_FROM_LAST = 5


def start_durations(record: Record | None) -> list[float]:
    """The durations of the record's successful starts, oldest first."""
    if record is None:
        return []
    out = []
    for a in record.attempts:
        d = a.get("duration_s")
        if (
            a.get("outcome") == "ready"
            and isinstance(d, int | float)
            and not isinstance(d, bool)
            and math.isfinite(d)
            and d >= 0
        ):
            out.append(float(d))
    return out


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


def histogram(durations: list[float]) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets (``le`` label, count), ``+Inf`` last."""
    out = [(f"{b:g}", sum(1 for d in durations if d <= b)) for b in START_BUCKETS_S]
    out.append(("+Inf", len(durations)))
    return out
