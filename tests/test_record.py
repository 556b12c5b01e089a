"""The pure core of the state store: back-off, lease state, updates, the record's JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from gpuctl.adapters.store.codec import (
    MAX_RECORD_BYTES,
    RecordError,
    check_record,
    decode_holder,
    decode_record,
    decode_set_aside,
    encode_record,
    parse_record,
    salvage,
)
from gpuctl.core.promise import Promise
from gpuctl.core.record import (
    BACKOFF_MAX_S,
    ERROR_MAX,
    LOG_TAIL_MAX,
    MAX_ATTEMPTS_KEPT,
    RECORD_SCHEMA,
    Failure,
    Lease,
    LeaseState,
    Phase,
    Record,
    backoff_s,
    in_backoff,
    lease_state,
    starting_services,
)
from gpuctl.core.record_shapes import RecordUpdate, StartFailure, apply_update

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


def test_a_first_step_given_doubles_the_same_and_keeps_the_cap() -> None:
    """The store passes a test's first step (``ensure.backoff``); the rule stays the rule."""
    assert [backoff_s(n, first_s=1.0) for n in (0, 1, 2, 3)] == [0.0, 1.0, 2.0, 4.0]
    assert backoff_s(1, first_s=60.0) == 60.0
    assert backoff_s(4, first_s=60.0) == BACKOFF_MAX_S


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
    started = apply_update(rec, RecordUpdate.from_wire({"phase": "starting"}), NOW)
    assert started.phase is Phase.STARTING
    assert started.since == NOW
    again = apply_update(started, RecordUpdate.from_wire({"phase": "starting"}), NOW + 50)
    assert again.since == NOW
    assert apply_update(rec, RecordUpdate.from_wire({}), NOW) == rec


def test_update_handle_sets_and_clears() -> None:
    rec = apply_update(
        Record("vllm"), RecordUpdate.from_wire({"handle": {"kind": "docker", "id": "abc"}}), NOW
    )
    assert rec.handle == {"kind": "docker", "id": "abc"}
    assert apply_update(rec, RecordUpdate.from_wire({"handle": None}), NOW).handle is None


def test_update_attempt_appends_and_keeps_the_last_ten() -> None:
    rec = Record("vllm")
    for i in range(MAX_ATTEMPTS_KEPT + 3):
        rec = apply_update(rec, RecordUpdate.from_wire({"attempt": {"n": i}}), NOW + i)
    assert len(rec.attempts) == MAX_ATTEMPTS_KEPT
    assert rec.attempts[0] == {"n": 3}
    assert rec.attempts[-1] == {"n": MAX_ATTEMPTS_KEPT + 2}


def test_update_touch_sets_last_used() -> None:
    rec = apply_update(Record("vllm"), RecordUpdate.from_wire({"touch": True}), NOW)
    assert rec.last_used == NOW
    assert apply_update(rec, RecordUpdate.from_wire({"touch": False}), NOW + 9).last_used == NOW
    assert rec.idle_for(NOW + 30) == 30
    assert rec.idle_for(NOW - 30) == 0  # a clock step back is not negative idleness
    assert Record("vllm").idle_for(NOW) is None


def test_failure_counts_up_and_sets_its_backoff() -> None:
    rec = Record("vllm", phase=Phase.STARTING, since=NOW - 10)
    first = apply_update(
        rec, RecordUpdate.from_wire({"failure": {"error": "exit 1", "log_tail": "OOM"}}), NOW
    )
    assert first.phase is Phase.FAILED
    assert first.since == NOW
    assert first.failure == Failure(NOW, "exit 1", "OOM", 1, NOW + 10)
    assert in_backoff(first, NOW + 9.9)
    assert not in_backoff(first, NOW + 10)
    second = apply_update(
        first, RecordUpdate.from_wire({"failure": {"error": "exit 2"}}), NOW + 100
    )
    assert second.failure is not None
    assert second.failure.count == 2
    assert second.failure.backoff_until == NOW + 100 + 20
    assert second.failure.log_tail == ""
    assert second.since == NOW  # still failed: the phase did not change
    third = apply_update(second, RecordUpdate.from_wire({"failure": {}}), NOW + 200)
    assert third.failure is not None
    assert (third.failure.count, third.failure.backoff_until) == (3, NOW + 240)
    cleared = apply_update(
        third, RecordUpdate.from_wire({"failure": None, "phase": "running"}), NOW + 300
    )
    assert cleared.failure is None
    assert not in_backoff(cleared, NOW + 301)
    assert apply_update(
        cleared, RecordUpdate.from_wire({"failure": {"error": "x"}}), NOW + 400
    ).failure == Failure(NOW + 400, "x", "", 1, NOW + 410)


