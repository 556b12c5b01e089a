"""A start's promise in the record: written with its lease (one write), filled in by a
touch only where the record has none, checked like every other field, through both
store paths (the files, and the real agent on loopback), and an agent older than
promises still takes the lease (its records then carry no figures)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.agent import AgentStore
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent import wire
from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.core.promise import Promise
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import UsageError
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

TOKEN = "promise-token"
PROMISE = Promise(memory_mib=80 * 1024, priority=100, devices=(0,), kind="batch", resume=True)
OTHER = Promise(memory_mib=1024, priority=1)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def agent(state_dir: Path) -> Iterator[str]:
    settings = AgentSettings(token=TOKEN, state_dir=str(state_dir))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        yield url


@pytest.fixture(params=["direct", "agent"])
def store(request: pytest.FixtureRequest, state_dir: Path) -> Iterator[Any]:
    if request.param == "direct":
        yield DirectStore(state_dir)
        return
    url = request.getfixturevalue("agent")
    s = AgentStore(url, TOKEN, host_name="sim")
    try:
        yield s
    finally:
        s.close()


def _on_disk(state_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((state_dir / "records" / f"{name}.json").read_text())  # type: ignore[no-any-return]


def test_the_lease_carries_the_promise_and_a_touch_never_overwrites_it(
    store: Any, state_dir: Path
) -> None:
    granted, rec = store.acquire("vllm", holder_here("ensure"), 60.0, PROMISE)
    assert granted and rec.promise == PROMISE
    assert _on_disk(state_dir, "vllm")["promise"] == PROMISE.to_dict()
    # Another config's figures: a touch keeps what the start promised.
    assert store.touch("vllm", promise=OTHER).promise == PROMISE
    # A stop's lease (no promise) keeps it too.
    holder = holder_here("stop")
    store.release("vllm", rec.lease.holder)
    granted, rec = store.acquire("vllm", holder, 60.0)
    assert granted and rec.promise == PROMISE


def test_a_touch_heals_a_record_an_older_release_wrote(store: Any, state_dir: Path) -> None:
    (state_dir / "records").mkdir(parents=True, exist_ok=True)
    old = {"schema": 1, "service": "chat", "phase": "running", "since": 1.0, "last_used": 1.0}
    (state_dir / "records" / "chat.json").write_text(json.dumps(old))
    assert store.get("chat").promise is None
    healed = store.touch("chat", promise=OTHER)
    assert healed.promise == OTHER and healed.phase is Phase.RUNNING
    assert _on_disk(state_dir, "chat")["promise"]["memory_mib"] == 1024


@pytest.mark.parametrize(
    ("promise", "where"),
    [
        ({"memory_mib": "80GiB", "priority": 1}, "promise.memory_mib"),
        ({"memory_mib": 1, "priority": 10**9}, "promise.priority"),
        ({"memory_mib": 1, "priority": 1, "devices": [-1]}, "promise.devices[0]"),
        ({"memory_mib": None, "priority": 1, "devices": []}, "promise.devices"),
        ({"memory_mib": 1, "priority": 1, "devices": [0, 0]}, "promise.devices"),
        ({"memory_mib": 1, "priority": 1, "yield_after_s": -1}, "promise.yield_after_s"),
        ({"memory_mib": 1, "priority": 1, "kind": "daemon"}, "promise.kind"),
        ({"memory_mib": 1, "priority": 1, "resume": "yes"}, "promise.resume"),
        ({"priority": 1}, "promise.memory_mib"),
        ({"memory_mib": 1, "priority": 1, "extra": 1}, "promise.extra"),
    ],
)
def test_the_agent_refuses_a_bad_promise_naming_the_field(
    agent: str, promise: dict[str, Any], where: str
) -> None:
    holder = holder_here("ensure").to_dict()
    r = httpx.post(
        f"{agent}/records/vllm/lease",
        json={"holder": holder, "ttl_s": 60, "promise": promise},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400, r.text
    assert where in r.json()["error"], r.json()


def test_a_record_file_with_a_bad_promise_is_set_aside(state_dir: Path) -> None:
    (state_dir / "records").mkdir(parents=True)
    bad = {
        "schema": 1,
        "service": "vllm",
        "phase": "running",
        "since": 1.0,
        "promise": {"memory_mib": 1e308, "priority": 1},
    }
    (state_dir / "records" / "vllm.json").write_text(json.dumps(bad))
    store = DirectStore(state_dir)
    rec = store.get("vllm")
    assert rec.promise is None and rec.phase is Phase.RUNNING  # the sound fields stay
    (aside,) = store.set_aside()
    assert "promise" in aside.why


def test_an_agent_older_than_promises_still_grants_the_lease(
    agent: str, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def old_lease_request(data: dict[str, Any]) -> dict[str, Any]:
        return wire.obj(data, "", {"holder": wire.holder, "ttl_s": wire.ttl}, required=("holder",))

    def old_touch_request(data: dict[str, Any]) -> dict[str, Any]:
        return wire.obj(data, "", {"ready": wire.boolean})

    monkeypatch.setattr(wire, "lease_request", old_lease_request)
    monkeypatch.setattr(wire, "touch_request", old_touch_request)
    s = AgentStore(agent, TOKEN, host_name="sim")
    try:
        granted, rec = s.acquire("vllm", holder_here("ensure"), 60.0, PROMISE)
        assert granted and rec.promise is None
        assert s.touch("vllm", promise=PROMISE).promise is None
    finally:
        s.close()
    # Anything else the older agent refuses is still an error.
    monkeypatch.undo()
    s = AgentStore(agent, TOKEN, host_name="sim")
    try:
        with pytest.raises(UsageError):
            bogus = RecordUpdate(phase="bogus")  # type: ignore[arg-type]  # unchecked, as sent
            s.update("vllm", "nobody-holds-this", bogus)
    finally:
        s.close()


def test_a_config_promises_its_own_figures_and_takes_a_records_back() -> None:
    from gpuctl.config import ServiceConfig

    svc = ServiceConfig(
        "vllm", "dgx", memory_mib=81920, priority=100, devices=(1,), kind="batch", resume=True
    )
    p = svc.promise()
    assert p == Promise(
        81920, 100, (1,), "batch", True, svc.health_timeout_s, yield_after_s=svc.yield_after_s
    )
    other = svc.with_promise(OTHER)
    assert (other.memory_mib, other.priority, other.devices, other.kind) == (
        1024,
        1,
        None,
        "server",
    )
    assert other.launcher == svc.launcher and other.name == "vllm"  # the rest is the config's
