"""The race fixes of ``ensure`` and ``stop`` as pure units: fakes and a fake clock (no
real time), the real store on tmp_path. The same cases run end to end in
tests/test_ensure_races.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store import holder_here
from gpuctl.core.record import ADMISSION_TTL_MAX_S, Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import GpuProcess, StartingProcess
from gpuctl.flows import service_ops
from gpuctl.flows.admission import ADMISSION
from gpuctl.flows.deps import EnsureRequest
from gpuctl.flows.ensure.rounds import ensure
from gpuctl.flows.op_results import Outcome
from gpuctl.flows.ports import Probe
from tests.flow_fakes import GIB, Agent, World, config, world

TWO_BIG = """
[hosts.dgx]
agent = "http://127.0.0.1:9"

[services.vllm]
host = "dgx"
launcher = "process"
command = "vllm serve m"
health = "http://127.0.0.1:8000/health"
match = ["vllm"]
memory = "80GiB"
health_timeout = "60s"

[services.chat]
host = "dgx"
launcher = "process"
command = "chat-server"
health = "http://127.0.0.1:8001/health"
match = ["chat-server"]
memory = "80GiB"
health_timeout = "60s"
"""


@pytest.fixture
def w(tmp_path: Path) -> World:
    return replace(world(tmp_path), config=config(tmp_path, TWO_BIG))


def orphan(w: World, service: str = "vllm") -> str:
    """Leave the record a killed caller leaves: starting, its nonce, no handle, its lease
    void (the store drops it once the holder is gone)."""
    h = holder_here("ensure")
    granted, _ = w.store.acquire(service, h, 600)
    assert granted
    nonce = "0123456789abcdef"
    w.store.update(
        service,
        h.id,
        RecordUpdate.from_wire({"phase": "starting", "start_nonce": nonce, "handle": None}),
    )
    w.store.release(service, h.id)  # as if void: no lease, record left starting
    return nonce


def test_the_nonce_is_recorded_before_the_spawn_and_given_to_the_launcher(w: World) -> None:
    seen: list[str | None] = []
    w.launcher.on_start = lambda: seen.append(w.store.get("vllm").start_nonce)
    r = ensure(w.deps(), EnsureRequest(wait=False))
    assert r.outcome is Outcome.STARTED
    assert w.launcher.nonces == seen and seen[0] is not None and len(seen[0]) == 16


def test_an_orphaned_start_counts_at_its_budget_for_a_rival(w: World) -> None:
    orphan(w, "vllm")
    r = ensure(w.deps("chat"), EnsureRequest(wait=False))
    assert r.outcome is Outcome.BUSY, r.reason
    assert w.launcher.started == []


def test_an_orphaned_start_stops_counting_after_its_health_timeout(w: World) -> None:
    orphan(w, "vllm")
    w.clock.t += 61
    r = ensure(w.deps("chat"), EnsureRequest(wait=False))
    assert r.outcome is Outcome.STARTED
    assert w.launcher.started == ["chat"]


def test_the_same_service_finds_its_orphaned_server_not_a_second(w: World) -> None:
    nonce = orphan(w, "vllm")
    w.launcher.found = Handle(kind="process", pid=777, pid_start=5.0)
    w.health.ready_after(3)
    r = ensure(w.deps())
    assert r.outcome is Outcome.READY and r.launched is False, r.reason
    assert w.launcher.started == [] and w.launcher.finds == [nonce]
    rec = w.store.get("vllm")
    assert rec.phase is Phase.RUNNING and rec.handle and rec.handle["pid"] == 777


def test_an_orphaned_start_with_no_server_is_started_again(w: World) -> None:
    nonce = orphan(w, "vllm")
    w.launcher.found = None
    r = ensure(w.deps(), EnsureRequest(wait=False))
    assert r.outcome is Outcome.STARTED and r.launched is True
    assert w.launcher.finds == [nonce] and w.launcher.started == ["vllm"]
    assert w.store.get("vllm").start_nonce != nonce


def test_timeout_bounds_the_admission_wait_and_nothing_launches_late(w: World) -> None:
    # Held for its whole term (10 s), longer than the caller's 5 s deadline.
    w.store.acquire(ADMISSION, holder_here("someone-else"), ADMISSION_TTL_MAX_S)
    t0 = w.clock.t
    r = ensure(w.deps(), EnsureRequest(timeout_s=5))
    assert r.outcome is Outcome.TIMEOUT and r.launched is False
    assert "admission" in r.reason
    assert w.launcher.started == []
    assert w.clock.t - t0 <= 5.1


def test_stop_acts_on_a_fresh_reading_and_never_reports_a_dead_pid(w: World) -> None:
    stale = Agent(processes=[GpuProcess(pid=31337, command="vllm serve m", memory_mib=8 * GIB)])
    fresh = Agent()
    deps = w.deps()
    deps.probe = Probe(stale.read, fresh.read)
    r = service_ops.stop(deps)
    assert r.stopped == [] and fresh.asked and not stale.asked
    # Even a stale reading (no fresh one to be had) is checked against the process.
    deps = w.deps()
    deps.probe = Probe(stale.read)
    w.launcher.dead_pids.add(31337)
    r = service_ops.stop(deps)
    assert r.stopped == [] and w.launcher.stopped == []


def test_stop_signals_a_keyword_match_with_the_start_time_the_reading_saw(w: World) -> None:
    orphan(w, "vllm")
    agent = Agent()
    agent.starting = [StartingProcess(pid=4321, command="vllm serve m", age_s=10.0)]
    deps = w.deps()
    deps.probe = Probe(agent.read)
    r = service_ops.stop(deps)
    assert r.stopped == ["pid 4321"]
    (h,) = w.launcher.stopped
    assert h.pid == 4321 and h.pid_start is not None
    assert abs(h.pid_start - (agent.taken_epoch - 10.0)) < 0.01


def test_touch_completes_starting_only_when_the_server_answers(w: World) -> None:
    ensure(w.deps(), EnsureRequest(wait=False))
    service_ops.touch(w.deps())
    assert w.store.get("vllm").phase is Phase.STARTING
    w.health.ready_after(0)
    service_ops.touch(w.deps())
    assert w.store.get("vllm").phase is Phase.RUNNING


def test_status_calls_an_orphaned_start_loading_until_its_health_timeout(w: World) -> None:
    """`status` never calls a service free while a start of it may be loading unseen."""
    from gpuctl.core.decision import Decision, Health
    from gpuctl.flows.look import Observation, decide

    orphan(w, "vllm")
    svc = w.config.service("vllm")
    others = w.config.services_on("dgx")
    seen = Observation({r.service: r for r in w.store.records()}, Agent().read([], []))
    refused = Health("refused", "connection refused")
    v = decide(svc, refused, seen, others=others, now=w.clock.t)
    assert v.decision is Decision.LOADING, v.reason
    later = decide(svc, refused, seen, others=others, now=w.clock.t + 61)
    assert later.decision is Decision.IDLE


def test_progress_memory_counts_what_the_agent_names_as_the_services() -> None:
    """The wait's memory figure: the server's pid, its keyword, and the processes the
    agent names as the service's (a vLLM's engine core, a child of the server)."""
    from gpuctl.core.snapshot import GpuProcess, Snapshot
    from gpuctl.flows.wait import own_memory

    snap = Snapshot(
        50 * 1024,
        80 * 1024,
        False,
        "sim",
        "t",
        (
            GpuProcess(10, "vllm serve --port 8000", 1024),  # the API server (recorded)
            GpuProcess(11, "VLLM::EngineCore", 40 * 1024),  # its child
            GpuProcess(12, "python other.py", 9 * 1024),  # someone else
        ),
        servers=((10, "chat"), (11, "chat"), (12, "other")),
    )
    svc = type("Svc", (), {"name": "chat", "keywords": ("nomatch",), "default_match": False})()
    assert own_memory(snap, svc, 10) == 41 * 1024  # type: ignore[arg-type]
    assert own_memory(None, svc) is None  # type: ignore[arg-type]