def test_in_backoff_only_while_failed() -> None:
    failed = apply_update(Record("vllm"), RecordUpdate.from_wire({"failure": {"error": "x"}}), NOW)
    assert in_backoff(failed, NOW + 1)
    # a failure kept while the service was started by hand and runs: no back-off
    assert not in_backoff(replace(failed, phase=Phase.RUNNING), NOW + 1)
    assert not in_backoff(None, NOW)
    assert not in_backoff(Record("vllm"), NOW)


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"lease": None}, "unknown field `lease`"),
        ({"last_used": 5}, "unknown field"),
        ({"phase": "exploded"}, "exploded"),
        ({"phase": None}, "got `null` - at `$.phase`"),
        ({"handle": "container-1"}, "Expected `object | null`, got `str` - at `$.handle`"),
        ({"handle": ["a"]}, "Expected `object | null`, got `array` - at `$.handle`"),
        ({"attempt": None}, "Expected `object`, got `null` - at `$.attempt`"),
        ({"attempt": [1]}, "Expected `object`, got `array` - at `$.attempt`"),
        ({"failure": "boom"}, "Expected `object | null`, got `str` - at `$.failure`"),
        ({"failure": 1}, "Expected `object | null`, got `int` - at `$.failure`"),
    ],
)
def test_bad_updates_are_value_errors(update: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        RecordUpdate.from_wire(update)


def test_an_update_does_not_change_the_record_it_is_given() -> None:
    rec = Record("vllm")
    apply_update(
        rec, RecordUpdate.from_wire({"phase": "running", "touch": True, "attempt": {"n": 1}}), NOW
    )
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


# --------------------------------------------------------------------------- the schema

FIXTURES = Path(__file__).parent / "fixtures" / "records"


def test_records_written_by_the_previous_release_still_load() -> None:
    """Records on disk survive the upgrade: every fixture (written by 0.1.0's store
    before records were validated) passes the schema, and says what it said then."""
    files = sorted(FIXTURES.glob("*.json"))
    assert len(files) == 7
    got = {p.stem: parse_record(p.read_bytes()) for p in files}
    assert {k: r.phase.value for k, r in got.items()} == {
        "_admission": "stopped",
        "comfy": "stopped",
        "notebook": "stopped",
        "sglang": "starting",
        "vllm-docker": "running",
        "vllm-jupyter": "starting",
        "whisper": "failed",
    }
    docker = got["vllm-docker"]
    assert docker.handle is not None
    assert docker.handle["kind"] == "docker"
    assert docker.handle["container_name"] == "gpuctl-vllm-docker"
    assert docker.attempts[-1]["outcome"] == "ready"
    jupyter = got["vllm-jupyter"]
    assert jupyter.lease is not None
    assert (jupyter.lease.pid, jupyter.lease.entry) == (4242, "ensure")
    assert jupyter.handle is not None
    assert jupyter.handle["terminal"] == "gpuctl-vllm-jupyter-1"
    whisper = got["whisper"]
    assert whisper.failure is not None
    assert whisper.failure.count == 2
    assert whisper.failure.backoff_until == whisper.failure.at + 20
    assert "CUDA out of memory" in whisper.failure.log_tail
    assert whisper.handle is not None
    assert whisper.handle["kind"] == "process"
    assert got["comfy"].handle is None
    assert got["notebook"].last_used is not None
    for name, rec in got.items():
        assert rec.service == name
        assert rec.start_nonce is None
        assert rec.health is None
        # and what this release writes back is what it read
        assert parse_record(encode_record(rec).encode()) == rec


def pid_record(pid: Any) -> dict[str, Any]:
    return {"service": "vllm", "handle": {"kind": "process", "pid": pid}}


@pytest.mark.parametrize(
    ("data", "where", "fragment"),
    [
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": 2147483648}},
            "$.lease.pid",
            "out of range",
        ),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": 0}},
            "$.lease.pid",
            "out of range",
        ),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": -1}},
            "$.lease.pid",
            "out of range",
        ),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": 4242.0}},
            "$.lease.pid",
            "expected an integer",
        ),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": True}},
            "$.lease.pid",
            "got a boolean",
        ),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "pid": "4242"}},
            "$.lease.pid",
            "got a string",
        ),
        (pid_record(1 << 22 + 1), "$.handle.pid", "out of range"),
        ({"service": "vllm", "since": float("nan")}, "$.since", "not a finite number"),
        ({"service": "vllm", "last_used": float("inf")}, "$.last_used", "not a finite number"),
        ({"service": "vllm", "last_used": 1e308}, "$.last_used", "out of range"),
        ({"service": "vllm", "since": -1}, "$.since", "out of range"),
        ({"service": "vllm", "since": True}, "$.since", "got a boolean"),
        (
            {"service": "vllm", "lease": {**lease().to_dict(), "expires": 1e308}},
            "$.lease.expires",
            "out of range",
        ),
        (
            {"service": "vllm", "failure": {"at": NOW, "count": "no"}},
            "$.failure.count",
            "got a string",
        ),
        (
            {"service": "vllm", "failure": {"at": NOW, "count": 0}},
            "$.failure.count",
            "out of range",
        ),
        (
            {"service": "vllm", "failure": {"at": NOW, "error": "x" * 70_000}},
            "$.failure.error",
            "length",
        ),
        ({"service": "vllm", "phase": "no"}, "$.phase", "is not one of"),
        ({"service": "vllm", "phase": 1}, "$.phase", "is not one of"),
        ({"service": "vllm", "schema": 2}, "$.schema", "is not one of"),
        ({"service": "vllm", "schema": True}, "$.schema", "is not one of"),
        ({"service": "vllm", "service2": 1}, "$.service2", "unknown field"),
        ({"service": "vllm\n"}, "$.service", "does not match"),
        ({"service": "../etc/passwd"}, "$.service", "does not match"),
        ({"service": "vllm", "start_nonce": "XYZ0a1b2c"}, "$.start_nonce", "does not match"),
        ({"service": "vllm", "start_nonce": "0a1b"}, "$.start_nonce", "length"),
        ({"service": "vllm", "health": "file:///etc/passwd"}, "$.health", "does not match"),
        ({"service": "vllm", "health": 8000}, "$.health", "got an integer"),
        ({"service": "vllm", "recovered": "\ud800"}, "$.recovered", "not valid Unicode"),
        (
            {"service": "vllm", "handle": {"kind": "process", "x": [1]}},
            "$.handle.x",
            "got an array",
        ),
        (
            {"service": "vllm", "handle": {"kind": "process", "x": {"y": 1}}},
            "$.handle.x",
            "got an object",
        ),
        (
            {"service": "vllm", "attempts": [{"started": "now"}]},
            "$.attempts[0].started",
            "got a string",
        ),
        ({"service": "vllm", "attempts": [{}] * 65}, "$.attempts", "at most 64"),
    ],
)
def test_schema_errors_are_located(data: dict[str, Any], where: str, fragment: str) -> None:
    with pytest.raises(RecordError) as info:
        decode_record(data)
    assert info.value.where == where
    assert str(info.value).startswith(f"at {where}: ")
    assert fragment in info.value.why


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff\xfe\x00", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
        (b'{"service": "vllm", "since": NaN}', "not a finite number"),
        (b'{"service": "vllm", "since": 1e400}', "not a finite number"),
        (b'{"service": "vllm", "since": Infinity}', "not a finite number"),
        (b'{"service": "vllm", "lease": ' * 2000 + b"1" + b"}" * 2000, "at $: nested too deep"),
        (b'{"service": "vllm", "lease": ' * 200 + b"1" + b"}" * 200, "at $.lease.holder: missing"),
        (b" " * (MAX_RECORD_BYTES + 1), "bytes, at most"),
        (b"", "not JSON"),
    ],
)
def test_bytes_that_are_no_record_are_located_errors(raw: bytes, fragment: str) -> None:
    with pytest.raises(RecordError) as info:
        parse_record(raw)
    assert fragment in str(info.value)


