"""The agent's /status body, parsed strictly: hostile values are errors that name the field,
never a reading (and never an idle GPU). Per-GPU figures round-trip."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuctl.core.model import GpuDevice, GpuProcess, Snapshot, StartingProcess


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
        (body(processes=[proc(pid=2147483648)]), "processes[0].pid' is out of range"),
        (body(processes=[proc(pid=0)]), "out of range"),
        (body(processes=[proc(pid=-5)]), "out of range"),
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
        (body(devices=[{**DEV, "index": "0"}]), "devices[0]: field 'index'"),
        (body(devices=[{**DEV, "memory_total_mib": 2**60}]), "devices[0].memory_total_mib"),
        (body(devices=[{**DEV, "error": 5}]), "devices[0].error"),
        (body(devices={"0": DEV}), "field 'devices' should be list"),
        # An unreadable GPU is not idle, whatever the process list says.
        (
            body(is_idle=True, processes=[], devices=[{"index": 0, "error": "lost"}]),
            "is_idle disagrees",
        ),
        (body(starting=[{"pid": 5, "command": "vllm", "age_s": float("nan")}]), "age_s"),
    ],
)
def test_hostile_values_are_located_errors(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        Snapshot.from_wire(data)
    assert needle in str(exc.value)


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
    back = Snapshot.from_wire(wire)
    assert back == snap
    assert wire["devices"][1]["utilization_pct"] == 0  # a measured 0 stays 0 ...
    assert wire["devices"][0]["utilization_pct"] is None  # ... and unknown stays null
    assert wire["is_idle"] is False


def test_an_unreadable_gpu_makes_an_empty_host_not_idle() -> None:
    snap = Snapshot(0, 81920, False, "nvml", "t", (), devices=(GpuDevice(0, error="lost"),))
    assert snap.is_idle is False
    assert snap.to_wire()["is_idle"] is False


def test_an_old_agent_body_without_devices_still_parses() -> None:
    snap = Snapshot.from_wire(body())
    assert snap.devices == ()
    (dev,) = snap.device_list()
    assert (dev.memory_used_mib, dev.memory_total_mib) == (1000, 81920)
