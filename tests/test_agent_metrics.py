"""``/metrics`` as a dashboard reads it: parsed by prometheus_client from the real agent.

Base units (bytes), GPUs labelled ``gpu``/``uuid``/``model`` as DCGM and
nvidia_gpu_exporter label theirs, per-process memory with its service and bounded
labels, and ``gpuctl_service_phase`` as a state set covering every service with a record.
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
FOREIGN = GpuProcess(pid=5151, command="python train.py", memory_mib=9_000, gpu=1)
LOADING = GpuProcess(pid=6161, command="vllm serve small", memory_mib=0, gpu=0, on_gpu=False)


def reading() -> ProbeReading:
    return ProbeReading.of_devices(
        "fake",
        [SERVER, FOREIGN, LOADING],
        [
            GpuDevice(
                0, 70_500, 81_559, name="NVIDIA H100 80GB HBM3", uuid=UUID0, utilization_pct=87
            ),
            GpuDevice(1, 9_000, 81_559, name="NVIDIA H100 80GB HBM3", uuid=UUID1),
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
        ({"gpu": "1", "uuid": UUID1, "model": model}, 9_000 * MIB),
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


def test_process_memory_carries_its_service_and_bounded_labels(families: dict[str, Any]) -> None:
    procs = samples(families, "gpuctl_process_memory_bytes")
    assert procs == [
        ({"gpu": "0", "pid": "4242", "service": "big"}, 70_000 * MIB),
        ({"gpu": "1", "pid": "5151", "service": ""}, 9_000 * MIB),
    ]  # the loading server (on_gpu false) holds nothing
    for labels, _ in procs:
        assert set(labels) == {"gpu", "pid", "service"}  # no command line
    assert samples(families, "gpuctl_gpu_processes") == [({}, 2)]


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
