"""Each /records shape is declared once, as a msgspec Struct, and the rest is generated:
the agent's OpenAPI components, the store codec's field tables, the agent's request
checks. These tests hold the three to the one declaration."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gpuctl.adapters.store import codec
from gpuctl.adapters.store.schema import ABSENT, REQUIRED
from gpuctl.agent import openapi_records, wire
from gpuctl.agent.openapi import openapi_document
from gpuctl.core import record_shapes, store_shapes
from gpuctl.core.queue import QUEUE_TTL_MAX_S
from gpuctl.core.record import INFLIGHT_TTL_MAX_S

GENERATED = [
    "Lease",
    "Failure",
    "Record",
    "Promise",
    "SetAside",
    "Voided",
    "VoidedList",
    "RecordList",
    "LeaseGrant",
    "TouchRequest",
    "JobStopRequest",
    "JobStopped",
    "InflightEnd",
    "InflightRequest",
    "Waiter",
    "QueueList",
    "QueueJoin",
    "QueueJoined",
    "QueueLeave",
    "QueueLeft",
    "InflightList",
    "StoreError",
    "LeaseRequest",
    "RenewRequest",
    "HolderUpdate",
    "ReleaseRequest",
    "Holder",
    "RecordUpdate",
    "StartFailure",
]
REQUESTS = [
    "LeaseRequest",
    "RenewRequest",
    "HolderUpdate",
    "ReleaseRequest",
    "TouchRequest",
    "JobStopRequest",
    "InflightEnd",
    "InflightRequest",
    "QueueJoin",
    "QueueLeave",
]


def _structs() -> dict[str, type[msgspec.Struct]]:
    """Every Struct the /records components are generated from, by component name."""
    out: dict[str, type[msgspec.Struct]] = {}

    def walk(t: Any) -> None:
        if isinstance(t, msgspec.inspect.StructType) and t.cls.__name__ not in out:
            out[t.cls.__name__] = t.cls
            for f in t.fields:
                walk(f.type)
        for attr in ("type", "item_type", "value_type"):
            if hasattr(t, attr):
                walk(getattr(t, attr))
        for u in getattr(t, "types", ()):
            walk(u)

    for shape in (*openapi_records.REQUESTS, *openapi_records.ANSWERS):
        walk(msgspec.inspect.type_info(shape))
    return out


def test_every_records_component_is_generated_from_a_struct() -> None:
    components = openapi_records.records_schemas()
    structs = _structs()
    for name in GENERATED:
        assert name in structs, f"{name} is declared by no Struct"
        # msgspec titles what it generates; a hand-written dict had no title.
        assert components[name]["title"] == name
        assert components[name]["description"], name
    enums = {"Phase"}
    free = {"Handle", "Attempt"}  # folded into RecordUpdate as open objects
    assert set(components) == (set(structs) - free) | enums
    doc = openapi_document()["components"]["schemas"]
    for name in components:
        assert doc[name] == components[name]


def test_request_bodies_are_as_strict_as_the_agent() -> None:
    s = openapi_records.records_schemas()
    for name in REQUESTS:
        assert s[name]["additionalProperties"] is False, name
    entry = {"type": "string", "pattern": "^[A-Za-z0-9]{1,64}$", "maxLength": 64, "minLength": 1}
    for name in ("InflightEnd", "QueueLeave"):
        assert entry.items() <= s[name]["properties"]["holder"].items()
        assert s[name]["required"] == ["holder"]
    assert entry.items() <= s["EntryHolder"]["properties"]["id"].items()
    inflight = s["InflightRequest"]["properties"]["ttl_s"]
    assert (inflight["exclusiveMinimum"], inflight["maximum"]) == (0, INFLIGHT_TTL_MAX_S)
    queue = s["QueueJoin"]["properties"]
    assert (queue["ttl_s"]["exclusiveMinimum"], queue["ttl_s"]["maximum"]) == (0, QUEUE_TTL_MAX_S)
    assert queue["name"]["pattern"] == openapi_records.SERVICE_NAME_PATTERN
    assert set(s["QueueJoin"]["required"]) == {"holder", "ttl_s", "name", "priority", "memory_mib"}
    stop = s["JobStopRequest"]
    assert set(stop["required"]) == {"holder", "pid", "pid_start"}
    assert stop["properties"]["grace_s"]["maximum"] == record_shapes.MAX_GRACE_S
    assert stop["properties"]["holder"]["minLength"] == 1
    devices = s["Promise"]["properties"]["devices"]["anyOf"][0]
    assert (devices["minItems"], devices["uniqueItems"]) == (1, True)
    # The store writes every field of a record, a lease and a failure.
    for name in ("Record", "Lease", "Failure", "QueueLease"):
        assert s[name]["required"] == list(s[name]["properties"]), name


@pytest.mark.parametrize(
    ("table", "shape"),
    [
        (codec.HOLDER_FIELDS, record_shapes.Holder),
        (codec.HANDLE_FIELDS, record_shapes.Handle),
        (codec.ATTEMPT_FIELDS, record_shapes.Attempt),
        (codec.LEASE_FIELDS, store_shapes.Lease),
        (codec.FAILURE_FIELDS, store_shapes.Failure),
        (codec.PROMISE_FIELDS, store_shapes.Promise),
        (codec.RECORD_FIELDS, store_shapes.Record),
        (codec.SET_ASIDE_FIELDS, store_shapes.SetAside),
        (codec.VOIDED_FIELDS, store_shapes.Voided),
        (codec.WAITER_FIELDS, store_shapes.Waiter),
    ],
)
def test_the_codec_tables_are_the_structs(
    table: dict[str, Any], shape: type[msgspec.Struct]
) -> None:
    """Same fields, in order, same required ones, and a missing field's default is the
    Struct's (an old record file without ``promise`` reads as null)."""
    info = msgspec.inspect.type_info(shape)
    assert isinstance(info, msgspec.inspect.StructType)
    assert list(table) == [f.encode_name for f in info.fields]
    for f in info.fields:
        _, default = table[f.encode_name]
        if f.required:
            assert default is REQUIRED, f.name
        elif f.default_factory is not msgspec.NODEFAULT:
            assert default == f.default_factory(), f.name
        elif f.default in (msgspec.UNSET, msgspec.NODEFAULT):  # UNSET reads as NODEFAULT
            assert default is ABSENT, f.name
        else:
            assert default == f.default, f.name


