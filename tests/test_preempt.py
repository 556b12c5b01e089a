"""Preemption end to end on the simulated GPU (120 GiB): real agent, real store, real
servers started by the process launcher, the installed CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    launches_in_log,
    priced_service,
    read_record,
    run_ensure,
    server_pids,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    chat, batch = unique_name("chat"), unique_name("batch")
    yield chat, batch
    kill_servers(chat)
    kill_servers(batch)


def log_of(host: SimHost, name: str) -> Path:
    return host.state_dir / "logs" / f"{name}.log"


@pytest.mark.slow
def test_preempt_stops_the_lower_priority_batch_and_starts_once(
    host: SimHost, names: tuple[str, str]
) -> None:
    chat, batch = names
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        priced_service(chat, pc, 80, 100)
        + "\n"
        + priced_service(batch, pb, 30, 50, "resume = true")
    )
    # A foreign 15 GiB job (whisper, not ours): never a victim.
    whisper = host.hold("whisper-job", "15GiB")
    r = run_ensure(cfg, batch)
    assert r.returncode == 0, r.stdout + r.stderr
    (batch_pid,) = server_pids(batch)

    # Without --preempt: exit 3, naming what would be stopped and how to ask.
    r = run_ensure(cfg, chat)
    out = json.loads(r.stdout)
    assert r.returncode == 3, r.stdout
    assert out["decision"] == "PREEMPTABLE" and out["outcome"] == "busy"
    assert f"fits once {batch} (priority 50, 30.0 GiB) stops" in out["reason"]
    assert "--preempt" in out["hint"] and batch in out["hint"]
    assert server_pids(batch) == [batch_pid] and server_pids(chat) == []

    # The batch, asked again, fits: nothing changes.
    assert run_ensure(cfg, batch).returncode == 0 and server_pids(batch) == [batch_pid]

    # With --preempt: the batch is stopped and marked preempted, whisper stays, chat
    # starts once, and nothing runs out of memory.
    r = run_ensure(cfg, chat, "--preempt")
    out = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out["outcome"] == "ready" and out["launched"] is True
    assert any(f"preempted {batch}" in n for n in out["notes"]), out["notes"]
    assert server_pids(batch) == []
    assert len(server_pids(chat)) == 1
    assert whisper.poll() is None
    rec = read_record(host, batch)
    assert rec["phase"] == "preempted" and rec["handle"] is None and rec["lease"] is None
    assert launches_in_log(log_of(host, chat)) == 1
    for n in (chat, batch):
        assert "out of memory" not in log_of(host, n).read_text().lower()

    # The batch now is BUSY, and the refusal names who holds the GPU: the chat server
    # with its service and priority.
    r = run_ensure(cfg, batch)
    out = json.loads(r.stdout)
    assert r.returncode == 3 and out["decision"] == "BUSY", r.stdout
    assert f"= {chat}, priority 100" in out["reason"]
    assert f"{chat}: priority 100 is not below 50" in out["reason"]
    host.stop(whisper)


def test_preempt_key_and_equal_priority(host: SimHost, names: tuple[str, str]) -> None:
    """``preempt = true`` preempts without the flag; a service of equal priority is never
    a victim (BUSY, exit 3, nothing stopped)."""
    chat, batch = names
    pc, pb = free_port(), free_port()
    peer = unique_name("peer")
    pp = free_port()
    cfg = host.write_config(
        priced_service(chat, pc, 80, 100, "preempt = true")
        + "\n"
        + priced_service(batch, pb, 30, 50)
        + "\n"
        + priced_service(peer, pp, 80, 50, "preempt = true")
    )
    try:
        assert run_ensure(cfg, batch).returncode == 0
        hold = host.hold("other-job", "40GiB")
        # peer (priority 50) may not stop batch (priority 50).
        r = run_ensure(cfg, peer)
        assert r.returncode == 3, r.stdout
        assert json.loads(r.stdout)["decision"] == "BUSY"
        assert len(server_pids(batch)) == 1
        # chat (priority 100, preempt = true) may.
        r = run_ensure(cfg, chat)
        assert r.returncode == 0, r.stdout + r.stderr
        assert server_pids(batch) == [] and len(server_pids(chat)) == 1
        assert read_record(host, batch)["phase"] == "preempted"
        host.stop(hold)
    finally:
        kill_servers(peer)


@pytest.mark.slow
def test_in_flight_victim_needs_force(host: SimHost, names: tuple[str, str]) -> None:
    chat, batch = names
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        priced_service(chat, pc, 80, 100) + "\n" + priced_service(batch, pb, 50, 50)
    )
    assert run_ensure(cfg, batch).returncode == 0
    # A caller inside in_use(batch) in another process: one request in flight.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # The name comes by the environment: a command line carrying the batch's
            # keyword would count as the batch loading.
            "import os, time; from gpuctl import api\n"
            "with api.in_use(os.environ['VICTIM']):\n"
            "    print('in', flush=True); time.sleep(120)",
        ],
        env={**cli_env(cfg), "VICTIM": batch},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "in"
        r = run_ensure(cfg, chat, "--preempt")
        out = json.loads(r.stdout)
        assert r.returncode == 3, r.stdout
        assert "1 request in flight" in out["reason"]
        assert len(server_pids(batch)) == 1
        r = subprocess.run(
            [gpuctl_exe(), "ensure", chat, "--json", "--preempt", "--force"],
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert server_pids(batch) == []
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.mark.slow
def test_resume_command_and_reclaim_bring_the_batch_back(
    host: SimHost, names: tuple[str, str]
) -> None:
    """A preempted ``resume = true`` batch: ``gpuctl resume`` refuses while the chat holds
    the GPU (exit 3, nothing stopped); ``gpuctl reclaim`` stops the idle chat and then
    brings the batch back."""
    chat, batch = names
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        priced_service(chat, pc, 100, 100, 'preempt = true\nidle_timeout = "2s"')
        + "\n"
        + priced_service(batch, pb, 30, 50, 'resume = true\nkind = "batch"')
    )
    assert run_ensure(cfg, batch).returncode == 0
    assert run_ensure(cfg, chat).returncode == 0
    assert read_record(host, batch)["phase"] == "preempted"

    r = gpuctl_in_process(cfg, "resume", batch, "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    assert json.loads(r.stdout)["decision"] == "BUSY"
    assert len(server_pids(chat)) == 1 and server_pids(batch) == []
    assert read_record(host, batch)["phase"] == "preempted"

    # A dry run says it would try; nothing changes.
    r = gpuctl_in_process(cfg, "reclaim", "--dry-run", "--json")
    out = json.loads(r.stdout)
    assert [x["service"] for x in out["resumed"]] == [batch] and out["resumed"][0]["dry_run"]
    assert server_pids(batch) == []

    import time

    deadline = time.time() + 60
    while True:  # past the chat's idle timeout of 2 s
        r = gpuctl_in_process(cfg, "reclaim", "--json")
        out = json.loads(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr
        if out["resumed"] and out["resumed"][0]["started"]:
            break
        assert time.time() < deadline, out
        time.sleep(0.5)
    assert server_pids(chat) == []
    assert len(server_pids(batch)) == 1
    assert read_record(host, batch)["phase"] in ("starting", "running")
    assert launches_in_log(log_of(host, batch)) == 2
    # Text output for cron: one line per action.
    r = gpuctl_in_process(cfg, "resume", batch)
    assert r.returncode == 0, r.stdout + r.stderr
