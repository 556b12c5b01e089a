"""The reclaim flow on a real store with fake servers: the races of issue 8 §5, counted.

The fakes stand for what is remote (the snapshot, the server's metrics, the launcher);
the store is the real one on disk, since the races are decided by its locks. A hook
runs "another process's" touch or ``in_use`` at the exact moment under test: before
reclaim takes the service's lease, or after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.idle import Action
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import HostIdentity, Snapshot
from gpuctl.flows.reclaim import ReclaimDeps, ReclaimHost, reclaim
from gpuctl.render.reclaim_view import reclaim_lines, reclaim_to_json
from tests.flow_fakes import Elsewhere

HERE = HostIdentity("gpu-box", "boot-1")


@dataclass
class FakeLauncher:
    kind: str = "process"
    stopped: list[Handle] = field(default_factory=list)

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        self.stopped.append(handle)

    def close(self) -> None:
        pass


@dataclass
class World:
    store: DirectStore
    clock: list[float]
    launcher: FakeLauncher = field(default_factory=FakeLauncher)
    metric_calls: int = 0
    on_metrics: list[Callable[[int], None]] = field(default_factory=list)
    snapshot_host: HostIdentity = HERE

    def deps(self, *services: ServiceConfig, agent: str | None = None) -> ReclaimDeps:
        host = HostConfig(name="box", agent=agent)
        conf = Config(None, hosts={"box": host}, services={s.name: s for s in services})

        def in_flight(svc: ServiceConfig) -> int | None:
            self.metric_calls += 1
            for hook in self.on_metrics:
                hook(self.metric_calls)
            return 0

        def snapshot(kws: Any, pids: Any) -> Snapshot:
            return Snapshot(0, 131072, False, "sim", "t", (), host=self.snapshot_host)

        rh = ReclaimHost(
            host=host,
            store=self.store,
            read_snapshot=snapshot,
            server_in_flight=in_flight,
            make_launcher=lambda svc, snap: self.launcher,  # type: ignore[arg-type,return-value]
            sleep_server=lambda svc: None,
        )
        return ReclaimDeps(
            config=conf, hosts=[rh], machine=Elsewhere(HERE), clock=lambda: self.clock[0]
        )


@pytest.fixture
def world(tmp_path: Path) -> World:
    clock = [1_000_000.0]
    return World(DirectStore(tmp_path / "state", clock=lambda: clock[0]), clock)


SVC = ServiceConfig(
    name="llm", host="box", launcher="process", health="http://127.0.0.1:9/health",
    idle_timeout_s=1800.0,
)  # fmt: skip


def running(world: World, name: str = "llm", *, handle: bool = True, idle_s: float = 3600) -> None:
    """A record as ensure leaves it: running, last used ``idle_s`` ago."""
    h = holder_here("ensure")
    store = world.store
    world.clock[0] -= idle_s
    store.acquire(name, h, 60)
    update = RecordUpdate(phase=Phase.RUNNING, touch=True)
    if handle:
        handle_value = {"kind": "process", "pid": 999999, "pid_start": 1.0}
        update = RecordUpdate(phase=Phase.RUNNING, touch=True, handle=handle_value)
    store.release(name, h.id, update)
    world.clock[0] += idle_s


def test_idle_and_managed_is_stopped_by_its_handle(world: World) -> None:
    running(world)
    report = reclaim(world.deps(SVC))
    assert [h.pid for h in world.launcher.stopped] == [999999]
    assert reclaim_lines(report) == ["stopped llm on box: idle 1h00m > 30m"]
    rec = world.store.get("llm")
    assert rec.phase is Phase.STOPPED and rec.handle is None and rec.lease is None
    assert world.store.get("_reclaim").lease is None, "the run lock is given back"


def test_a_running_record_without_a_handle_is_left_alone(world: World) -> None:
    running(world, handle=False)
    report = reclaim(world.deps(SVC))
    assert world.launcher.stopped == []
    assert reclaim_lines(report) == [
        "kept llm on box: its record names no server that gpuctl started: left alone"
    ]


def test_a_process_server_on_another_machine_is_reported_and_skipped(world: World) -> None:
    running(world)
    world.snapshot_host = HostIdentity("dgx", "boot-9")
    report = reclaim(world.deps(SVC, agent="http://dgx:9400"))
    assert world.launcher.stopped == []
    (line,) = reclaim_lines(report)
    assert line.startswith("kept llm on box: a process on dgx: only that machine can stop it")
    assert int(report.exit_code) == 0


def test_dry_run_changes_nothing(world: World) -> None:
    running(world)
    before = world.store.get("llm")
    report = reclaim(world.deps(SVC), dry_run=True)
    assert reclaim_lines(report) == ["would stop llm on box: idle 1h00m > 30m"]
    assert world.launcher.stopped == []
    assert world.store.get("llm") == before
    out = reclaim_to_json(report)
    assert out["dry_run"] is True and out["candidates"][0]["done"] is False


# ---------------------------------------------------------------------------- races


def touch_from_elsewhere(world: World) -> Callable[[], Any]:
    return lambda: world.store.touch("llm")


@pytest.mark.parametrize("when", [1, 2])
def test_touch_racing_reclaim_one_wins_never_both(world: World, when: int) -> None:
    """``when`` 1: the touch lands before reclaim takes the lease (after its first look);
    2: it lands under reclaim's lease. Exactly one of them wins."""
    running(world)
    touched: list[float | None] = []

    def hook(call: int) -> None:
        if call == when:
            world.clock[0] += 1
            touched.append(world.store.touch("llm").last_used)

    world.on_metrics.append(hook)
    reclaim(world.deps(SVC))
    rec = world.store.get("llm")
    touch_won = rec.last_used == world.clock[0]
    reclaim_won = bool(world.launcher.stopped)
    assert touch_won != reclaim_won, (touch_won, reclaim_won)
    assert touch_won is (when == 1)
    # The invariant: nothing stopped within its idle timeout of a (winning) touch.
    if reclaim_won:
        assert rec.last_used is not None and world.clock[0] - rec.last_used > SVC.idle_timeout_s  # type: ignore[operator]


