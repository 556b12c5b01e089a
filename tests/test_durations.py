"""What a start costs: durations from the record, the ETA, and the /metrics histogram."""

from __future__ import annotations

from typing import Any

import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from gpuctl.agent.metrics import render_metrics
from gpuctl.core.durations import expected_start_s, histogram, progress, start_durations
from gpuctl.core.record import Record
from gpuctl.core.snapshot import HostIdentity


def attempt(duration: Any, outcome: str = "ready") -> dict[str, Any]:
    return {"duration_s": duration, "outcome": outcome, "launcher": "docker"}


REC = Record(
    service="vllm",
    attempts=(
        attempt(330.0),
        attempt(12.0, "failed"),
        attempt(350.5),
        attempt(float("nan")),
        attempt("slow"),
        attempt(True),
        attempt(-3),
        attempt(340.0),
        attempt(600.0, "timeout"),
    ),
)


def test_only_successful_starts_count() -> None:
    assert start_durations(REC) == [330.0, 350.5, 340.0]
    assert start_durations(None) == []
    assert start_durations(Record(service="x")) == []


def test_expected_is_the_median_of_the_last_few() -> None:
    assert expected_start_s(REC) == 340.0
    assert expected_start_s(Record(service="x")) is None
    many = replace(REC, attempts=tuple(attempt(float(d)) for d in (1000, 1000, 10, 20, 30, 40, 50)))
    assert expected_start_s(many) == 30.0  # the last five: 10..50


@pytest.mark.parametrize(
    ("elapsed", "expected", "fraction", "text"),
    [
        (192, 340, 192 / 340, "3m12s of ~5m40s · 56%"),
        (0, 340, 0.0, "0s of ~5m40s · 0%"),
        (365, 340, 0.99, "6m05s, ~5m40s expected"),
        (10, None, None, ""),
        (10, 0.0, None, ""),
    ],
)
def test_progress_words(
    elapsed: float, expected: float | None, fraction: float | None, text: str
) -> None:
    got_fraction, got_text = progress(elapsed, expected)
    assert got_text == text
    assert got_fraction == pytest.approx(fraction) if fraction is not None else got_fraction is None


def test_histogram_buckets_are_cumulative() -> None:
    buckets = dict(histogram([3.0, 40.0, 340.0]))
    assert buckets["5"] == 1 and buckets["60"] == 2 and buckets["360"] == 3
    assert buckets["+Inf"] == 3


def test_metrics_show_a_histogram_prometheus_can_parse() -> None:
    text = render_metrics(
        None,
        probe_up=True,
        probe_name="sim",
        probe_errors_total=0,
        requests_total={},
        host=HostIdentity("h", "b"),
        gpu_memory_mib=None,
        records=[REC, Record(service="never-started")],
        store_up=True,
        now=0.0,
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    fam = families["gpuctl_start_duration_seconds"]
    assert fam.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert samples[("gpuctl_start_duration_seconds_count", None)] == 3
    assert samples[("gpuctl_start_duration_seconds_sum", None)] == pytest.approx(1020.5)
    assert samples[("gpuctl_start_duration_seconds_bucket", "360")] == 3
    assert samples[("gpuctl_start_duration_seconds_bucket", "240")] == 0
    assert all(s.labels["service"] == "vllm" for s in fam.samples)


def test_a_waiter_expects_what_is_left_of_a_start_under_way() -> None:
    from gpuctl.core.record import Phase
    from gpuctl.flows.ensure.launch import expected_left_s

    assert expected_left_s(REC, 1000.0) == 340.0  # our own start: all of it
    under_way = replace(REC, phase=Phase.STARTING, since=1000.0)
    assert expected_left_s(under_way, 1100.0) == 240.0
    assert expected_left_s(under_way, 2000.0) == 1.0  # late: nearly done, never negative
    assert expected_left_s(None, 0.0) is None
