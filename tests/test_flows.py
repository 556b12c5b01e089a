"""The flows as pure units: fakes for the agent, health, launcher and clock; the real
store on ``tmp_path``. No sockets, no processes, no real sleeps: each test runs in
milliseconds and asserts what the flow did (launches, records, outcomes, exit codes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace

from gpuctl.adapters.machine import ThisMachine
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.decision import Decision, Health
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import GpuProcess
from gpuctl.errors import ExitCode, StoreError
from gpuctl.flows import service_ops
from gpuctl.flows.deps import EnsureRequest, HostDeps, LocksDeps, StatusDeps
from gpuctl.flows.ensure.rounds import ensure
from gpuctl.flows.op_results import Outcome, StartInterrupted
from gpuctl.flows.ports import Tell
from gpuctl.flows.status import status, watch
from tests.flow_fakes import GIB, Agent, Clock, World, config, world


@pytest.fixture
def w(tmp_path: Path) -> World:
    return world(tmp_path)


# ---- ensure


def test_ready_service_is_touched_and_never_launched(w: World) -> None:
    w.health.ready_after(0)
    r = ensure(w.deps())
    assert (r.outcome, r.exit_code, r.launched) == (Outcome.READY, ExitCode.OK, False)
    assert w.launcher.started == []
    assert w.agent.asked == []  # a healthy service costs no agent call
    assert w.store.get("vllm").last_used == w.clock.t


def test_idle_gpu_launches_once_and_waits_through_the_cold_start(w: World) -> None:
    w.health.ready_after(25)  # about 5 s of polls at 0.2 s
    r = ensure(w.deps())
    assert (r.outcome, r.launched, r.decision) == (Outcome.READY, True, "IDLE")
    assert w.launcher.started == ["vllm"]
    rec = w.store.get("vllm")
    assert rec.phase is Phase.RUNNING
    assert rec.lease is None  # released
    assert rec.handle == {"kind": "process", "pid": 4242, "pid_start": 1.0}
    assert rec.attempts[-1]["outcome"] == "ready"
    assert 3.0 < r.waited_s < 8.0  # the fake clock, advanced by the flow's own sleeps


def test_ensure_asks_for_the_recorded_servers_pids(w: World) -> None:
    holder = holder_here("test")
    w.store.acquire("photos", holder, 60)
    w.store.release(
        "photos",
        holder.id,
        RecordUpdate.from_wire({"handle": {"kind": "process", "pid": 777}, "phase": "running"}),
    )
    w.health.ready_after(1)
    ensure(w.deps())
    keywords, pids = w.agent.asked[0]
    assert keywords == ["vllm", "photo-batch"]  # every service of the host
    assert pids == [777]


def test_busy_names_the_holders_and_hints_what_to_do(w: World) -> None:
    w.agent.processes = [GpuProcess(1, "python train.py", 100 * GIB, user="ana")]
    r = ensure(w.deps())
    assert (r.outcome, r.exit_code) == (Outcome.BUSY, ExitCode.BUSY)
    assert "train.py" in r.reason
    assert r.hint and "gpuctl status" in r.hint
    assert w.launcher.started == []


def test_unreachable_agent_is_unknown_never_a_start(w: World) -> None:
    w.agent.error = "connection refused by http://127.0.0.1:9"
    r = ensure(w.deps())
    assert (r.outcome, r.exit_code) == (Outcome.UNKNOWN, ExitCode.UNKNOWN)
    assert "connection refused" in r.reason
    assert "dgx" in r.hint
    assert w.launcher.started == []


def test_timeout_releases_the_lease_and_says_it_may_still_load(w: World) -> None:
    r = ensure(w.deps(), EnsureRequest(timeout_s=3.0))
    assert (r.outcome, r.exit_code, r.launched) == (Outcome.TIMEOUT, ExitCode.TIMEOUT, True)
    assert "may still be loading" in r.reason
    assert "--timeout" in r.hint
    rec = w.store.get("vllm")
    assert rec.lease is None
    assert rec.attempts[-1]["outcome"] == "timeout"
    assert sum(w.clock.slept) >= 3.0


def test_a_launch_that_exits_once_it_answers_is_ready_not_failed(w: World) -> None:
    # Ollama's loader exits as soon as its model is in: the process is gone by the
    # liveness look, but the health check that follows it answers.
    w.launcher.dies = True
    w.launcher.on_start = lambda: w.health.ready_after(1)  # refused once, then 200
    r = ensure(w.deps())
    assert (r.outcome, r.exit_code, r.launched) == (Outcome.READY, ExitCode.OK, True)
    assert w.store.get("vllm").phase is Phase.RUNNING
    assert w.launcher.started == ["vllm"]


def test_server_that_dies_while_loading_is_failed_with_its_log(w: World) -> None:
    w.launcher.dies = True
    r = ensure(w.deps())
    assert (r.outcome, r.exit_code) == (Outcome.FAILED, ExitCode.FAILED)
    assert "exited while loading" in r.reason
    assert "CUDA out of memory" in r.log_tail
    rec = w.store.get("vllm")
    assert rec.phase is Phase.FAILED
    assert rec.failure is not None and "CUDA" in rec.failure.log_tail
    # and the back-off holds the next caller off, without a launch
    again = ensure(w.deps())
    assert again.outcome is Outcome.FAILED and "next try in" in again.reason
    assert w.launcher.started == ["vllm"]


def test_no_wait_returns_started_with_the_handle(w: World) -> None:
    r = ensure(w.deps(), EnsureRequest(wait=False))
    assert (r.outcome, r.exit_code, r.launched) == (Outcome.STARTED, ExitCode.OK, True)
    assert r.handle == {"kind": "process", "pid": 4242, "pid_start": 1.0}
    assert w.store.get("vllm").lease is None


def test_a_bystander_waits_for_the_lease_holder_and_never_launches(w: World) -> None:
    other = holder_here("someone-else")
    granted, _ = w.store.acquire("vllm", other, 600)
    assert granted
    w.health.ready_after(10)
    r = ensure(w.deps())
    assert (r.outcome, r.launched) == (Outcome.READY, False)
    assert r.decision == "LOADING"
    assert "waited" in r.reason
    assert w.launcher.started == []


def test_a_bystander_goes_round_and_starts_it_when_the_holder_gave_up(w: World) -> None:
    other = holder_here("someone-else")
    w.store.acquire("vllm", other, 600)
    # The holder gives up after a second: its lease goes, nothing runs.
    polls = {"n": 0}
    real = w.health

    def health() -> Health:
        polls["n"] += 1
        if polls["n"] == 8:
            w.store.release("vllm", other.id)
        if w.launcher.started and polls["n"] > 30:
            return Health("ready", "HTTP 200", 200)
        return real()

    w_deps = w.deps()
    w_deps.servers = replace(w_deps.servers, health=health)
    r = ensure(w_deps)
    assert (r.outcome, r.launched) == (Outcome.READY, True)
    assert w.launcher.started == ["vllm"]


def test_ctrl_c_while_waiting_keeps_the_handle_and_frees_the_lease(w: World) -> None:
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    deps = w.deps()
    deps.sleep = interrupt
    with pytest.raises(KeyboardInterrupt):
        ensure(deps)
    rec = w.store.get("vllm")
    assert rec.lease is None
    assert rec.handle is not None and rec.handle["pid"] == 4242
    assert rec.attempts[-1]["outcome"] == "interrupted"


def test_ctrl_c_inside_the_launcher_records_the_attempt_and_keeps_the_nonce(w: World) -> None:
    """Interrupted after its spawn, before the launcher returns the handle: the lease is
    given back with the attempt `interrupted`, and the record keeps `starting` and the
    nonce, by which the next caller finds the server."""

    def interrupt() -> None:
        raise KeyboardInterrupt

    w.launcher.on_start = interrupt
    with pytest.raises(StartInterrupted):  # the CLI says it keeps loading
        ensure(w.deps())
    rec = w.store.get("vllm")
    assert rec.lease is None and rec.handle is None
    assert rec.phase is Phase.STARTING and rec.start_nonce == w.launcher.nonces[-1]
    assert rec.attempts and rec.attempts[-1]["outcome"] == "interrupted", rec.attempts


def test_ctrl_c_before_the_nonce_is_recorded_records_no_attempt(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted as it admits the start, before its `starting` record (and nonce) is
    written: nothing was launched, so no attempt is recorded, and the lease goes back."""
    from gpuctl.flows import story

    told: list[str] = []

    def interrupt(_store: object, event: object) -> None:
        told.append(type(event).__name__)
        raise KeyboardInterrupt

    monkeypatch.setattr(story, "tell", interrupt)
    with pytest.raises(KeyboardInterrupt) as caught:
        ensure(w.deps())
    assert not isinstance(caught.value, StartInterrupted)  # the CLI: nothing was started
    rec = w.store.get("vllm")
    assert told and w.launcher.started == [] and rec.lease is None
    assert not rec.attempts, rec.attempts


