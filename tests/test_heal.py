"""Phases heal (issue 16), end to end on the simulated GPU (120 GiB): real servers
started by the process launcher, the real agent on loopback or the files directly (a
host without an agent), the installed CLI, and a preemptor killed in its window by a
failpoint (``preempt.after_mark``: its victim marked ``preempted``, not yet signalled).
The rules themselves: test_heal_rules.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    direct_config,
    end_in_window,
    ensure_paused_at,
    kill_servers,
    model_server_command,
    priced_service,
    read_record,
    run_ensure,
    server_pids,
    unique_name,
)
from tests.test_schemas import check as check_schema

pytestmark = pytest.mark.e2e


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    """The same simulated host with no agent: commands use its files directly."""
    from gpuctl import api

    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "120GiB")
    api._reset_for_tests()
    with SimHost(root=tmp_path / "simhost", gpu_memory="120GiB") as h:
        yield h
    api._reset_for_tests()


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    chat, batch = unique_name("chat"), unique_name("batch")
    yield chat, batch
    kill_servers(chat)
    kill_servers(batch)


def two(chat: str, batch: str) -> str:
    """chat (100 GiB, priority 100, health timeout 3 s) fits on the 120 GiB GPU only once
    batch (30 GiB, priority 50, resume = true) stops."""
    # chat's health timeout is short: its killed preemptor's promise (starting, nothing
    # launched) is abandoned 3 s after it was made, for a reader whose config names it.
    chat_toml = priced_service(chat, free_port(), 100, 100).replace(
        'health_timeout = "60s"', 'health_timeout = "3s"'
    )
    return (
        chat_toml
        + "\n"
        + priced_service(batch, free_port(), 30, 50, 'resume = true\nkind = "batch"')
    )


def until(what: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.time() + timeout_s
    while not what():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def repairs(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in record["attempts"] if a.get("outcome") == "repaired"]


def kill_preemptor_after_mark(cfg: Path, chat: str, sig: int) -> None:
    p = ensure_paused_at(cfg, chat, "preempt.after_mark", "--preempt")
    end_in_window(p, sig)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_agent_heals_a_killed_preemptors_victim_and_its_own_start(
    host: SimHost, names: tuple[str, str], sig: int
) -> None:
    chat, batch = names
    cfg = host.write_config(two(chat, batch))
    assert run_ensure(cfg, batch).returncode == 0
    (batch_pid,) = server_pids(batch)
    kill_preemptor_after_mark(cfg, chat, sig)
    t_killed = time.time()
    # The batch's server runs on: within seconds its record says so again.
    until(lambda: read_record(host, batch)["phase"] == "running")
    assert server_pids(batch) == [batch_pid]
    rec = read_record(host, batch)
    assert rec["lease"] is None and rec["handle"]["pid"] == batch_pid
    (note,) = repairs(rec)
    assert note["repaired"].startswith("preempted -> running") and note["by"] in (
        "agent",
        "ensure",
    )
    # The preemptor's own promise (starting, no nonce, nothing launched): past the health
    # timeout its record promises (3 s), the agent or `locks` heals it: `locks` no
    # longer shows it starting.
    time.sleep(max(0.0, t_killed + 3.5 - time.time()))
    r = gpuctl_in_process(cfg, "locks", "--json")
    assert r.returncode == 0, r.stderr
    # (Ctrl-C lets the preemptor put its own record back on its way out; kill -9 does not.)
    killed = sig == signal.SIGKILL
    healed = [n for n in repairs(read_record(host, chat)) if n["by"] in ("agent", "locks")]
    assert bool(healed) is killed, read_record(host, chat)
    if killed:
        assert healed[-1]["repaired"].startswith("starting -> stopped: nothing was launched")
    out = json.loads(r.stdout)
    check_schema("locks", out)  # the repair note and `repaired` are declared
    rows = {x["service"]: x for x in out["records"]}
    assert rows[batch]["repaired"]["repaired"] == note["repaired"]
    assert rows[chat]["phase"] == "stopped" and rows[chat]["lease"] is None
    assert rows[batch]["starts"] == 1  # a repair note is no start
    r = gpuctl_in_process(cfg, "locks")
    assert f"{batch}: repaired" in r.stdout.replace("\n", " ")
    # The batch is a victim again: the next --preempt stops it and starts chat once.
    r = run_ensure(cfg, chat, "--preempt")
    assert r.returncode == 0, r.stdout + r.stderr
    assert server_pids(batch) == [] and len(server_pids(chat)) == 1
    assert read_record(host, batch)["phase"] == "preempted"


def test_without_an_agent_reclaim_heals_and_never_claims_a_resume(
    bare: SimHost, names: tuple[str, str]
) -> None:
    host, (chat, batch) = bare, names
    cfg = direct_config(host, two(chat, batch))
    assert run_ensure(cfg, batch).returncode == 0
    (batch_pid,) = server_pids(batch)
    kill_preemptor_after_mark(cfg, chat, signal.SIGKILL)
    assert read_record(host, batch)["phase"] == "preempted"  # nobody has looked yet
    time.sleep(3.5)  # past chat's health timeout: its promise is abandoned
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"repaired {batch} on sim: preempted -> running" in r.stderr
    assert f"repaired {chat} on sim: starting -> stopped" in r.stderr
    assert "resumed" not in r.stdout
    assert read_record(host, batch)["phase"] == "running"
    assert read_record(host, chat)["phase"] == "stopped"
    assert server_pids(batch) == [batch_pid]
    # Healed once: the next run has nothing to say.
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0 and "repaired" not in r.stderr and "resumed" not in r.stdout


def test_without_an_agent_ensure_heals_the_victim_and_preempts_it(
    bare: SimHost, names: tuple[str, str]
) -> None:
    host, (chat, batch) = bare, names
    cfg = direct_config(host, two(chat, batch))
    assert run_ensure(cfg, batch).returncode == 0
    kill_preemptor_after_mark(cfg, chat, signal.SIGKILL)
    r = run_ensure(cfg, chat, "--preempt")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"repaired {batch} on sim: preempted -> running" in r.stderr
    assert any(f"repaired {batch}" in n for n in json.loads(r.stdout)["notes"])
    assert server_pids(batch) == [] and len(server_pids(chat)) == 1


def test_a_server_gone_on_its_own_is_stopped_within_a_look(
    bare: SimHost, names: tuple[str, str]
) -> None:
    host, (_, batch) = bare, names
    cfg = direct_config(host, priced_service(batch, free_port(), 30, 50, 'kind = "batch"'))
    assert run_ensure(cfg, batch).returncode == 0
    (pid,) = server_pids(batch)
    os.kill(pid, signal.SIGKILL)  # it ends on its own; its parent is long gone
    until(lambda: server_pids(batch) == [])
    assert read_record(host, batch)["phase"] == "running"
    r = gpuctl_in_process(cfg, "status", "--json")
    assert f"repaired {batch} on sim: running -> stopped" in r.stderr
    assert "exit status unknown" in r.stderr
    rec = read_record(host, batch)
    assert rec["phase"] == "stopped" and rec["handle"] is None
    assert "exit status unknown" in repairs(rec)[0]["repaired"]
    r = gpuctl_in_process(cfg, "reclaim")
    assert "resumed" not in r.stdout and "repaired" not in r.stderr


def test_agent_stops_a_record_whose_server_is_gone(host: SimHost, names: tuple[str, str]) -> None:
    _, batch = names
    cfg = host.write_config(priced_service(batch, free_port(), 30, 50))
    assert run_ensure(cfg, batch).returncode == 0
    (pid,) = server_pids(batch)
    os.kill(pid, signal.SIGKILL)
    until(lambda: read_record(host, batch)["phase"] == "stopped")
    assert repairs(read_record(host, batch))[0]["by"] == "agent"


def test_without_an_agent_a_start_that_answers_moves_on_when_anyone_looks(
    bare: SimHost, names: tuple[str, str]
) -> None:
    host, (_, batch) = bare, names
    port = free_port()
    cfg = direct_config(host, priced_service(batch, port, 30, 50, 'kind = "batch"'))
    r = run_ensure(cfg, batch, "--no-wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert read_record(host, batch)["phase"] == "starting"

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    until(answers)
    assert read_record(host, batch)["phase"] == "starting"
    r = gpuctl_in_process(cfg, "locks")
    assert r.returncode == 0, r.stderr
    assert f"repaired {batch} on sim: starting -> running: its server answers" in r.stderr
    assert read_record(host, batch)["phase"] == "running"


def test_a_start_whose_server_died_with_nobody_waiting_fails(
    host: SimHost, names: tuple[str, str]
) -> None:
    """`ensure --no-wait` whose server exits while loading: no lease, nobody to record
    the end. The agent marks it failed (its promise counts no more, and the original
    API's `is_idle` is true again), never `starting` for ever."""
    _, batch = names
    port = free_port()
    toml = priced_service(batch, port, 30, 50).replace(
        model_server_command(batch, port, "30GiB", "1s"),
        model_server_command(batch, port, "30GiB", "30s"),
    )
    cfg = host.write_config(toml)
    r = run_ensure(cfg, batch, "--no-wait")
    assert r.returncode == 0, r.stdout + r.stderr
    until(lambda: bool(server_pids(batch)))
    assert read_record(host, batch)["phase"] == "starting"
    for pid in server_pids(batch):
        os.kill(pid, signal.SIGKILL)
    until(lambda: read_record(host, batch)["phase"] == "failed")
    rec = read_record(host, batch)
    assert repairs(rec)[-1]["repaired"].startswith("starting -> failed: its server (pid")
    assert rec["failure"] and "exited while it was starting" in rec["failure"]["error"]
    status = httpx.get(
        f"{host.agent_url}/status", headers={"Authorization": f"Bearer {host.token}"}
    ).json()
    assert status["is_idle"] is True, status


@pytest.mark.slow
def test_a_reader_in_another_pid_namespace_never_calls_a_live_server_gone(
    host: SimHost, names: tuple[str, str], tmp_path: Path
) -> None:
    """An agent (here a second one, under `unshare --pid`, on the same store) that cannot
    see the host's processes says "cannot tell", never "gone": the live server's record
    stays `running`, with its handle."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode()[:200]}")
    _, batch = names
    cfg = host.write_config(priced_service(batch, free_port(), 30, 50))
    assert run_ensure(cfg, batch).returncode == 0
    (pid,) = server_pids(batch)
    host.stop(host.procs[0])  # the agent on the host's own namespace: no other healer
    port = free_port()
    env = {**host.env(), "GPUCTL_AGENT_TOKEN": host.token}
    log = (tmp_path / "ns-agent.log").open("w")
    agent = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", gpuctl_exe(), "agent", "--probe", "sim",
         "--listen", f"127.0.0.1:{port}", "--state-dir", str(host.state_dir),
         "--sim-dir", str(host.sim_dir)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        until(lambda: b"listening" in (tmp_path / "ns-agent.log").read_bytes())
        time.sleep(8)  # its heal loop runs every few seconds
        rec = read_record(host, batch)
        assert rec["phase"] == "running" and rec["handle"]["pid"] == pid, rec
        assert not repairs(rec)
        assert server_pids(batch) == [pid]
    finally:
        agent.kill()
        agent.wait()
        log.close()


def test_a_start_healed_to_running_is_journaled_as_ready(tmp_path: Path) -> None:
    """A start whose caller did not wait (`--no-wait`, a resume) and whose server now
    answers: the heal that marks it running tells it as the start's ``ready``, with its
    cold start, as the agent's check would; a ``repair`` there left the journal with no
    ready for that start at all."""
    from gpuctl.adapters.store.base import holder_here
    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.adapters.store.journal import Journal
    from gpuctl.core.events import Kind
    from gpuctl.core.heal import ServerTruth
    from gpuctl.core.record import Phase
    from gpuctl.core.record_shapes import RecordUpdate
    from gpuctl.flows.heal import heal

    state = tmp_path / "state"
    store = DirectStore(state)
    try:
        holder = holder_here("ensure")
        assert store.acquire("photos", holder, 60)[0]
        store.release(
            "photos",
            holder.id,
            RecordUpdate(phase=Phase.STARTING, start_nonce="ab" * 8, health="http://x/health"),
        )
        t0 = store.get("photos").since
        done = heal(
            store,
            [store.get("photos")],
            lambda _r: ServerTruth(answers=True),
            "agent",
            new_holder=holder_here,
            clock=lambda: t0 + 42.0,
        )
        assert [(r.was, r.phase) for r in done] == [(Phase.STARTING, Phase.RUNNING)]
        assert store.get("photos").phase is Phase.RUNNING
    finally:
        store.close()
    j = Journal(state)
    try:
        (ready,) = [e for _, e in j.read(0.0) if e.service == "photos"]
        assert ready.kind is Kind.READY and ready.who["entry"] == "agent"
        assert ready.figures["cold_start_s"] == pytest.approx(42.0)
    finally:
        j.close()