@pytest.mark.parametrize("when", [1, 2])
def test_a_use_racing_reclaim_is_never_cut(world: World, when: int) -> None:
    """An ``in_use`` holder that begins before reclaim's lease keeps it (it is in use,
    and was just used); one that tries under the lease is refused (and would wait for
    the stop to end)."""
    running(world)
    began: list[bool] = []
    user = holder_here("in_use")

    def hook(call: int) -> None:
        if call == when:
            began.append(world.store.inflight_begin("llm", user, 30)[0])

    world.on_metrics.append(hook)
    report = reclaim(world.deps(SVC))
    (p,) = report.planned
    if when == 1:
        assert began == [True]
        assert world.launcher.stopped == [], "a request in flight is never cut"
        # The use marked it used as it began: under the lease it is no longer idle.
        assert p.candidate.action is Action.KEEP and p.candidate.reason == "idle 0s < 30m"
    else:
        assert began == [False], "no use may begin under a stop's lease"
        assert len(world.launcher.stopped) == 1
        assert world.store.inflight() == {}


def test_reclaim_racing_ensure_never_stops_a_starting_service(world: World) -> None:
    running(world, idle_s=7200)
    starter = holder_here("ensure")
    assert world.store.acquire("llm", starter, 600)[0]
    world.store.update("llm", starter.id, RecordUpdate.from_wire({"phase": Phase.STARTING.value}))
    report = reclaim(world.deps(SVC))
    assert world.launcher.stopped == []
    assert report.planned[0].candidate.action is Action.KEEP
    # The start's lease is untouched.
    lease = world.store.get("llm").lease
    assert lease is not None and lease.id == starter.id


def test_an_ensure_that_takes_the_lease_first_wins(world: World) -> None:
    """ensure's lease lands between reclaim's look and its own acquire: reclaim keeps it."""
    running(world)
    starter = holder_here("ensure")
    world.on_metrics.append(
        lambda call: world.store.acquire("llm", starter, 600) if call == 1 else None
    )
    report = reclaim(world.deps(SVC))
    assert world.launcher.stopped == []
    assert reclaim_lines(report)[0].startswith("kept llm on box: lease held by ensure pid ")


def test_many_services_one_record_list_and_one_snapshot(world: World) -> None:
    services = [
        ServiceConfig(name=f"s{i}", host="box", launcher="process", idle_timeout_s=1800.0,
                      health=f"http://127.0.0.1:{9000 + i}/health")
        for i in range(100)
    ]  # fmt: skip
    for s in services[:3]:
        running(world, s.name)
    calls = {"records": 0, "inflight": 0}
    real_records, real_inflight = world.store.records, world.store.inflight

    def records() -> Any:
        calls["records"] += 1
        return real_records()

    def inflight() -> Any:
        calls["inflight"] += 1
        return real_inflight()

    world.store.records = records  # type: ignore[method-assign]
    world.store.inflight = inflight  # type: ignore[method-assign]
    report = reclaim(world.deps(*services))
    assert len(world.launcher.stopped) == 3
    assert calls["records"] == 1
    assert calls["inflight"] == 1 + 3  # once for the host, once under each stop's lease
    assert world.metric_calls == 3 * 2  # only candidates' metrics: before and under the lease
    assert len(report.planned) == 100
