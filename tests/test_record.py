"""The pure core of the state store (DESIGN §3): back-off, lease state, updates, the record's JSON."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest

from gpuctl.adapters.store.codec import RecordError, decode_record
from gpuctl.core.record import (
    BACKOFF_MAX_S,
    MAX_ATTEMPTS_KEPT,
    RECORD_SCHEMA,
    Failure,
    Lease,
    LeaseState,
    Phase,
    Record,
    apply_update,
    backoff_s,
    in_backoff,
    lease_state,
)

HOST, BOOT = "dgx", "boot-1"
NOW = 1_000_000.0


def lease(*, host: str = HOST, boot_id: str = BOOT, expires: float = NOW + 60) -> Lease:
    return Lease(
        id="h1",
        host=host,
        boot_id=boot_id,
        pid=4242,
        pid_start=NOW - 5,
        entry="ensure",
        granted=NOW - 1,
        expires=expires,
    )


# --------------------------------------------------------------------------- backoff_s


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (-1, 0.0),
        (0, 0.0),
        (1, 10.0),
        (2, 20.0),
        (3, 40.0),
        (4, 80.0),
        (5, 160.0),
        (6, 300.0),
        (7, 300.0),
        (50, 300.0),
        (10_000, 300.0),  # no overflow on a long failure streak
    ],
)
def test_backoff_doubles_from_10s_capped_at_5min(count: int, expected: float) -> None:
    assert backoff_s(count) == expected
    assert isinstance(backoff_s(count), float)
    assert backoff_s(count) <= BACKOFF_MAX_S


# --------------------------------------------------------------------------- lease_state


@pytest.mark.parametrize(
    ("the_lease", "now", "here", "alive", "expected"),
    [
        (None, NOW, (HOST, BOOT), None, LeaseState.NONE),
        (None, NOW, (HOST, BOOT), False, LeaseState.NONE),
        # live until expiry, whatever the caller knows of the pid
        (lease(), NOW, (HOST, BOOT), True, LeaseState.LIVE),
        (lease(), NOW, (HOST, BOOT), None, LeaseState.LIVE),
        (lease(), NOW, ("laptop", "boot-9"), None, LeaseState.LIVE),
        # expired: expiry is inclusive
        (lease(expires=NOW), NOW, (HOST, BOOT), True, LeaseState.EXPIRED),
        (lease(expires=NOW - 1), NOW, (HOST, BOOT), None, LeaseState.EXPIRED),
        (lease(expires=NOW - 1), NOW, ("laptop", "boot-9"), False, LeaseState.EXPIRED),
        # void: same host AND same boot, holder dead; wins over expiry
        (lease(), NOW, (HOST, BOOT), False, LeaseState.VOID),
        (lease(expires=NOW - 1), NOW, (HOST, BOOT), False, LeaseState.VOID),
        # a dead pid elsewhere says nothing about the holder
        (lease(), NOW, ("laptop", BOOT), False, LeaseState.LIVE),
        (lease(host="laptop"), NOW, (HOST, BOOT), False, LeaseState.LIVE),
        # same hostname, other boot: the pid was of a previous boot, unknown here
        (lease(), NOW, (HOST, "boot-2"), False, LeaseState.LIVE),
        (lease(boot_id="boot-0"), NOW, (HOST, BOOT), False, LeaseState.LIVE),
        (lease(boot_id="boot-0", expires=NOW - 1), NOW, (HOST, BOOT), False, LeaseState.EXPIRED),
    ],
)
def test_lease_state(
    the_lease: Lease | None,
    now: float,
    here: tuple[str, str],
    alive: bool | None,
    expected: LeaseState,
) -> None:
    got = lease_state(the_lease, now, here_host=here[0], here_boot_id=here[1], holder_alive=alive)
    assert got is expected


# --------------------------------------------------------------------------- apply_update


def test_update_phase_sets_since_only_on_a_change() -> None:
    rec = Record("vllm", phase=Phase.STOPPED, since=1.0)
    started = apply_update(rec, {"phase": "starting"}, NOW)
    assert started.phase is Phase.STARTING
    assert started.since == NOW
    again = apply_update(started, {"phase": "starting"}, NOW + 50)
    assert again.since == NOW
    assert apply_update(rec, {}, NOW) == rec


def test_update_handle_sets_and_clears() -> None:
    rec = apply_update(Record("vllm"), {"handle": {"kind": "docker", "id": "abc"}}, NOW)
    assert rec.handle == {"kind": "docker", "id": "abc"}
    assert apply_update(rec, {"handle": None}, NOW).handle is None


def test_update_attempt_appends_and_keeps_the_last_ten() -> None:
    rec = Record("vllm")
    for i in range(MAX_ATTEMPTS_KEPT + 3):
        rec = apply_update(rec, {"attempt": {"n": i}}, NOW + i)
    assert len(rec.attempts) == MAX_ATTEMPTS_KEPT
    assert rec.attempts[0] == {"n": 3}
    assert rec.attempts[-1] == {"n": MAX_ATTEMPTS_KEPT + 2}


def test_update_touch_sets_last_used() -> None:
    rec = apply_update(Record("vllm"), {"touch": True}, NOW)
    assert rec.last_used == NOW
    assert apply_update(rec, {"touch": False}, NOW + 9).last_used == NOW
    assert rec.idle_for(NOW + 30) == 30
    assert rec.idle_for(NOW - 30) == 0  # a clock step back is not negative idleness
    assert Record("vllm").idle_for(NOW) is None


def test_failure_counts_up_and_sets_its_backoff() -> None:
    rec = Record("vllm", phase=Phase.STARTING, since=NOW - 10)
    first = apply_update(rec, {"failure": {"error": "exit 1", "log_tail": "OOM"}}, NOW)
    assert first.phase is Phase.FAILED
    assert first.since == NOW
    assert first.failure == Failure(NOW, "exit 1", "OOM", 1, NOW + 10)
    assert in_backoff(first, NOW + 9.9)
    assert not in_backoff(first, NOW + 10)
    second = apply_update(first, {"failure": {"error": "exit 2"}}, NOW + 100)
    assert second.failure is not None
    assert second.failure.count == 2
    assert second.failure.backoff_until == NOW + 100 + 20
    assert second.failure.log_tail == ""
    assert second.since == NOW  # still failed: the phase did not change
    third = apply_update(second, {"failure": {}}, NOW + 200)
    assert third.failure is not None
    assert (third.failure.count, third.failure.backoff_until) == (3, NOW + 240)
    cleared = apply_update(third, {"failure": None, "phase": "running"}, NOW + 300)
    assert cleared.failure is None
    assert not in_backoff(cleared, NOW + 301)
    assert apply_update(cleared, {"failure": {"error": "x"}}, NOW + 400).failure == Failure(
        NOW + 400, "x", "", 1, NOW + 410
    )


def test_in_backoff_only_while_failed() -> None:
    failed = apply_update(Record("vllm"), {"failure": {"error": "x"}}, NOW)
    assert in_backoff(failed, NOW + 1)
    # a failure kept while the service was started by hand and runs: no back-off
    assert not in_backoff(replace(failed, phase=Phase.RUNNING), NOW + 1)
    assert not in_backoff(None, NOW)
    assert not in_backoff(Record("vllm"), NOW)


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"lease": None}, "unknown update key 'lease'"),
        ({"last_used": 5}, "unknown update key"),
        ({"phase": "exploded"}, "exploded"),
        ({"phase": None}, "None"),
        ({"handle": "container-1"}, "handle must be an object"),
        ({"handle": ["a"]}, "handle must be an object"),
        ({"attempt": None}, "attempt must be an object"),
        ({"attempt": [1]}, "attempt must be an object"),
        ({"failure": "boom"}, "failure must be an object"),
        ({"failure": 1}, "failure must be an object"),
    ],
)
def test_bad_updates_are_value_errors(update: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        apply_update(Record("vllm"), update, NOW)


def test_an_update_does_not_change_the_record_it_is_given() -> None:
    rec = Record("vllm")
    apply_update(rec, {"phase": "running", "touch": True, "attempt": {"n": 1}}, NOW)
    assert rec == Record("vllm")


# --------------------------------------------------------------------------- the JSON


def full_record() -> Record:
    return Record(
        service="vllm",
        phase=Phase.RUNNING,
        since=NOW - 100,
        last_used=NOW - 3,
        lease=lease(),
        handle={"kind": "process", "pid": 77, "pid_start": NOW - 99.5},
        attempts=({"at": NOW - 100, "ok": True},),
        failure=Failure(NOW - 200, "exit 1", "tail", 2, NOW - 180),
    )


@pytest.mark.parametrize(
    "rec",
    [
        Record("vllm"),
        full_record(),
        replace(full_record(), lease=replace(lease(), pid_start=None)),
        Record("x.y-z_1", phase=Phase.PREEMPTED, since=1.5),
    ],
)
def test_round_trip(rec: Record) -> None:
    d = rec.to_dict()
    assert decode_record(d) == rec
    assert decode_record(json.loads(json.dumps(d))) == rec


def test_to_dict_has_the_documented_fields() -> None:
    d = full_record().to_dict()
    assert d["schema"] == RECORD_SCHEMA
    assert {
        "schema",
        "service",
        "phase",
        "since",
        "last_used",
        "lease",
        "handle",
        "attempts",
        "failure",
    } <= set(d)
    assert d["phase"] == "running"
    assert set(d["lease"]) == {
        "holder",
        "host",
        "boot_id",
        "pid",
        "pid_start",
        "entry",
        "granted",
        "expires",
    }
    assert set(d["failure"]) == {"at", "error", "log_tail", "count", "backoff_until"}


def test_decode_fills_the_defaults_of_missing_keys() -> None:
    rec = decode_record({"service": "vllm"})
    assert rec == Record("vllm")
    assert rec.phase is Phase.STOPPED
    assert rec.last_used is None
    assert decode_record({"service": "vllm", "recovered": "why"}).recovered == "why"
    # a handle and an attempt keep what their launcher put there (scalars only)
    rec = decode_record(
        {"service": "vllm", "handle": {"kind": "docker", "id": "abc"}, "attempts": [{"ok": 1}]}
    )
    assert rec.handle == {"kind": "docker", "id": "abc"}
    assert rec.attempts == ({"ok": 1},)


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        [],
        "vllm",
        42,
        {},
        {"phase": "running"},  # no service
        {"service": "vllm", "phase": "exploded"},
        {"service": "vllm", "since": "yesterday"},
        {"service": "vllm", "since": {"t": 1}},
        {"service": "vllm", "last_used": "now"},
        {"service": "vllm", "attempts": "many"},
        {"service": "vllm", "attempts": {"a": 1}},
        {"service": "vllm", "lease": {"holder": "h"}},  # no expiry
        {"service": "vllm", "lease": {"expires": 5}},  # no holder
        {"service": "vllm", "lease": "h1"},
        {"service": "vllm", "lease": [1, 2]},
        {"service": "vllm", "lease": {**lease().to_dict(), "pid": "forty"}},
        {"service": "vllm", "lease": {**lease().to_dict(), "expires": "soon"}},
        {"service": "vllm", "failure": {"error": "x"}},  # no time
        {"service": "vllm", "failure": "boom"},
        {"service": "vllm", "failure": {"at": 1, "count": "two"}},
        # what the old reader let through and the agent then choked on
        {"service": "vllm", "handle": "not-a-dict"},
        {"service": "vllm", "attempts": [{"ok": 1}, 3, "x"]},
        {"service": "vllm", "extra": 1},
        {"service": "vllm", "recovered": 3},
    ],
)
def test_decode_rejects_garbage(garbage: Any) -> None:
    with pytest.raises(RecordError):
        decode_record(garbage)


def test_a_lease_needs_every_field() -> None:
    for key in lease().to_dict():
        if key == "pid_start":
            continue  # may be unknown (another PID namespace): null, or absent
        d = {**lease().to_dict()}
        del d[key]
        with pytest.raises(RecordError, match=re.escape(f"at $.lease.{key}: missing")):
            decode_record({"service": "vllm", "lease": d})