def test_ctrl_c_as_the_lease_is_granted_gives_it_back(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted once the store granted the lease but before its answer came back:
    the lease is given back, and nothing is launched or recorded as an attempt."""
    real = w.store.acquire

    def granted_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(w.store, "acquire", granted_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure(w.deps())
    rec = w.store.get("vllm")
    assert rec.lease is None and not rec.attempts and w.launcher.started == []


def test_progress_ticks_name_the_phase(w: World) -> None:
    ticks: list[str] = []
    w.health.ready_after(5)
    deps = w.deps()
    deps.tell = Tell(progress=lambda p: ticks.append(p.phase))
    ensure(deps)
    assert ticks and set(ticks) == {"loading (launched)"}


def test_a_start_with_a_history_tells_its_eta_before_it_launches(w: World) -> None:
    """The median of the recent starts is told as soon as the look finds it: the proxy
    holding a request answers Retry-After from it, even before the launch's first tick."""
    w.health.ready_after(5)
    ensure(w.deps())
    service_ops.stop(w.deps())
    ticks: list[tuple[str, float | None, int]] = []
    w.health.ready_after(5)
    deps = w.deps()
    deps.tell = Tell(
        progress=lambda p: ticks.append((p.phase, p.expected_s, len(w.launcher.started)))
    )
    ensure(deps)
    assert ticks[0][0] == "checking" and ticks[0][1] and ticks[0][2] == 1  # not launched yet
    assert {t[0] for t in ticks[1:]} == {"loading (launched)"}
    assert all(t[1] == ticks[0][1] for t in ticks)


# ---- stop and touch


def test_stop_stops_the_recorded_server_and_marks_it_stopped(w: World) -> None:
    ensure(w.deps(), EnsureRequest(wait=False))
    r = service_ops.stop(w.deps())
    assert r.stopped == ["pid 4242"]
    assert r.exit_code == ExitCode.OK
    rec = w.store.get("vllm")
    assert (rec.phase, rec.handle, rec.lease) == (Phase.STOPPED, None, None)


def test_stop_waits_on_the_fake_clock_for_a_start_under_way(w: World) -> None:
    other = holder_here("someone-else")
    w.store.acquire("vllm", other, 600)
    with pytest.raises(StoreError, match="being started or stopped"):
        service_ops.stop(w.deps())
    assert sum(w.clock.slept) >= service_ops.STOP_LEASE_WAIT_S  # no real time spent


def test_touch_marks_it_used(w: World) -> None:
    r = service_ops.touch(w.deps())
    assert r.service == "vllm" and r.record.last_used == w.clock.t


# ---- status


def _status_deps(
    tmp_path: Path, agents: dict[str, Agent], stores: dict[str, DirectStore]
) -> StatusDeps:
    text = "".join(
        f'[hosts.{h}]\nagent = "http://127.0.0.1:9"\n\n'
        f'[services.vllm_{h}]\nhost = "{h}"\nmatch = ["vllm"]\nmemory = "80GiB"\n\n'
        for h in agents
    )
    conf = config(tmp_path, text)
    clock = Clock()
    return StatusDeps(
        config=conf,
        hosts=[
            HostDeps(conf.host(h), f"fake {h}", stores[h].records, agents[h].read) for h in agents
        ],
        check_health=lambda url, t: Health("refused", "no"),
        machine=ThisMachine(),
        clock=clock,
        monotonic=clock,
        sleep=clock.sleep,
    )


def test_status_reads_records_first_and_asks_for_their_servers(tmp_path: Path) -> None:
    clock = Clock()
    store = DirectStore(tmp_path / "a", clock=clock)
    holder = holder_here("test")
    store.acquire("vllm_a", holder, 60)
    store.release(
        "vllm_a",
        holder.id,
        RecordUpdate.from_wire({"handle": {"kind": "process", "pid": 555}, "phase": "running"}),
    )
    agent = Agent(processes=[GpuProcess(555, "python -m my_server", 70 * GIB)])
    report = status(_status_deps(tmp_path, {"a": agent}, {"a": store}))
    assert agent.asked == [(["vllm"], [555])]
    (host,) = report.hosts
    # the recorded server is its service's, whatever its command line
    assert host.verdicts[0].decision is Decision.LOADING
    assert dict(host.servers) == {555: "vllm_a"}
    assert report.exit_code == ExitCode.OK


def test_status_reports_a_dead_host_unknown_and_the_others_as_they_are(tmp_path: Path) -> None:
    agents = {"a": Agent(), "b": Agent(error="connection refused by http://b:9400")}
    stores = {h: DirectStore(tmp_path / h) for h in agents}
    report = status(_status_deps(tmp_path, agents, stores))
    a, b = report.hosts
    assert a.ok and a.verdicts[0].decision is Decision.IDLE
    assert not b.ok and b.verdicts[0].decision is Decision.UNKNOWN
    assert b.error == "connection refused by http://b:9400" and b.hint == "is the agent up?"
    assert report.exit_code == ExitCode.UNKNOWN


def test_status_is_unknown_where_the_wait_queue_cannot_be_read(tmp_path: Path) -> None:
    """ensure holds an IDLE or FITS service back for the head of the `run --wait` queue;
    status, which cannot read that queue, does not call the service free either."""

    def broken() -> list[Any]:
        raise StoreError("cannot read the wait queue /x/queue: Permission denied", hint="fix it")

    agents = {"a": Agent()}
    deps = _status_deps(tmp_path, agents, {"a": DirectStore(tmp_path / "a")})
    deps.hosts[0] = replace(deps.hosts[0], read_waiters=broken)
    (v,) = status(deps).hosts[0].verdicts
    assert v.decision is Decision.UNKNOWN and "wait queue cannot be read" in v.reason
    assert v.hint == "fix it"
    deps.hosts[0] = replace(deps.hosts[0], read_waiters=list)
    (v,) = status(deps).hosts[0].verdicts
    assert v.decision is Decision.IDLE


def _prio_status(
    tmp_path: Path,
    counts: Callable[[], dict[str, int]],
    agent: Agent | None = None,
    chat: str = "",
) -> tuple[StatusDeps, DirectStore]:
    """Host a: a batch (60 GiB, priority 50, started by gpuctl: pid 555) on a 128 GiB GPU;
    chat (80 GiB, priority 100) and llm (90 GiB, priority 100) do not fit beside it."""
    conf = config(
        tmp_path,
        '[hosts.a]\nagent = "http://127.0.0.1:9"\n\n'
        '[services.batch]\nhost = "a"\nmemory = "60GiB"\npriority = 50\n'
        'launcher = "process"\ncommand = "batch"\n\n'
        f'[services.chat]\nhost = "a"\nmemory = "80GiB"\npriority = 100\n{chat}\n'
        '[services.llm]\nhost = "a"\nmemory = "90GiB"\npriority = 100\n',
    )
    clock = Clock()
    store = DirectStore(tmp_path / "a", clock=clock)
    h = holder_here("test")
    store.acquire("batch", h, 60)
    store.release(
        "batch",
        h.id,
        RecordUpdate.from_wire({"handle": {"kind": "process", "pid": 555}, "phase": "running"}),
    )
    agent = agent or Agent(processes=[GpuProcess(555, "python batch.py", 60 * GIB)])
    deps = StatusDeps(
        config=conf,
        hosts=[HostDeps(conf.host("a"), "fake a", store.records, agent.read, read_inflight=counts)],
        check_health=lambda url, t: Health("refused", "no"),
        machine=ThisMachine(),
        clock=clock,
        monotonic=clock,
        sleep=clock.sleep,
    )
    return deps, store


def test_status_is_preemptable_as_ensure_decides_it(tmp_path: Path) -> None:
    """A service that fits once lower-priority work stops is PREEMPTABLE in status, with
    the plan and the `ensure --preempt` hint; the in-flight counts are read once per host
    however many services do not fit."""
    asked: list[int] = []

    def counts() -> dict[str, int]:
        asked.append(1)
        return {}

    deps, _ = _prio_status(tmp_path, counts)
    (host,) = status(deps).hosts
    by = {s.name: v for s, v in zip(host.services, host.verdicts, strict=True)}
    assert by["batch"].decision is Decision.LOADING  # its recorded server, not answering
    for name in ("chat", "llm"):
        v = by[name]
        assert v.decision is Decision.PREEMPTABLE, v.reason
        assert v.plan is not None and v.plan.names == ("batch",)
        assert "fits once batch (priority 50, 60.0 GiB) stops" in v.reason
        assert v.hint.startswith(f"`gpuctl ensure {name} --preempt` stops batch to make room")
    assert asked == [1]


def test_status_hint_for_a_service_that_preempts_by_itself(tmp_path: Path) -> None:
    deps, _ = _prio_status(tmp_path, dict, chat="preempt = true\n")
    (host,) = status(deps).hosts
    v = host.verdicts[[s.name for s in host.services].index("chat")]
    assert v.decision is Decision.PREEMPTABLE
    assert v.hint == "`gpuctl ensure chat` stops batch to make room (its preempt = true)"


@pytest.mark.parametrize(
    ("counts", "why"),
    [
        ({"batch": 2}, "batch: 2 requests in flight (--force stops it anyway)"),
        (None, "batch: its requests in flight cannot be read"),
    ],
)
def test_status_is_busy_when_the_victim_may_not_be_stopped(
    tmp_path: Path, counts: dict[str, int] | None, why: str
) -> None:
    def read() -> dict[str, int]:
        if counts is None:
            raise StoreError("the agent's /records/_inflight did not answer")
        return counts

    deps, _ = _prio_status(tmp_path, read)
    (host,) = status(deps).hosts
    v = host.verdicts[[s.name for s in host.services].index("chat")]
    assert v.decision is Decision.BUSY and v.plan is None
    assert why in v.reason and "= batch, priority 50" in v.reason and "pid 555" in v.reason


def test_status_gives_the_hosts_hint_once(tmp_path: Path) -> None:
    """A host that did not answer: its hint is the host's, not repeated in each verdict."""
    agents = {"b": Agent(error="connection refused by http://b:9400")}
    report = status(_status_deps(tmp_path, agents, {"b": DirectStore(tmp_path / "b")}))
    (b,) = report.hosts
    assert b.hint == "is the agent up?"
    assert [v.hint for v in b.verdicts] == [""]


def test_status_taken_at_comes_from_the_clock_in_the_one_form(tmp_path: Path) -> None:
    report = status(_status_deps(tmp_path, {"a": Agent()}, {"a": DirectStore(tmp_path / "s")}))
    assert report.taken_at == "2027-01-15T08:00:00.000Z"


def test_watch_shows_each_report_until_ctrl_c(tmp_path: Path) -> None:
    deps = _status_deps(tmp_path, {"a": Agent()}, {"a": DirectStore(tmp_path / "s")})
    shown: list[str] = []

    def sleep(s: float) -> None:
        if len(shown) >= 3:
            raise KeyboardInterrupt
        deps.clock.t += s  # type: ignore[attr-defined]

    deps.sleep = sleep
    last = watch(deps, 2.0, lambda r: shown.append(r.taken_at))
    assert len(shown) == 3
    assert shown[1] == "2027-01-15T08:00:02.000Z"
    assert last.taken_at == shown[-1]


# ---- locks


def test_locks_lists_every_service_and_reports_a_failing_host(tmp_path: Path) -> None:
    conf = config(
        tmp_path,
        '[hosts.a]\nagent = "http://127.0.0.1:9"\n[hosts.b]\nagent = "http://127.0.0.1:9"\n'
        '[services.x]\nhost = "a"\n[services.y]\nhost = "b"\n',
    )
    store = DirectStore(tmp_path / "a")
    store.touch("x")

    def store_of(h: object) -> DirectStore:
        if getattr(h, "name", "") == "b":
            raise StoreError("the store on b: no state dir")
        return store

    clock = Clock()
    report = service_ops.locks(
        LocksDeps(
            config=conf,
            hosts=list(conf.hosts.values()),
            store_of=store_of,
            machine=ThisMachine(),
            clock=clock,
        )
    )
    assert [(h, r.service if r else None, e) for h, r, e in report.rows] == [
        ("a", "x", None),
        ("b", None, "the store on b: no state dir"),
    ]
    assert report.now == clock.t
    assert report.exit_code == ExitCode.UNKNOWN
    assert isinstance(report.rows[0][1], Record)


def test_status_memory_per_gpu_counts_what_admission_counts(tmp_path: Path) -> None:
    from gpuctl.core.snapshot import GpuDevice

    store = DirectStore(tmp_path / "a")
    starter = holder_here("test")
    store.acquire("vllm_a", starter, 600)  # a start under way: its budget is promised
    store.update("vllm_a", starter.id, RecordUpdate.from_wire({"phase": "starting"}))
    agent = Agent(processes=[GpuProcess(9, "python comfy.py", 10 * GIB, gpu=0)])
    read = agent.read

    def two_gpus(kws: object, pids: object) -> object:
        snap = read(kws, pids)  # type: ignore[arg-type]
        return replace(
            snap,
            gpus=2,
            devices=(
                GpuDevice(0, 12 * GIB, 80 * GIB, utilization_pct=40),
                GpuDevice(1, 0, 80 * GIB, utilization_pct=None),
            ),
        )

    agent.read = two_gpus  # type: ignore[method-assign,assignment]
    deps = _status_deps(tmp_path, {"a": agent}, {"a": store})
    (host,) = status(deps).hosts
    m0, m1 = host.memory
    assert (m0.gpu, m0.held_mib, m0.total_mib, m0.utilization_pct) == (0, 12 * GIB, 80 * GIB, 40)
    # held 12 (10 by comfy, 2 unattributed), then vllm's 80 promised: 12 + 80 > 80
    assert m0.promised_mib == 80 * GIB and m0.free_mib == 80 * GIB - 12 * GIB - 80 * GIB
    assert (m1.gpu, m1.held_mib, m1.promised_mib, m1.utilization_pct) == (1, 0, 80 * GIB, None)


def test_a_fits_reason_names_the_top_holders_and_a_count(tmp_path: Path) -> None:
    procs = [GpuProcess(100 + i, f"python job{i}.py", (i + 1) * GIB, user="ana") for i in range(6)]
    agent = Agent(processes=procs)
    (host,) = status(_status_deps(tmp_path, {"a": agent}, {"a": DirectStore(tmp_path / "s")})).hosts
    (v,) = host.verdicts
    assert v.decision is Decision.FITS
    assert "job5.py" in v.reason and "job4.py" in v.reason  # the two biggest
    assert "4 more" in v.reason
    assert "job0.py" not in v.reason


def test_a_bystander_reports_the_starters_failure_with_its_log(w: World) -> None:
    other = holder_here("someone-else")
    w.store.acquire("vllm", other, 600)
    polls = {"n": 0}

    def health() -> Health:
        polls["n"] += 1
        if polls["n"] == 6:  # the starter gives up and records why
            w.store.release(
                "vllm",
                other.id,
                RecordUpdate.from_wire(
                    {"failure": {"error": "CUDA out of memory", "log_tail": "Traceback\nOOM"}}
                ),
            )
        return Health("refused", "no")

    deps = w.deps()
    deps.servers = replace(deps.servers, health=health)
    r = ensure(deps)
    assert (r.outcome, r.exit_code, r.launched) == (Outcome.FAILED, ExitCode.FAILED, False)
    assert "CUDA out of memory" in r.reason and r.log_tail.endswith("OOM")
    assert r.hint
    assert w.launcher.started == []


def test_a_bystander_whose_starter_backed_off_for_a_bigger_job_is_busy(w: World) -> None:
    other = holder_here("someone-else")
    w.store.acquire("vllm", other, 600)
    polls = {"n": 0}

    def health() -> Health:
        polls["n"] += 1
        if polls["n"] == 6:  # the starter backs off; a foreign job takes the GPU
            w.store.release("vllm", other.id)
            w.agent.processes = [GpuProcess(7, "python train.py", 100 * GIB, user="bob")]
        return Health("refused", "no")

    deps = w.deps()
    deps.servers = replace(deps.servers, health=health)
    r = ensure(deps)
    assert (r.outcome, r.exit_code, r.decision) == (Outcome.BUSY, ExitCode.BUSY, "BUSY")
    assert "train.py" in r.reason
    assert "ask bob" in r.hint
    assert w.launcher.started == []


def test_locks_lists_set_aside_records_and_still_succeeds(tmp_path: Path) -> None:
    conf = config(tmp_path, '[hosts.a]\nagent = "http://127.0.0.1:9"\n[services.x]\nhost = "a"\n')
    store = DirectStore(tmp_path / "a")
    store.touch("x")
    (tmp_path / "a" / "records" / "x.json").write_text('{"schema": 1, "service": ')  # torn
    deps = LocksDeps(
        config=conf,
        hosts=list(conf.hosts.values()),
        store_of=lambda h: store,
        machine=ThisMachine(),
        clock=Clock(),
    )
    report = service_ops.locks(deps)
    assert report.exit_code == ExitCode.OK and report.ok
    ((host, kept),) = report.set_aside
    assert host == "a" and kept.service == "x" and kept.file.startswith("x.json.corrupt-")
    (_, rec, _) = report.rows[0]
    assert rec is not None and kept.file in (rec.recovered or "")
    again = service_ops.locks(deps)  # still listed while the copy is kept
    assert [a.file for _, a in again.set_aside] == [kept.file]


def test_the_bar_counts_an_orphaned_start_as_the_decisions_do(tmp_path: Path) -> None:
    """A caller killed between admission and recording its server leaves a `starting`
    record with no lease and no handle (and the start nonce its launch wrote with
    `starting`): rivals count it at its budget, so the bar does."""
    clock = Clock()
    store = DirectStore(tmp_path / "a", clock=clock)
    h = holder_here("killed-caller")
    store.acquire("vllm_a", h, 600)
    store.update(
        "vllm_a",
        h.id,
        RecordUpdate.from_wire({"phase": "starting", "start_nonce": "0123456789abcdef"}),
    )
    store.release("vllm_a", h.id)  # the caller died: its lease is gone, no handle
    deps = _status_deps(tmp_path, {"a": Agent()}, {"a": store})
    deps.clock = clock
    (host,) = status(deps).hosts
    (m,) = host.memory
    assert m.promised_mib == 80 * GIB
    # Without a nonce nothing was spawned (a preemption's promise whose caller died
    # while it stopped the victims): no start to count.
    h = holder_here("killed-preemptor")
    store.acquire("vllm_a", h, 600)
    store.update("vllm_a", h.id, RecordUpdate.from_wire({"phase": "starting", "start_nonce": None}))
    store.release("vllm_a", h.id)
    (host,) = status(deps).hosts
    (m,) = host.memory
    assert m.promised_mib == 0


def test_a_reader_bug_is_that_hosts_unknown_with_a_hint(tmp_path: Path) -> None:
    agents = {"a": Agent(), "b": Agent()}
    deps = _status_deps(tmp_path, agents, {h: DirectStore(tmp_path / h) for h in agents})

    def broken(kws: object, pids: object) -> object:
        raise KeyError("surprise")

    deps.hosts[1].read_snapshot = broken  # type: ignore[assignment]
    a, b = status(deps).hosts
    assert a.ok
    assert not b.ok and "KeyError" in (b.error or "") and "GPUCTL_DEBUG=1" in (b.hint or "")


def test_resume_hands_the_callers_deps_back_as_they_were(w: World) -> None:
    """A resume never preempts, but only for itself: the request and deps it was handed
    keep their own ``preempt`` and service afterwards, so a later ensure with them still
    may."""
    from gpuctl.flows.resume import resume

    w.health.ready_after(0)
    deps = w.deps()
    req = EnsureRequest(entry="resume", preempt=True)
    svc = deps.service
    r = resume(deps, req)
    assert r.outcome is Outcome.READY
    assert req.preempt is True
    assert deps.service is svc