def test_a_valid_record_round_trips_through_the_file_form() -> None:
    rec = replace(full_record(), start_nonce="0123abcd" * 4, health="http://127.0.0.1:8000/health")
    assert parse_record(encode_record(rec).encode()) == rec


def test_writing_checks_the_schema_too() -> None:
    with pytest.raises(RecordError, match=re.escape("at $.handle.pid")):
        check_record(Record("vllm", handle={"pid": 2**31}))
    with pytest.raises(RecordError, match=re.escape("at $.last_used")):
        encode_record(Record("vllm", last_used=float("nan")))


# ---- properties: whatever the bytes, a Record or a located RecordError


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)
FIELD_NAMES = st.sampled_from(
    ["service", "phase", "since", "last_used", "lease", "handle", "attempts", "failure",
     "recovered", "schema", "start_nonce", "health", "pid", "holder", "expires", "at",
     "count", "kind", "pid_start", "granted", "error", "log_tail"]
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_record_or_a_located_error(raw: bytes) -> None:
    try:
        rec = parse_record(raw)
    except RecordError as e:
        assert str(e).startswith("at $")
    else:
        assert isinstance(rec, Record)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_value_decodes_to_a_record_or_a_located_error(data: Any) -> None:
    try:
        rec = decode_record(data)
    except RecordError as e:
        assert str(e).startswith("at $")
    else:
        check_record(rec)  # what was accepted can be written back


def _fixture_values() -> list[dict[str, Any]]:
    return [json.loads(p.read_bytes()) for p in sorted(FIXTURES.glob("*.json"))]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(_fixture_values()),
    st.lists(st.tuples(FIELD_NAMES, JSON), max_size=3),
    st.data(),
)
def test_real_records_with_fields_swapped_for_junk(
    base: dict[str, Any], swaps: list[tuple[str, Any]], data: st.DataObject
) -> None:
    """Today's records, with fields (top level or one level down) replaced by any JSON:
    near misses that a random value would rarely reach."""
    doc = json.loads(json.dumps(base))
    for key, value in swaps:
        nested = [k for k, v in doc.items() if isinstance(v, dict)]
        if nested and data.draw(st.booleans()):
            doc[data.draw(st.sampled_from(nested))][key] = value
        else:
            doc[key] = value
    try:
        text = json.dumps(doc)
    except ValueError:
        return
    try:
        rec = parse_record(text.encode())
    except RecordError as e:
        assert str(e).startswith("at $")
    else:
        assert parse_record(encode_record(rec).encode()) == rec


