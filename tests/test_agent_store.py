"""The agent's state-store surface beyond the store itself: /openapi.json and /metrics.

The store's semantics through the agent are in ``test_store.py``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters import store as store_module
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentApp, AgentSettings, create_app
from gpuctl.agent.metrics import render_metrics
from gpuctl.agent.openapi import SERVICE_NAME_PATTERN, openapi_document
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import HostIdentity
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

TOKEN = "agent-store-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RECORD_PATHS = {
    "/records": {"get"},
    "/records/{service}": {"get", "patch"},
    "/records/{service}/lease": {"post"},
    "/records/{service}/lease/renew": {"post"},
    "/records/{service}/lease/release": {"post"},
    "/records/{service}/touch": {"post"},
    "/records/{service}/inflight": {"post"},
    "/records/{service}/inflight/renew": {"post"},
    "/records/{service}/inflight/end": {"post"},
    "/records/{service}/stop": {"post"},
    "/records/_inflight": {"get"},
    "/records/_voided": {"get"},
    "/records/_queue": {"get", "post"},
    "/records/_queue/leave": {"post"},
}
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def agent(state_dir: Path) -> Iterator[str]:
    settings = AgentSettings(token=TOKEN, state_dir=str(state_dir))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        yield url


def metric_lines(url: str) -> list[str]:
    r = httpx.get(f"{url}/metrics", headers=AUTH)
    assert r.status_code == 200
    return r.text.splitlines()


def sample(lines: list[str], prefix: str) -> float:
    (line,) = [x for x in lines if x.startswith(prefix + " ")]
    return float(line.rsplit(" ", 1)[1])


# --------------------------------------------------------------------------- /openapi.json


def test_openapi_lists_the_records_endpoints(agent: str) -> None:
    doc = httpx.get(f"{agent}/openapi.json").json()
    for path, methods in RECORD_PATHS.items():
        assert path in doc["paths"], path
        item = doc["paths"][path]
        assert set(item) & HTTP_METHODS == methods, path
        for method in methods:
            op = item[method]
            assert op["summary"]
            assert "security" not in op  # bearer auth, like every endpoint but two
            assert "200" in op["responses"]
            assert "401" in op["responses"]
        if "{service}" in path:
            (param,) = item["parameters"]
            assert param["in"] == "path"
            assert param["required"] is True
            assert param["schema"]["pattern"] == SERVICE_NAME_PATTERN
    # every path the agent serves is documented, and nothing else
    app = create_app(AgentSettings(), FakeProbe())
    assert isinstance(app, AgentApp)
    assert set(doc["paths"]) == set(app.router.routes) | set(RECORD_PATHS)
    assert "lease" in doc["paths"]["/metrics"]["get"]["summary"]


def test_openapi_request_bodies_and_conflicts() -> None:
    doc = openapi_document()
    paths = doc["paths"]

    def body_ref(path: str, method: str) -> str:
        ref: str = paths[path][method]["requestBody"]["content"]["application/json"]["schema"][
            "$ref"
        ]
        return ref.rsplit("/", 1)[1]

    assert body_ref("/records/{service}", "patch") == "HolderUpdate"
    assert body_ref("/records/{service}/lease", "post") == "LeaseRequest"
    assert body_ref("/records/{service}/lease/renew", "post") == "RenewRequest"
    assert body_ref("/records/{service}/lease/release", "post") == "ReleaseRequest"
    assert "409" in paths["/records/{service}"]["patch"]["responses"]
    assert "409" in paths["/records/{service}/lease/renew"]["post"]["responses"]
    schemas = doc["components"]["schemas"]
    assert schemas["Phase"]["enum"] == [p.value for p in Phase]
    assert set(schemas["RecordUpdate"]["properties"]) == {
        "phase",
        "handle",
        "attempt",
        "failure",
        "touch",
        "start_nonce",
        "health",
        "runs_on",
    }
    assert set(schemas["Holder"]["properties"]) == set(holder_here("x").to_dict())
    assert schemas["LeaseRequest"]["properties"]["holder"] == {
        "$ref": "#/components/schemas/Holder"
    }


def test_openapi_refs_resolve() -> None:
    doc = openapi_document()
    text = json.dumps(doc)
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([A-Za-z]+)"', text))
    assert refs
    assert refs <= set(doc["components"]["schemas"])
    assert {"Record", "Lease", "Failure", "Holder", "RecordUpdate"} <= refs


def test_every_operation_has_a_unique_operation_id() -> None:
    """Generated clients name their calls by it: none may be missing or shared."""
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    ids = [
        op.get("operationId")
        for item in openapi_document()["paths"].values()
        for method, op in item.items()
        if method in methods
    ]
    assert len(ids) == 31
    assert None not in ids
    assert len(ids) == len(set(ids)), sorted(ids)


def test_service_name_pattern_matches_the_store() -> None:
    assert store_module._NAME.pattern == SERVICE_NAME_PATTERN


def test_real_answers_match_their_schemas(agent: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    doc = httpx.get(f"{agent}/openapi.json").json()

    def check(instance: Any, name: str) -> None:
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": doc["components"],
            "$ref": f"#/components/schemas/{name}",
        }
        jsonschema.Draft202012Validator(schema).validate(instance)

    h = holder_here("test")
    lease_req = {"holder": h.to_dict(), "ttl_s": 60}
    check(lease_req, "LeaseRequest")
    r = httpx.post(f"{agent}/records/vllm/lease", headers=AUTH, json=lease_req)
    assert r.status_code == 200
    check(r.json(), "LeaseGrant")
    patch = {
        "holder": h.id,
        "update": {"phase": "starting", "handle": {"pid": 1}, "attempt": {"n": 1}, "touch": True},
    }
    check(patch, "HolderUpdate")
    r = httpx.patch(f"{agent}/records/vllm", headers=AUTH, json=patch)
    assert r.status_code == 200
    check(r.json(), "Record")
    assert set(r.json()) == set(doc["components"]["schemas"]["Record"]["required"])
    assert set(r.json()["lease"]) == set(doc["components"]["schemas"]["Lease"]["required"])
    release = {"holder": h.id, "update": {"failure": {"error": "exit 1", "log_tail": ""}}}
    check(release, "ReleaseRequest")
    r = httpx.post(f"{agent}/records/vllm/lease/release", headers=AUTH, json=release)
    check(r.json(), "Record")
    assert set(r.json()["failure"]) == set(doc["components"]["schemas"]["Failure"]["required"])
    check(httpx.get(f"{agent}/records", headers=AUTH).json(), "RecordList")
    check(httpx.post(f"{agent}/records/other/touch", headers=AUTH).json(), "Record")
    r = httpx.post(
        f"{agent}/records/vllm/lease/renew", headers=AUTH, json={"holder": "x", "ttl_s": 5}
    )
    assert r.status_code == 409
    check(r.json(), "StoreError")
    with pytest.raises(jsonschema.ValidationError):
        check({"holder": h.id, "update": {"lease": None}}, "HolderUpdate")


# --------------------------------------------------------------------------- /metrics


def test_metrics_show_phase_lease_and_idle_seconds(agent: str, state_dir: Path) -> None:
    lines = metric_lines(agent)
    assert "gpuctl_store_up 1" in lines
    assert not [x for x in lines if x.startswith("gpuctl_service_phase{")]

    store = DirectStore(state_dir)
    store.touch("vllm")
    h = holder_here("test")
    assert store.acquire("vllm", h, 600)[0]
    store.update("vllm", h.id, RecordUpdate.from_wire({"phase": "running"}))
    store.acquire("sglang", holder_here("test"), 600)  # never used: no idle sample
    time.sleep(0.05)

    lines = metric_lines(agent)
    assert 'gpuctl_service_phase{service="vllm",phase="running"} 1' in lines
    assert 'gpuctl_service_phase{service="sglang",phase="stopped"} 1' in lines
    # A state set: one sample per phase per service, exactly one of them 1.
    phases = [x for x in lines if x.startswith("gpuctl_service_phase{")]
    assert len(phases) == 2 * len(Phase)
    assert len([x for x in phases if x.endswith(" 1")]) == 2
    assert 'gpuctl_service_phase{service="vllm",phase="stopped"} 0' in lines
    idle = sample(lines, 'gpuctl_service_idle_seconds{service="vllm"}')
    assert 0.05 <= idle < 30
    assert not [x for x in lines if x.startswith('gpuctl_service_idle_seconds{service="sglang"}')]
    assert 'gpuctl_service_lease_held{service="vllm"} 1' in lines
    assert 'gpuctl_service_lease_held{service="sglang"} 1' in lines
    assert "# TYPE gpuctl_service_phase gauge" in lines
    assert "# TYPE gpuctl_service_idle_seconds gauge" in lines

    # released and touched again: no lease, idle from the new touch
    store.release("vllm", h.id, RecordUpdate.from_wire({"phase": "sleeping"}))
    store.touch("vllm")
    lines = metric_lines(agent)
    assert 'gpuctl_service_phase{service="vllm",phase="sleeping"} 1' in lines
    assert 'gpuctl_service_phase{service="vllm",phase="running"} 0' in lines
    assert 'gpuctl_service_lease_held{service="vllm"} 0' in lines
    assert sample(lines, 'gpuctl_service_idle_seconds{service="vllm"}') < idle + 5


def test_metrics_through_the_agent_store_endpoints(agent: str) -> None:
    httpx.post(f"{agent}/records/vllm/touch", headers=AUTH)
    lines = metric_lines(agent)
    assert 'gpuctl_service_phase{service="vllm",phase="stopped"} 1' in lines
    assert 'gpuctl_service_lease_held{service="vllm"} 0' in lines
    assert sample(lines, 'gpuctl_service_idle_seconds{service="vllm"}') >= 0


def test_metrics_without_a_state_dir_have_no_service_samples() -> None:
    with serve_in_thread(create_app(AgentSettings(token=TOKEN), FakeProbe())) as url:
        lines = metric_lines(url)
    assert not [x for x in lines if x.startswith(("gpuctl_service_", "gpuctl_store_up"))]
    assert "gpuctl_probe_up 1" in lines


def test_metrics_when_the_store_is_broken(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    settings = AgentSettings(token=TOKEN, state_dir=str(tmp_path / "file" / "x" / "state"))
    with serve_in_thread(create_app(settings, FakeProbe())) as url:
        lines = metric_lines(url)
        status = httpx.get(f"{url}/status", headers=AUTH)
    # a records dir that cannot exist lists as empty; the metrics still answer
    assert "gpuctl_store_up 1" in lines
    assert not [x for x in lines if x.startswith("gpuctl_service_")]
    assert "gpuctl_probe_up 1" in lines
    assert status.status_code == 200


def test_metrics_report_a_store_that_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpuctl.errors import StoreError

    app = create_app(AgentSettings(token=TOKEN, state_dir=str(tmp_path)), FakeProbe())
    assert isinstance(app, AgentApp)
    assert app.store_api.store is not None

    def broken() -> list[Record]:
        raise StoreError("the lock of 'vllm' is held for more than 10s")

    monkeypatch.setattr(app.store_api.store, "records", broken)
    with serve_in_thread(app) as url:
        lines = metric_lines(url)
    assert "gpuctl_store_up 0" in lines
    assert not [x for x in lines if x.startswith("gpuctl_service_")]
    assert "gpuctl_probe_up 1" in lines


def test_metrics_parse_as_prometheus_text(agent: str, state_dir: Path) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    DirectStore(state_dir).touch("vllm")
    text = httpx.get(f"{agent}/metrics", headers=AUTH).text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    current = [s for s in families["gpuctl_service_phase"].samples if s.value == 1]
    assert [s.labels for s in current] == [{"service": "vllm", "phase": "stopped"}]
    assert families["gpuctl_service_idle_seconds"].samples[0].value >= 0


def test_render_metrics_idle_seconds_and_numbers() -> None:
    records = [
        Record("a", phase=Phase.RUNNING, last_used=1_000.0),
        Record("b", phase=Phase.FAILED),
        Record("c", last_used=2_000.0),  # a clock step back: never negative
    ]
    text = render_metrics(
        reading_of(used=1_128_000, total=1_153_434),
        probe_up=True,
        probe_name="fake",
        probe_errors_total=0,
        requests_total={},
        host=HostIdentity("h", "b"),
        gpu_memory_mib=None,
        records=records,
        store_up=True,
        now=1_234.5678,
    )
    lines = text.splitlines()
    assert 'gpuctl_service_idle_seconds{service="a"} 234.568' in lines
    assert 'gpuctl_service_idle_seconds{service="c"} 0' in lines
    assert not [x for x in lines if 'idle_seconds{service="b"}' in x]
    assert 'gpuctl_service_phase{service="b",phase="failed"} 1' in lines
    assert 'gpuctl_service_lease_held{service="a"} 0' in lines
    # large figures in full, not 1.18e+12
    gpu0 = 'gpu="0",uuid="",model=""'
    assert f"gpuctl_gpu_memory_used_bytes{{{gpu0}}} {1_128_000 * 2**20}" in lines
    assert f"gpuctl_gpu_memory_total_bytes{{{gpu0}}} {1_153_434 * 2**20}" in lines


def test_status_is_unchanged_by_the_store(agent: str, state_dir: Path) -> None:
    DirectStore(state_dir).touch("vllm")
    status = httpx.get(f"{agent}/status", headers=AUTH).json()
    assert "records" not in status
    assert status["state_dir"] == str(state_dir)


def test_the_openapi_document_says_what_the_store_schema_checks() -> None:
    """The agent documents the records with the store's own tables: the two must not drift
    (a client built from /openapi.json would send what the store refuses)."""
    from gpuctl.adapters.store.codec import (
        FAILURE_FIELDS,
        HOLDER_FIELDS,
        LEASE_FIELDS,
        PID_MAX,
        RECORD_FIELDS,
    )
    from gpuctl.adapters.store.schema import REQUIRED

    schemas = openapi_document()["components"]["schemas"]

    def required(table: dict[str, Any]) -> set[str]:
        return {k for k, (_, default) in table.items() if default is REQUIRED}

    holder = schemas["Holder"]
    assert set(holder["properties"]) == set(HOLDER_FIELDS)
    assert set(holder["required"]) == required(HOLDER_FIELDS)
    assert holder["properties"]["pid"]["minimum"] == 1
    assert holder["properties"]["pid"]["maximum"] == PID_MAX
    assert set(schemas["Lease"]["properties"]) == set(LEASE_FIELDS)
    assert set(schemas["Failure"]["properties"]) == set(FAILURE_FIELDS)
    # every record the store writes carries every field (null when unset)
    assert set(schemas["Record"]["properties"]) == set(RECORD_FIELDS)
    assert set(schemas["Record"]["required"]) == set(RECORD_FIELDS)
    assert set(Record("x").to_dict()) == set(RECORD_FIELDS)
