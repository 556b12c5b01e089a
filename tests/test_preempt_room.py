"""The room a preemption makes is kept for the service it was made for.

Between its victims' stops and its own launch, an ``ensure --preempt`` holds the
service's lease with its record ``starting``: every other admission (a resume of the
victim, a ``gpuctl run`` job, another service) counts the service at its budget. Found by
the randomised trials (tests/trials.py): ``gpuctl run``'s end resumed the batch into the
room made for chat, which then ended BUSY after preempting it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    end_in_window,
    ensure_paused_at,
    kill_servers,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    service_toml,
    sim_claims,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


def service(name: str, port: int, gib: int, priority: int, extra: str = "") -> str:
    toml = service_toml(name, port, model_server_command(name, port, f"{gib}GiB", "0.5s"))
    return toml.replace('memory = "20GiB"', f'memory = "{gib}GiB"\npriority = {priority}\n{extra}')


@pytest.mark.slow
def test_a_resume_between_the_stops_and_the_launch_does_not_take_the_room(host: SimHost) -> None:
    chat, batch = unique_name("chat"), unique_name("batch")
    pc, pb = free_port(), free_port()
    # 100 + 30 > 120: chat fits only once the batch is stopped.
    cfg = host.write_config(
        service(chat, pc, 100, 100) + service(batch, pb, 30, 50, "resume = true")
    )
    try:
        assert run_ensure(cfg, batch).returncode == 0
        env = cli_env(cfg)
        # Chat lingers after its stops (the window a resume or a job could use).
        env["GPUCTL_FAILPOINTS"] = "preempt.after_stops=sleep:3"
        preempting = subprocess.Popen(
            [gpuctl_exe(), "ensure", chat, "--preempt", "--json", "--timeout", "60s"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 30
        while read_record(host, batch)["phase"] != "preempted":
            assert time.time() < deadline and preempting.poll() is None, preempting.communicate()
            time.sleep(0.05)
        resumed = subprocess.run(
            [gpuctl_exe(), "resume", batch, "--json"],
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out, err = preempting.communicate(timeout=60)
        # The batch stays preempted (chat's memory is promised), and chat starts.
        assert resumed.returncode == 3, (resumed.stdout, resumed.stderr)
        assert chat in json.loads(resumed.stdout)["reason"]
        assert preempting.returncode == 0, (out, err)
        assert json.loads(out)["outcome"] == "ready"
        assert server_pids(batch) == [] and len(server_pids(chat)) == 1
        assert read_record(host, batch)["phase"] == "preempted"
        assert read_record(host, chat)["phase"] == "running"
    finally:
        kill_servers(chat)
        kill_servers(batch)


@pytest.mark.slow
def test_a_preemptor_killed_while_stopping_its_victim_leaves_it_preempted(
    host: SimHost,
) -> None:
    chat, batch = unique_name("chat"), unique_name("batch")
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        service(chat, pc, 100, 100) + service(batch, pb, 30, 50, "resume = true")
    )
    try:
        assert run_ensure(cfg, batch).returncode == 0
        caller = ensure_paused_at(cfg, chat, "preempt.after_victim_stop", "--preempt")
        end_in_window(caller, signal.SIGKILL)
        # The batch's server is gone; its record says so (preempted: it comes back once
        # it fits), not `running` with a dead server.
        assert server_pids(batch) == []
        assert read_record(host, batch)["phase"] == "preempted"
        # And it is resumed as a preempted batch is.
        r = subprocess.run(
            [gpuctl_exe(), "resume", batch, "--json"],
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(server_pids(batch)) == 1
        assert read_record(host, batch)["phase"] == "running"
    finally:
        kill_servers(chat)
        kill_servers(batch)


def _stopped_at(cfg: Path, name: str, failpoint: str, *args: str) -> subprocess.Popen[str]:
    """``gpuctl ensure NAME --preempt`` stopped (SIGSTOP) at ``failpoint``; returns once
    the process sits stopped there, for the test to act in that window."""
    env = cli_env(cfg)
    env["GPUCTL_FAILPOINTS"] = f"{failpoint}=stop"
    p = subprocess.Popen(
        [gpuctl_exe(), "ensure", name, "--preempt", "--json", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    for line in p.stderr:
        if line.startswith(f"gpuctl failpoint {failpoint}: stop"):
            break
    else:
        raise AssertionError(f"never reached {failpoint} (exit {p.wait()})")
    # The line comes just before its SIGSTOP: a SIGCONT sent earlier would be lost.
    import psutil

    while psutil.Process(p.pid).status() != psutil.STATUS_STOPPED:
        time.sleep(0.01)
    return p


def _resume(cfg: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [gpuctl_exe(), "resume", name, "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_preemptor_out_of_time_at_its_launch_puts_its_phase_back(host: SimHost) -> None:
    chat, batch = unique_name("chat"), unique_name("batch")
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        service(chat, pc, 100, 100) + service(batch, pb, 30, 50, "resume = true")
    )
    try:
        assert run_ensure(cfg, batch).returncode == 0
        caller = _stopped_at(cfg, chat, "preempt.before_launch", "--timeout", "4s")
        stopped = time.monotonic()
        # The victim is stopped and its room made; the caller's deadline passes before
        # its launch. Its 4 s run from its own start, before the failpoint: 4.5 s from
        # here are past them however slowly a loaded machine started it.
        assert server_pids(batch) == []
        assert read_record(host, chat)["phase"] == "starting"
        time.sleep(max(0.0, stopped + 4.5 - time.monotonic()))
        caller.send_signal(signal.SIGCONT)
        out, err = caller.communicate(timeout=60)
        res = json.loads(out)
        assert res["outcome"] == "timeout", (out, err)
        assert "before it was admitted" in res["reason"] or "admission lock" in res["reason"]
        assert server_pids(chat) == []
        rec = read_record(host, chat)
        # Nothing launched: no `starting` left behind promising chat's 100 GiB.
        assert rec["phase"] == "stopped" and not rec.get("start_nonce"), rec
        r = _resume(cfg, batch)
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(server_pids(batch)) == 1
    finally:
        kill_servers(chat)
        kill_servers(batch)


def test_a_preemptor_refused_at_its_launch_by_a_foreign_process_puts_its_phase_back(
    host: SimHost,
) -> None:
    chat, batch = unique_name("chat"), unique_name("batch")
    pc, pb = free_port(), free_port()
    cfg = host.write_config(
        service(chat, pc, 100, 100) + service(batch, pb, 30, 50, "resume = true")
    )
    foreign: subprocess.Popen[str] | None = None
    try:
        assert run_ensure(cfg, batch).returncode == 0
        caller = _stopped_at(cfg, chat, "preempt.before_launch", "--timeout", "60s")
        assert server_pids(batch) == []
        # A process gpuctl did not start takes 40 GiB of the room made for chat.
        foreign = subprocess.Popen(
            [gpuctl_exe(), "sim", "hold", "--memory", "40GiB", "--name", "foreign-notebook"],
            env=cli_env(cfg),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 30
        while not sim_claims(host, "foreign-notebook"):
            assert time.time() < deadline and foreign.poll() is None
            time.sleep(0.05)
        caller.send_signal(signal.SIGCONT)
        out, err = caller.communicate(timeout=60)
        assert caller.returncode == 3, (out, err)
        assert json.loads(out)["outcome"] == "busy", (out, err)
        assert server_pids(chat) == []
        rec = read_record(host, chat)
        assert rec["phase"] == "stopped" and not rec.get("start_nonce"), rec
        # 30 + 40 <= 120: the batch fits again once chat's memory is no longer promised.
        r = _resume(cfg, batch)
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(server_pids(batch)) == 1
    finally:
        if foreign is not None:
            foreign.terminate()
            foreign.wait(timeout=30)
        kill_servers(chat)
        kill_servers(batch)
