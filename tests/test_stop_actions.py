"""Pure parts of the stop actions: the SLEEPING decision, wake admission, vLLM metrics."""

from __future__ import annotations

import pytest

from gpuctl.adapters.vllm import metrics_url, origin, parse_in_flight
from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Decision, Health, classify
from gpuctl.core.snapshot import GpuProcess, Snapshot
from gpuctl.flows.ensure.wake import wake_fits

GIB = 1024
SVC = ServiceConfig(name="vllm", host="h", memory_mib=80 * GIB, stop="sleep", sleep_level=1)


def snapshot(*procs: GpuProcess) -> Snapshot:
    used = sum(p.memory_mib or 0 for p in procs)
    return Snapshot(used, 128 * GIB, False, "sim", "t", procs)


def test_a_sleeping_health_is_sleeping_before_anything_else() -> None:
    asleep = Health("sleeping", "vLLM sleep mode at http://h:8000", 200)
    v = classify(SVC, asleep, snapshot(GpuProcess(1, "vllm serve", 1 * GIB)))
    assert v.decision is Decision.SLEEPING
    assert "sleep mode" in v.reason
    assert [p.pid for p in v.own] == [1]
    # Even without a snapshot: the server itself said it sleeps.
    assert classify(SVC, asleep, None, agent_error="down").decision is Decision.SLEEPING
    assert not asleep.ok


@pytest.mark.parametrize(
    ("total", "used", "held", "budget", "fits"),
    [
        (128 * GIB, 1 * GIB, 1 * GIB, 80 * GIB, True),  # only itself on the GPU
        (128 * GIB, 50 * GIB, 0, 80 * GIB, False),  # someone took 50 GiB meanwhile
        (128 * GIB, 48 * GIB, 0, 80 * GIB, True),  # exactly fits
        (128 * GIB, 80 * GIB, 80 * GIB, 80 * GIB, True),  # unified memory, level 1: kept it all
        (None, 0, 0, 80 * GIB, False),  # unknown total: never admitted blind
        (128 * GIB, None, 0, 80 * GIB, False),
        (128 * GIB, 128 * GIB, 0, None, True),  # no budget: nothing to check
    ],
)
def test_wake_fits(
    total: int | None, used: int | None, held: int, budget: int | None, fits: bool
) -> None:
    assert wake_fits(total, used, held, budget)[0] is fits


def test_in_flight_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        'vllm:request_success_total{model_name="m"} 99.0\n'
    )
    assert parse_in_flight(text) == 6
    both = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0\n"
    assert parse_in_flight(both) == 0
    # "0 in flight" needs both gauges: a page without one says nothing about the requests
    # (it used to read as 0, and reclaim stopped a busy server).
    for missing in ("vllm:num_requests_running 0.0\n", "# nothing of vLLM here\nfoo 1\n", "",
                    "vllm_num_requests_running 0\nvllm_num_requests_waiting 0\n"):  # fmt: skip
        with pytest.raises(ValueError, match="no vllm:num_requests_"):
            parse_in_flight(missing)
    for bad in ("vllm:num_requests_running NaN\n", "vllm:num_requests_waiting -1\n",
                "vllm:num_requests_running +Inf\n", "vllm:num_requests_running 0.5\n"):  # fmt: skip
        with pytest.raises(ValueError, match="bad metric"):
            parse_in_flight(bad + both)


def test_where_the_metrics_are() -> None:
    assert origin("http://dgx:8000/health") == "http://dgx:8000"
    assert metrics_url("http://dgx:8000/health", None) == "http://dgx:8000/metrics"
    assert metrics_url("http://dgx:8000/health", "http://dgx:9000/m") == "http://dgx:9000/m"
    assert metrics_url(None, None) is None
