"""``gpuctl.core.idle``: which services reclaim frees, keeps or touches, as a table."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from gpuctl.core.idle import (
    Action,
    IdleFacts,
    judge,
    needs_in_flight,
    needs_lingering,
    short_duration,
)
from gpuctl.core.record import Phase

NOW = 100_000.0
BASE = IdleFacts(
    service="vllm",
    managed=True,
    idle_timeout_s=1800.0,
    phase=Phase.RUNNING,
    last_used=NOW - 2460,  # 41 minutes ago
    since=NOW - 9000,
    has_handle=True,
    launcher="docker",
)


@pytest.mark.parametrize(
    ("change", "action", "reason", "quiet"),
    [
        ({}, Action.STOP, "idle 41m > 30m", False),
        ({"stop": "sleep", "sleep_level": 1}, Action.SLEEP, "idle 41m > 30m", False),
        ({"launcher": "ollama", "has_handle": False}, Action.UNLOAD, "idle 41m > 30m", False),
        ({"last_used": NOW - 600}, Action.KEEP, "idle 10m < 30m", True),
        ({"last_used": None, "since": NOW - 3600}, Action.STOP, "idle 1h00m > 30m", False),
        ({"idle_timeout_s": None}, Action.KEEP, 'idle_timeout = "never"', True),
        ({"managed": False}, Action.KEEP, "not managed by gpuctl (no launcher)", True),
        ({"phase": Phase.STARTING}, Action.KEEP, "starting", True),
        ({"phase": Phase.STOPPED}, Action.KEEP, "not running (stopped)", True),
        ({"phase": Phase.FAILED}, Action.KEEP, "not running (failed)", True),
        ({"phase": Phase.SLEEPING}, Action.KEEP, "asleep (vLLM sleep mode)", True),
        ({"lease": "ensure pid 7 on dgx"}, Action.KEEP, "lease held by ensure pid 7 on dgx", False),
        ({"server_in_flight": 2}, Action.TOUCH, "in flight: 2 requests", False),
        ({"store_in_flight": 1}, Action.TOUCH, "in flight: 1 request", False),
        ({"store_in_flight": 1, "server_in_flight": 2}, Action.TOUCH, "in flight: 3 requests", False),
        ({"server_in_flight": 0}, Action.STOP, "idle 41m > 30m", False),
        (
            {"store_lingering_s": 7.4},
            Action.KEEP,
            "a proxy may send it a request for 7s more (its lingering in-flight entry)",
            False,
        ),
        (
            {"in_flight_error": "cannot read http://h:8000/metrics: HTTP 500"},
            Action.KEEP,
            "cannot tell whether requests are in flight (cannot read http://h:8000/metrics: HTTP 500)",
            False,
        ),
        (
            {"remote_process": "dgx", "launcher": "process"},
            Action.KEEP,
            "a process on dgx: only that machine can stop it (run gpuctl reclaim there)",
            False,
        ),
        (
            {"has_handle": False},
            Action.KEEP,
            "its record names no server that gpuctl started: left alone",
            False,
        ),
        (
            {"has_handle": False, "stop": "sleep"},
            Action.KEEP,
            "its record names no server that gpuctl started: left alone",
            False,
        ),
        # Busy wins over everything that would otherwise free it, but not over a lease.
        ({"store_in_flight": 1, "lease": "stop pid 1 on h"}, Action.KEEP, "lease held by stop pid 1 on h", False),
        # A request in flight on a service within its timeout: nothing to do, quietly.
        ({"last_used": NOW - 60, "store_in_flight": 4}, Action.KEEP, "idle 1m < 30m", True),
    ],
)  # fmt: skip
def test_judge(change: dict[str, object], action: Action, reason: str, quiet: bool) -> None:
    c = judge(replace(BASE, **change), NOW)  # type: ignore[arg-type]
    assert (c.action, c.reason, c.quiet) == (action, reason, quiet)


def test_the_boundary_is_strictly_older() -> None:
    assert judge(replace(BASE, last_used=NOW - 1800), NOW).action is Action.KEEP
    assert judge(replace(BASE, last_used=NOW - 1800.5), NOW).action is Action.STOP


def test_a_clock_that_went_backwards_is_not_idle() -> None:
    c = judge(replace(BASE, last_used=NOW + 500), NOW)
    assert c.action is Action.KEEP and c.reason == "idle 0s < 30m"


def test_in_flight_is_read_only_for_candidates() -> None:
    assert needs_in_flight(BASE, NOW)
    assert not needs_in_flight(replace(BASE, last_used=NOW - 5), NOW)
    assert not needs_in_flight(replace(BASE, lease="x"), NOW)
    assert not needs_in_flight(replace(BASE, idle_timeout_s=None), NOW)
    assert not needs_in_flight(replace(BASE, phase=Phase.STOPPED), NOW)
    assert not needs_in_flight(replace(BASE, launcher="ollama"), NOW)  # no such metric
    # The store's lingering entries are read for every launcher, Ollama's too.
    assert needs_lingering(replace(BASE, launcher="ollama"), NOW)
    assert not needs_lingering(replace(BASE, last_used=NOW - 5), NOW)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (45, "45s"),
        (60, "1m"),
        (64, "1m04s"),
        (599, "9m59s"),
        (600, "10m"),
        (2460, "41m"),
        (3900, "1h05m"),
        (90000, "1d01h"),
        (-5, "0s"),
    ],
)
def test_short_duration(seconds: float, text: str) -> None:
    assert short_duration(seconds) == text


@pytest.mark.parametrize(
    ("idle_s", "timeout_s", "reason"),
    [
        (2.3, 2.0, "idle 2.3s > 2.0s"),  # was "idle 2s > 2s"
        (1.04, 1.0, "idle 1s ≥ 1s"),  # equal to a tenth of a second too
        (1830, 1800, "idle 30m ≥ 30m"),
        (2.3, 1.0, "idle 2s > 1s"),
    ],
)
def test_an_idle_time_never_reads_as_equal_to_its_limit(
    idle_s: float, timeout_s: float, reason: str
) -> None:
    facts = replace(BASE, last_used=NOW - idle_s, idle_timeout_s=timeout_s)
    assert judge(facts, NOW).reason == reason