# --------------------------------------------------------------------------- touch


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("ready", [False, True])
def test_a_use_only_ever_completes_a_start(phase: Phase, ready: bool) -> None:
    """A touch sets last_used; with ``ready`` it completes starting -> running, and
    never brings back a stopped, preempted, failed (or any other) record."""
    before = Record("vllm", phase=phase, since=NOW - 50, failure=Failure(NOW - 60, "x"))
    after = before.used(NOW, ready=ready)
    assert after.last_used == NOW
    if ready and phase is Phase.STARTING:
        assert (after.phase, after.since, after.failure) == (Phase.RUNNING, NOW, None)
    else:
        assert replace(after, last_used=None) == before


# --------------------------------------------------------------------------- updates, exactly typed


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"touch": "no"}, "Expected `bool`, got `str` - at `$.touch`"),
        ({"touch": 1}, "Expected `bool`, got `int` - at `$.touch`"),
        ({"phase": 3}, "got `int` - at `$.phase`"),
        ({"failure": {"error": 5}}, "Expected `str`, got `int` - at `$.failure.error`"),
        ({"start_nonce": 5}, "Expected `str | null`, got `int` - at `$.start_nonce`"),
        ({"health": ["http://x"]}, "Expected `str | null`, got `array` - at `$.health`"),
    ],
)
def test_updates_are_exactly_typed(update: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        RecordUpdate.from_wire(update)


def test_update_sets_and_clears_the_nonce_and_the_health_url() -> None:
    rec = apply_update(
        Record("vllm"),
        RecordUpdate.from_wire({"start_nonce": "ab12cd34", "health": "http://h:1/"}),
        NOW,
    )
    assert (rec.start_nonce, rec.health) == ("ab12cd34", "http://h:1/")
    rec = apply_update(rec, RecordUpdate.from_wire({"start_nonce": None, "health": None}), NOW)
    assert (rec.start_nonce, rec.health) == (None, None)


def test_long_failure_texts_are_clipped_not_refused() -> None:
    rec = apply_update(
        Record("vllm"),
        RecordUpdate(
            failure=StartFailure("e" * 10_000, "x" * 50_000 + "END"),
            attempt={"error": "a" * 9000},
        ),
        NOW,
    )
    assert rec.failure is not None
    assert len(rec.failure.error) == ERROR_MAX
    assert rec.failure.log_tail.endswith("END")
    assert len(rec.failure.log_tail) == LOG_TAIL_MAX
    assert len(rec.attempts[0]["error"]) == ERROR_MAX
    check_record(rec)


@settings(max_examples=300, deadline=None)
@given(st.one_of(JSON, st.fixed_dictionaries({}, optional=dict.fromkeys(
    ["id", "host", "boot_id", "pid", "pid_start", "entry"],
    JSON | st.integers(0, 2**23) | st.text(min_size=1, max_size=8)))))  # fmt: skip
def test_any_holder_body_is_a_holder_or_a_located_error(data: Any) -> None:
    """The lease request's holder, as the agent reads it off the wire."""
    try:
        h = decode_holder(data)
    except RecordError as e:
        assert str(e).startswith("at $.holder")
    else:
        assert 1 <= h.pid <= 1 << 22
        assert decode_holder(h.to_dict()) == h


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_set_aside_list_is_a_list_or_a_located_error(data: Any) -> None:
    try:
        got = decode_set_aside(data)
    except RecordError as e:
        assert str(e).startswith("at $.set_aside")
    else:
        assert decode_set_aside([a.to_dict() for a in got]) == got


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_fixture_values()), st.lists(st.tuples(FIELD_NAMES, JSON), max_size=3))
def test_salvage_keeps_what_passes_and_never_raises(
    base: dict[str, Any], swaps: list[tuple[str, Any]]
) -> None:
    doc = {**base, **dict(swaps)}
    try:
        raw = json.dumps(doc).encode()
    except ValueError:
        return
    rec = salvage(raw, base["service"])
    check_record(rec)
    assert rec.service == base["service"]
    if doc.get("service") != base["service"]:
        assert rec == Record(base["service"])  # another service's record: nothing of it
        return
    for key, value in doc.items():
        if key in ("service", "recovered", "schema"):
            continue
        try:
            ok = decode_record({"service": base["service"], key: value})
        except RecordError:
            continue
        assert getattr(rec, key) == getattr(ok, key)  # every field that passes is kept


