"""The agent's /status body, parsed strictly: hostile values are errors that name the field,
never a reading (and never an idle GPU). Per-GPU figures round-trip."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gpuctl.core.snapshot import (
    DRIVER_RESERVE_MIB,
    GpuDevice,
    GpuProcess,
    ProbeReading,
    Snapshot,
    StartingProcess,
    snapshot_from_reading,
)
from gpuctl.core.status_wire import parse_status


def body(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "is_idle": False,
        "memory_used_mib": 1000,
        "memory_total_mib": 81920,
        "unified_memory": False,
        "probe": "nvml",
        "taken_at": "t",
        "gpus": 1,
        "processes": [{"pid": 123, "command": "x", "memory_mib": 1000, "gpu": 0}],
    }
    base.update(over)
    return base


def proc(**over: Any) -> dict[str, Any]:
    return {"pid": 123, "command": "x", "memory_mib": 1000, "gpu": 0, **over}


DEV = {"index": 0, "memory_used_mib": 1000, "memory_total_mib": 81920}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (body(processes=[proc(pid=2147483648)]), "processes[0].pid: Expected `int` <="),
        (body(processes=[proc(pid=0)]), "processes[0].pid: Expected `int` >= 1"),
        (body(processes=[proc(pid=-5)]), "processes[0].pid: Expected `int` >= 1"),
        (body(processes=[proc(memory_mib=float("inf"))]), "processes[0].memory_mib"),
        (body(processes=[proc(memory_mib=float("nan"))]), "processes[0].memory_mib"),
        (body(processes=[proc(memory_mib=-1)]), "processes[0].memory_mib"),
        (body(processes=[proc(memory_mib="8GiB")]), "processes[0].memory_mib"),
        (body(processes=[proc(on_gpu="no")]), "processes[0].on_gpu"),
        (body(processes=[proc(gpu=-1)]), "processes[0].gpu"),
        (body(processes=[proc(sm_util_pct=101)]), "processes[0].sm_util_pct"),
        (body(memory_total_mib=1e400), "memory_total_mib"),
        (body(unified_memory="yes"), "unified_memory"),
        (body(devices=[{**DEV, "utilization_pct": -1}]), "devices[0].utilization_pct"),
        (body(devices=[{**DEV, "unified": 1}]), "devices[0].unified"),
        (body(devices=[{**DEV, "index": "0"}]), "devices[0].index: Expected `int`, got `str`"),
        (body(devices=[{**DEV, "memory_total_mib": 2**60}]), "devices[0].memory_total_mib"),
        (body(devices=[{**DEV, "error": 5}]), "devices[0].error"),
        (body(devices={"0": DEV}), "devices: Expected `array | null`, got `object`"),
        # An unreadable GPU is not idle, whatever the process list says.
        (
            body(is_idle=True, processes=[], devices=[{"index": 0, "error": "lost"}]),
            "is_idle disagrees",
        ),
        (body(starting=[{"pid": 5, "command": "vllm", "age_s": float("nan")}]), "age_s"),
        # Whose each server is: pids in range, names by the one name rule.
        (body(servers=[{"pid": 0, "service": "chat"}]), "servers[0].pid: Expected `int` >= 1"),
        (body(servers=[{"pid": 5, "service": "chat\n"}]), "servers[0].service: not a service name"),
        (
            body(servers=[{"pid": 5, "service": "../x"}]),
            "servers[0].service: Expected `str` matching regex",
        ),
        (body(servers=[{"pid": 5}]), "servers[0]: Object missing required field `service`"),
        (
            body(servers=[{"pid": True, "service": "chat"}]),
            "servers[0].pid: Expected `int`, got `bool`",
        ),
        (body(servers=["5"]), "servers[0]: Expected `object`, got `str`"),
        (body(servers={"5": "chat"}), "servers: Expected `array | null`, got `object`"),
        # The probe's notes: strings, a bounded number of them.
        (body(notes="gpu.json wins"), "notes: Expected `array | null`, got `str`"),
        (body(notes=["ok", 5]), "notes[1]: Expected `str`, got `int`"),
        (body(notes=["n"] * 65), "notes: Expected `array` of length <= 64"),
    ],
)
def test_hostile_values_are_located_errors(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_status(data)
    assert needle in str(exc.value)


def test_servers_round_trip_and_are_optional() -> None:
    snap = parse_status(
        body(servers=[{"pid": 5, "service": "chat"}, {"pid": 6, "service": "run.j"}])
    )
    assert snap.servers == ((5, "chat"), (6, "run.j"))
    assert parse_status(json.loads(json.dumps(snap.to_wire()))).servers == snap.servers
    assert parse_status(body()).servers == ()  # an agent of an earlier release


def test_notes_round_trip_are_optional_and_cut() -> None:
    note = "the simulated GPUs in /s are 128.0 GiB, not the 64.0 GiB asked"
    snap = parse_status(body(notes=[note]))
    assert snap.notes == (note,)
    assert parse_status(json.loads(json.dumps(snap.to_wire()))).notes == (note,)
    assert parse_status(body()).notes == ()  # an agent of an earlier release
    assert parse_status(body(notes=None)).notes == ()
    (long,) = parse_status(body(notes=["x" * 100_000])).notes
    assert len(long) == 1000


def test_per_gpu_figures_round_trip_through_json() -> None:
    snap = Snapshot(
        memory_used_mib=1000,
        memory_total_mib=81920,
        unified_memory=True,
        probe="nvml",
        taken_at="t",
        processes=(
            GpuProcess(7, "vllm serve", 1000, gpu=1, sm_util_pct=37),
            GpuProcess(8, "vllm serve", 0, gpu=0, on_gpu=False),
        ),
        starting=(StartingProcess(8, "vllm serve", age_s=3.0),),
        gpus=2,
        devices=(
            GpuDevice(0, error="GPU is lost"),
            GpuDevice(
                1, 1000, 81920, unified=True, name="GB10", uuid="GPU-1", utilization_pct=0,
                temperature_c=41, power_w=12.5,
            ),
        ),
    )  # fmt: skip
    wire = json.loads(json.dumps(snap.to_wire()))
    back = parse_status(wire)
    assert back == snap
    assert wire["devices"][1]["utilization_pct"] == 0  # a measured 0 stays 0 ...
    assert wire["devices"][0]["utilization_pct"] is None  # ... and unknown stays null
    assert wire["is_idle"] is False


def test_unified_gpu_with_a_process_of_unknown_memory_is_unknown() -> None:
    """Its "used" is its processes' sum: an unknown one is not 0 (it gave GB10 100 GiB
    free beside a process NVML could not measure)."""
    reading = ProbeReading.of_devices(
        "nvml",
        [GpuProcess(7, "a", 1000), GpuProcess(9, "b", None)],
        [GpuDevice(0, None, None, unified=True)],
    )
    (d,) = snapshot_from_reading(reading, taken_at="t", gpu_memory_mib=122880).devices
    assert d.error is not None and "pid 9" in d.error and d.memory_used_mib is None


@pytest.mark.parametrize(
    ("used", "idle"), [(0, True), (26, True), (DRIVER_RESERVE_MIB, True), (40 * 1024, False)]
)
def test_memory_no_process_accounts_for_beyond_the_reserve_is_not_idle(
    used: int, idle: bool
) -> None:
    """40 GiB used and no process listed (MIG's hidden processes, a container without
    --pid=host) said is_idle: true."""
    snap = Snapshot(used, 81920, False, "nvml", "t", (), devices=(GpuDevice(0, used, 81920),))
    assert snap.is_idle is idle
    wire = json.loads(json.dumps(snap.to_wire()))
    assert wire["is_idle"] is idle and wire["processes"] == []
    assert parse_status(wire) == snap


def test_not_idle_with_nothing_listed_is_accepted_and_kept() -> None:
    """An agent whose store promises the GPU (a lease, a starting record) says is_idle
    false with no process: a client accepts it, and the snapshot stays not idle."""
    dev = {**DEV, "memory_used_mib": 0, "error": None}
    snap = parse_status(body(is_idle=False, processes=[], devices=[dev]))
    assert snap.is_idle is False and snap.promised is True
    assert snap.to_wire()["is_idle"] is False
    # An older agent's "idle" beside 40 GiB no process accounts for parses, not idle.
    old = parse_status(
        body(is_idle=True, processes=[], devices=[{**dev, "memory_used_mib": 40960}])
    )
    assert old.is_idle is False


def test_an_unreadable_gpu_makes_an_empty_host_not_idle() -> None:
    snap = Snapshot(0, 81920, False, "nvml", "t", (), devices=(GpuDevice(0, error="lost"),))
    assert snap.is_idle is False
    assert snap.to_wire()["is_idle"] is False


def test_an_old_agent_body_without_devices_still_parses() -> None:
    snap = parse_status(body())
    assert snap.devices == ()
    (dev,) = snap.device_list()
    assert (dev.memory_used_mib, dev.memory_total_mib) == (1000, 81920)


# --- properties: any body yields a Snapshot or a located ValueError -----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_proc_like = st.fixed_dictionaries(
    {},
    optional={
        k: _values for k in ("pid", "command", "memory_mib", "gpu", "on_gpu", "sm_util_pct", "user")
    },
)
_device_like = st.fixed_dictionaries(
    {},
    optional={
        k: _values
        for k in (
            "index",
            "memory_used_mib",
            "memory_total_mib",
            "unified",
            "utilization_pct",
            "temperature_c",
            "power_w",
            "error",
        )
    },
)
_body_like = st.fixed_dictionaries(
    {},
    optional={
        "is_idle": st.booleans() | _values,
        "processes": st.lists(_proc_like, max_size=3) | _values,
        "devices": st.lists(_device_like, max_size=3) | _values,
        "starting": st.lists(_values, max_size=2) | _values,
        "servers": st.lists(_values, max_size=2) | _values,
        "memory_used_mib": _values,
        "memory_total_mib": _values,
        "unified_memory": _values,
        "gpus": _values,
    },
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_body_like | _values)
def test_any_body_is_a_snapshot_or_a_located_error(data: Any) -> None:
    try:
        snap = parse_status(data)
    except ValueError as e:
        assert str(e)  # says what is wrong
        return
    # What parses is sane: exact pids, finite non-negative sizes, and idle only when
    # nothing runs and every GPU was read.
    for p in snap.processes:
        assert 0 < p.pid < 4_194_304
        assert p.memory_mib is None or p.memory_mib >= 0
    for d in snap.devices:
        assert d.memory_total_mib is None or d.memory_total_mib >= 0
    if snap.is_idle:
        assert not snap.processes and all(d.readable for d in snap.devices)
    # And it survives its own wire form.
    assert parse_status(json.loads(json.dumps(snap.to_wire()))).to_wire() == snap.to_wire()


# --- the one builder: per-GPU figures from a probe reading ---------------------------------


def test_builder_fills_each_gpu_by_its_own_rule() -> None:
    reading = ProbeReading.of_devices(
        "nvml",
        [
            GpuProcess(7, "a", 1000, gpu=0),
            GpuProcess(8, "b", 300, gpu=1),
            GpuProcess(9, "c", None, gpu=0),
            GpuProcess(10, "vllm serve", 0, gpu=0, on_gpu=False),
        ],
        [
            GpuDevice(0, 5000, 81920),  # its own figures: kept (4000 MiB unattributed)
            GpuDevice(1, None, None, unified=True),  # GB10: processes' sum, configured total
            GpuDevice(2, error="GPU is lost"),  # unknown stays unknown
        ],
    )
    snap = snapshot_from_reading(
        reading,
        taken_at="t",
        starting=(StartingProcess(10, "vllm serve"), StartingProcess(7, "a")),
        gpu_memory_mib=122880,
    )
    d0, d1, d2 = snap.devices
    assert (d0.memory_used_mib, d0.memory_total_mib, d0.unified) == (5000, 81920, False)
    assert (d1.memory_used_mib, d1.memory_total_mib, d1.unified) == (300, 122880, True)
    assert (d2.memory_used_mib, d2.memory_total_mib, d2.error) == (None, None, "GPU is lost")
    # The host's figures are sums over the GPUs that could be read.
    assert (snap.memory_used_mib, snap.memory_total_mib) == (5300, 81920 + 122880)
    assert snap.unified_memory is True and snap.gpus == 3
    assert snap.is_idle is False
    # A process on the GPU is not "starting"; the agent's on_gpu false entry still is.
    assert [s.pid for s in snap.starting or ()] == [10]


def test_mig_instances_and_process_instance_round_trip() -> None:
    from gpuctl.core.snapshot import MigInstance

    snap = Snapshot(
        11468,
        81920,
        False,
        "nvml",
        "t",
        (GpuProcess(7, "vllm", None, gpu=0, mig=1),),
        devices=(
            GpuDevice(
                0,
                11468,
                81920,
                mig=(MigInstance(1, 11571, 40960, "MIG-1"), MigInstance(2, 17, 20480)),
            ),
        ),
    )
    wire = json.loads(json.dumps(snap.to_wire()))
    assert wire["devices"][0]["mig"][0] == {
        "id": 1,
        "uuid": "MIG-1",
        "memory_used_mib": 11571,
        "memory_total_mib": 40960,
    }
    assert wire["processes"][0]["mig"] == 1
    assert parse_status(wire) == snap


@pytest.mark.parametrize(
    ("mig", "needle"),
    [
        ([{"id": -1}], "devices[0].mig[0].id: Expected `int` >= 0"),
        ([{"id": 1, "memory_total_mib": 2**60}], "mig[0].memory_total_mib"),
        ({"1": {}}, "devices[0].mig: Expected `array | null`, got `object`"),
        (["x"], "devices[0].mig[0]: Expected `object`, got `str`"),
    ],
)
def test_bad_mig_instances_are_located_errors(mig: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_status(body(devices=[{**DEV, "mig": mig}]))