def test_a_record_file_from_an_older_release_still_reads() -> None:
    record = codec.decode_record({"service": "vllm", "phase": "running"})
    assert record.promise is None
    assert record.attempts == ()


@pytest.mark.parametrize(
    ("check", "body", "field"),
    [
        (wire.end_request, {"holder": "abc\n"}, "holder"),
        (wire.queue_leave_request, {"holder": "abc\n"}, "holder"),
        (wire.queue_leave_request, {"holder": "a-b"}, "holder"),
        (wire.inflight_request, {"holder": {}, "ttl_s": INFLIGHT_TTL_MAX_S + 1}, "holder.id"),
        (wire.touch_request, {"ready": "no"}, "ready"),
        (wire.job_stop_request, {"holder": "h", "pid": 1.5, "pid_start": 1}, "pid"),
        (wire.job_stop_request, {"holder": "h", "pid": 1, "pid_start": 1, "x": 1}, "x"),
    ],
)
def test_the_request_checks_decode_into_their_structs(
    check: Any, body: dict[str, Any], field: str
) -> None:
    """Exact types, every bound, and a name matched in full (msgspec's ``$`` would pass
    a last newline): the 400 names the field."""
    with pytest.raises(wire.BadRequest) as err:
        check(body)
    assert err.value.field == field


def test_an_inflight_ttl_is_bounded() -> None:
    holder = {"id": "ab12", "host": "h", "boot_id": "b", "pid": 1, "entry": "e"}
    for ttl in (0, INFLIGHT_TTL_MAX_S + 0.5):
        with pytest.raises(wire.BadRequest) as err:
            wire.inflight_request({"holder": holder, "ttl_s": ttl})
        assert err.value.field == "ttl_s"
    assert wire.inflight_request({"holder": holder, "ttl_s": 1})["ttl_s"] == 1.0