def test_salvage_of_what_is_no_record_of_this_service_keeps_nothing() -> None:
    fresh = Record("vllm")
    assert salvage(b"\xff", "vllm") == fresh
    assert salvage(b"[1]", "vllm") == fresh
    assert salvage(b'{"service": "sglang", "phase": "running"}', "vllm") == fresh
    assert salvage(b"[" * 100_000, "vllm") == fresh


# --------------------------------------------------------------------------- starting_services


@pytest.mark.parametrize("phase", list(Phase))
def test_a_held_lease_of_an_older_release_promises_the_service_whatever_its_phase(
    phase: Phase,
) -> None:
    """A lease on a record without a promise (an older release wrote it, which may spawn
    without marking `starting`): its budget counts whatever the phase; the service being
    decided never counts itself."""
    held = Record("chat", phase=phase, lease=lease())
    free = Record("vlm", phase=phase)
    assert starting_services([held, free]) == ["chat"]
    assert starting_services([held, free], exclude="chat") == []


@pytest.mark.parametrize("phase", list(Phase))
def test_a_lease_still_on_its_way_to_admission_promises_nothing(phase: Phase) -> None:
    """This release's lease (the record says its promise) counts once admitted
    (`starting`) or over a record that holds memory already (a stop's lease); a caller
    still waiting for the admission lock (the record stopped, failed, or preempted with
    its server gone) re-checks under it before it spawns, so it promises nothing yet."""
    promise = Promise(memory_mib=80 * 1024, priority=50)
    held = Record("chat", phase=phase, lease=lease(), promise=promise)
    waiting = phase in (Phase.STOPPED, Phase.FAILED, Phase.PREEMPTED)
    assert starting_services([held]) == ([] if waiting else ["chat"])
    if phase is Phase.PREEMPTED:
        # Its server still recorded: the stop may not have landed; it holds memory.
        kept = replace(held, handle={"kind": "process", "pid": 4321})
        assert starting_services([kept]) == ["chat"]


def test_a_record_update_is_declared_once() -> None:
    """The agent's request check and its OpenAPI component take the update's fields from
    ``RecordUpdate``; its wire form reads back as the same value."""
    from gpuctl.agent.openapi import openapi_document

    component = openapi_document()["components"]["schemas"]["RecordUpdate"]
    assert set(component["properties"]) == set(RecordUpdate.__struct_fields__)
    update = RecordUpdate(
        phase=Phase.RUNNING, handle=None, failure=None, touch=True, health="http://h:1/"
    )
    wire_form = update.to_wire()
    assert wire_form == {
        "phase": "running",
        "handle": None,
        "failure": None,
        "touch": True,
        "health": "http://h:1/",
    }
    assert RecordUpdate.from_wire(wire_form) == update
    assert not RecordUpdate() and RecordUpdate().to_wire() == {}
    with pytest.raises(ValueError, match="unknown field `colour`"):
        RecordUpdate.from_wire({"colour": "red"})
