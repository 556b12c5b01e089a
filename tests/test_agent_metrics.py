"""``/metrics`` as a dashboard reads it: parsed by prometheus_client from the real agent.

Base units (bytes), GPUs labelled ``gpu``/``uuid``/``model``, free memory, temperature
and power where known, memory per service with bounded labels, a start histogram that
never goes down, and ``gpuctl_service_phase`` as a state set covering every service with a record.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import GpuDevice, GpuProcess, ProbeReading
from tests.agent_helpers import FakeProbe, serve_in_thread

TOKEN = "metrics-token"
MIB = 2**20
UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-66666666-7777-8888-9999-000000000000"
SERVER = GpuProcess(pid=4242, command="vllm serve big --api-key sk-zzz", memory_mib=70_000, gpu=0)
# Another process no record names, on the same GPU: it sums with FOREIGN.
FOREIGN2 = GpuProcess(pid=5252, command="python eval.py", memory_mib=1_000, gpu=1)
FOREIGN = GpuProcess(pid=5151, command="python train.py", memory_mib=9_000, gpu=1)
LOADING = GpuProcess(pid=6161, command="vllm serve small", memory_mib=0, gpu=0, on_gpu=False)


def reading() -> ProbeReading:
    return ProbeReading.of_devices(
        "fake",
        [SERVER, FOREIGN, FOREIGN2, LOADING],
        [
            GpuDevice(
                0,
                70_500,
                81_559,
                name="NVIDIA H100 80GB HBM3",
                uuid=UUID0,
                utilization_pct=87,
                temperature_c=61,
                power_w=312.5,
            ),
            GpuDevice(1, 10_000, 81_559, name="NVIDIA H100 80GB HBM3", uuid=UUID1),
            GpuDevice(2, error="GPU is lost"),
        ],
    )


@pytest.fixture
def families(tmp_path: Path) -> Iterator[dict[str, Any]]:
    state = tmp_path / "state"
    store = DirectStore(state)
    h = holder_here("test")
    assert store.acquire("big", h, 60)[0]
    store.release(
        "big",
        h.id,
        RecordUpdate.from_wire({"phase": "running", "handle": {"kind": "process", "pid": 4242}}),
    )
    store.touch("idle-one")  # a stopped service: still one sample per phase
    app = create_app(AgentSettings(token=TOKEN, state_dir=str(state)), FakeProbe(reading()))
    with serve_in_thread(app) as url:
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    yield {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(families: dict[str, Any], name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for s in families[name].samples]


def test_gpu_memory_in_bytes_per_labelled_gpu(families: dict[str, Any]) -> None:
    model = "NVIDIA H100 80GB HBM3"
    used = samples(families, "gpuctl_gpu_memory_used_bytes")
    assert used == [
        ({"gpu": "0", "uuid": UUID0, "model": model}, 70_500 * MIB),
        ({"gpu": "1", "uuid": UUID1, "model": model}, 10_000 * MIB),
    ]
    total = samples(families, "gpuctl_gpu_memory_total_bytes")
    assert [v for _, v in total] == [81_559 * MIB, 81_559 * MIB]
    # The lost GPU: down, and no memory sample (unknown is not free).
    up = {labels["gpu"]: v for labels, v in samples(families, "gpuctl_gpu_up")}
    assert up == {"0": 1, "1": 1, "2": 0}
    assert samples(families, "gpuctl_gpu_utilization_ratio") == [
        ({"gpu": "0", "uuid": UUID0, "model": model}, 0.87)
    ]
    for name in families:
        assert not name.endswith("_mib"), name  # renamed outright, no aliases


def test_free_memory_temperature_and_power_where_known(families: dict[str, Any]) -> None:
    """What a GPU dashboard expects besides used and total; a figure the probe did not
    give (GPU 1's temperature and power, the lost GPU's everything) has no sample."""
    model = "NVIDIA H100 80GB HBM3"
    assert samples(families, "gpuctl_gpu_memory_free_bytes") == [
        ({"gpu": "0", "uuid": UUID0, "model": model}, (81_559 - 70_500) * MIB),
        ({"gpu": "1", "uuid": UUID1, "model": model}, (81_559 - 10_000) * MIB),
    ]
    assert samples(families, "gpuctl_gpu_temperature_celsius") == [
        ({"gpu": "0", "uuid": UUID0, "model": model}, 61)
    ]
    assert samples(families, "gpuctl_gpu_power_watts") == [
        ({"gpu": "0", "uuid": UUID0, "model": model}, 312.5)
    ]


def test_process_memory_is_per_service_with_bounded_labels(families: dict[str, Any]) -> None:
    """Summed per service and GPU: a pid label would open a series with every start
    (per-process detail is /status's)."""
    procs = samples(families, "gpuctl_process_memory_bytes")
    assert procs == [
        ({"gpu": "0", "service": "big"}, 70_000 * MIB),
        ({"gpu": "1", "service": ""}, 10_000 * MIB),
    ]  # the loading server (on_gpu false) holds nothing
    for labels, _ in procs:
        assert set(labels) == {"gpu", "service"}  # no pid, no command line
    assert samples(families, "gpuctl_gpu_processes") == [({}, 3)]


def test_service_phase_is_a_state_set(families: dict[str, Any]) -> None:
    phases = samples(families, "gpuctl_service_phase")
    for service, current in (("big", "running"), ("idle-one", "stopped")):
        mine = {labels["phase"]: v for labels, v in phases if labels["service"] == service}
        assert set(mine) == {p.value for p in Phase}
        assert [p for p, v in mine.items() if v == 1] == [current]
        assert sum(mine.values()) == 1


def test_store_requests_share_one_label(tmp_path: Path) -> None:
    """Requests per endpoint: the store's paths carry service names, so they count under
    one label, or every service name would become a time series."""
    app = create_app(
        AgentSettings(token=TOKEN, state_dir=str(tmp_path / "state")), FakeProbe(reading())
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve_in_thread(app) as url:
        for name in ("a", "b", "c"):
            httpx.get(f"{url}/records/{name}", headers=auth)
        httpx.get(f"{url}/nope", headers=auth)
        text = httpx.get(f"{url}/metrics", headers=auth).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {s.labels["path"]: s.value for s in families["gpuctl_agent_requests"].samples}
    assert counts["/records"] == 3
    assert counts["other"] == 1


def test_start_histogram_never_goes_down(tmp_path: Path) -> None:
    """Over more starts than a record keeps, ``_count`` and ``_sum`` only grow, and the
    buckets stay a valid histogram (cumulative, ``+Inf`` equal to the count)."""
    state = tmp_path / "state"
    store = DirectStore(state)
    h = holder_here("test")
    app = create_app(AgentSettings(token=TOKEN, state_dir=str(state)), FakeProbe(reading()))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[tuple[float, float]] = []
    durations = [float(3 + 7 * i) for i in range(14)]  # 3 s .. 94 s: several buckets
    with serve_in_thread(app) as url:
        for i, d in enumerate(durations):
            assert store.acquire("big", h, 60)[0]
            attempt = {
                "started": 1000.0 + 100 * i,
                "ended": 1000.0 + 100 * i + d,
                "duration_s": d,
                "launcher": "process",
                "outcome": "ready",
            }
            store.release("big", h.id, RecordUpdate.from_wire({"attempt": attempt}))
            text = httpx.get(f"{url}/metrics", headers=auth).text
            family = {f.name: f for f in text_string_to_metric_families(text)}[
                "gpuctl_start_duration_seconds"
            ]
            assert family.type == "histogram"
            mine = [s for s in family.samples if s.labels["service"] == "big"]
            count = next(s.value for s in mine if s.name.endswith("_count"))
            total = next(s.value for s in mine if s.name.endswith("_sum"))
            buckets = [s.value for s in mine if s.name.endswith("_bucket")]
            assert buckets == sorted(buckets)
            assert buckets[-1] == count
            seen.append((count, total))
    assert [c for c, _ in seen] == list(range(1, len(durations) + 1))
    assert [t for _, t in seen] == [sum(durations[: i + 1]) for i in range(len(durations))]
