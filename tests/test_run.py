"""`gpuctl run` end to end on the simulated GPU (120 GiB): real agent, real store, the
installed CLI, real processes holding simulated GPU memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl, gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    service_toml,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


def hold_cmd(name: str, gib: int) -> list[str]:
    """A job that holds simulated GPU memory until stopped."""
    return [sys.executable, "-m", "gpuctl", "sim", "hold", "--name", name, "--memory", f"{gib}GiB"]


def claims(host: SimHost, name: str) -> list[int]:
    from gpuctl.sim.gpu import SimGpu

    return [c.pid for c in SimGpu(host.sim_dir).claims() if c.name == name]


def wait_for(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_exit_codes_and_refusals_before_cmd_starts(host: SimHost, tmp_path: Path) -> None:
    cfg = host.write_config("")
    assert gpuctl(cfg, "run", "--memory", "15GiB", "--", "true").returncode == 0
    assert gpuctl(cfg, "run", "-m", "1GiB", "--", "sh", "-c", "exit 7").returncode == 7
    r = gpuctl(cfg, "run", "-m", "1GiB", "--", str(tmp_path / "missing"))
    assert r.returncode == 127 and "No such file" in r.stderr
    (tmp_path / "plain").write_text("not a program")
    r = gpuctl(cfg, "run", "-m", "1GiB", "--", str(tmp_path / "plain"))
    assert r.returncode == 126 and "Permission denied" in r.stderr
    # Signals: CMD's own death by a signal is 128+N.
    assert gpuctl(cfg, "run", "-m", "1GiB", "--", "sh", "-c", "kill -TERM $$").returncode == 143
    marker = tmp_path / "ran"
    # Larger than the GPU: exit 3 before CMD starts, saying it can never fit.
    r = gpuctl(cfg, "run", "-m", "200GiB", "--", "touch", str(marker))
    assert r.returncode == 3 and "never fit" in r.stderr and not marker.exists()
    # No wait can help it: the hint names --memory, never --wait (given or not).
    for opts in ((), ("--wait", "--timeout", "5s")):
        r = gpuctl(cfg, "run", *opts, "-m", "200GiB", "--", "touch", str(marker))
        assert r.returncode == 3 and "--wait" not in r.stderr, r.stderr
        assert "with --memory" in r.stderr and not marker.exists(), r.stderr
    # Arguments go to CMD as they are, never through a shell.
    out = tmp_path / "argv"
    r = gpuctl(
        cfg,
        "run",
        "-m",
        "1GiB",
        "--",
        sys.executable,
        "-c",
        "import sys; open(sys.argv[1], 'w').write(repr(sys.argv[2:]))",
        str(out),
        "$HOME",
        "a b",
        "--memory",
    )
    assert r.returncode == 0, r.stderr
    assert out.read_text() == repr(["$HOME", "a b", "--memory"])


def test_a_running_job_counts_and_its_record_dies_with_it(host: SimHost) -> None:
    """A 100 GiB job holds the GPU: another 30 GiB job is BUSY (3, naming it), a service
    too. kill -9 of gpuctl run leaves CMD running and counted; once CMD dies it counts
    for nothing, though nobody wrote that it ended."""
    cfg = host.write_config("")
    tag = unique_name("whisper")
    job = subprocess.Popen(
        [gpuctl_exe(), "run", "--memory", "100GiB", "--name", tag, "--", *hold_cmd(tag, 100)],
        env=cli_env(cfg),
    )
    try:
        wait_for(lambda: claims(host, tag), "the job's CMD holds its memory")
        r = gpuctl(cfg, "run", "-m", "30GiB", "--", "true")
        assert r.returncode == 3 and f"run.{tag}" in r.stderr, r.stderr
        rec = read_record(host, f"run.{tag}")
        assert rec["phase"] == "running" and rec["handle"]["memory_mib"] == 100 * 1024
        (cmd_pid,) = claims(host, tag)
        assert rec["handle"]["pid"] == cmd_pid
        # locks shows it.
        locks = json.loads(gpuctl_in_process(cfg, "locks", "--json").stdout)
        assert any(x["service"] == f"run.{tag}" for x in locks["records"])
        # kill -9 of gpuctl run: CMD runs on in its own session, still counted.
        job.kill()
        job.wait()
        assert claims(host, tag) == [cmd_pid]
        assert gpuctl(cfg, "run", "-m", "30GiB", "--", "true").returncode == 3
        # CMD dies: the record is void at once.
        os.kill(cmd_pid, signal.SIGKILL)
        wait_for(lambda: not claims(host, tag), "the claim goes with its process")
        r = gpuctl(cfg, "run", "-m", "30GiB", "--", "true")
        assert r.returncode == 0, r.stderr
    finally:
        job.kill()
        job.wait()
        for pid in claims(host, tag):
            os.kill(pid, signal.SIGKILL)


# CMD for the signal tests: it writes the signal it got, and exits 9.
TRAP = (
    "import signal, sys, time\n"
    "def h(n, f):\n"
    "    open(sys.argv[1], 'w').write(str(n)); sys.exit(9)\n"
    "signal.signal(signal.SIGTERM, h)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_signals_are_passed_to_cmd(host: SimHost, tmp_path: Path) -> None:
    cfg = host.write_config("")
    out = tmp_path / "got"
    p = subprocess.Popen(
        [gpuctl_exe(), "run", "-m", "1GiB", "--", sys.executable, "-c", TRAP, str(out)],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 9
    p.stdout.close()
    assert out.read_text() == str(int(signal.SIGTERM))


def test_a_signal_before_gpuctl_watches_cmd_still_reaches_cmd(
    host: SimHost, tmp_path: Path
) -> None:
    """The window from letting CMD run to passing signals on: a SIGTERM there once
    ended gpuctl run by default (exit -15) and left CMD running unwatched."""
    cfg = host.write_config("")
    out = tmp_path / "got"
    p = subprocess.Popen(
        [gpuctl_exe(), "run", "-m", "1GiB", "--", sys.executable, "-c", TRAP, str(out)],
        env={**cli_env(cfg), "GPUCTL_FAILPOINTS": "run.after_go=stop"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stderr is not None
        assert "run.after_go: stop" in p.stderr.readline()
        assert p.stdout.readline().strip() == "ready"  # CMD runs; gpuctl is stopped
        deadline = time.monotonic() + 30
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "gpuctl run never stopped at the failpoint"
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
        assert p.wait(timeout=30) == 9
        assert out.read_text() == str(int(signal.SIGTERM))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pipe in (p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


def test_wait_then_runs_once_room_is_made(host: SimHost) -> None:
    cfg = host.write_config("")
    big = host.hold(unique_name("big"), "100GiB")
    p = subprocess.Popen(
        [gpuctl_exe(), "run", "-m", "30GiB", "--wait", "--", "true"],
        env=cli_env(cfg),
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    assert "waiting for room" in p.stderr.readline()
    assert p.poll() is None
    host.stop(big)
    assert p.wait(timeout=60) == 0
    p.stderr.close()
    r = gpuctl(cfg, "run", "-m", "1GiB", "--wait", "--timeout", "1s", "--", "true")
    assert r.returncode == 0


def test_preemptible_job_is_preempted_by_a_higher_priority_service(host: SimHost) -> None:
    """A --preemptible job of priority 30 is stopped (SIGTERM) for an 80 GiB service of
    priority 100 with --preempt; its gpuctl run reports it and returns its exit code; a
    non-preemptible one is never a victim."""
    chat, tag, keep = unique_name("chat"), unique_name("pjob"), unique_name("whisper")
    port = free_port()
    toml = service_toml(chat, port, model_server_command(chat, port, "80GiB", "1s"))
    cfg = host.write_config(toml.replace('memory = "20GiB"', 'memory = "80GiB"\npriority = 100'))
    keeper = subprocess.Popen(
        [gpuctl_exe(), "run", "-m", "15GiB", "-p", "60", "--name", keep, "--", *hold_cmd(keep, 15)],
        env=cli_env(cfg),
    )
    job = subprocess.Popen(
        [
            gpuctl_exe(),
            "run",
            "-m",
            "40GiB",
            "-p",
            "30",
            "--preemptible",
            "--name",
            tag,
            "--",
            *hold_cmd(tag, 40),
        ],
        env=cli_env(cfg),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: claims(host, tag) and claims(host, keep), "both jobs hold memory")
        r = run_ensure(cfg, chat)
        assert r.returncode == 3 and json.loads(r.stdout)["decision"] == "PREEMPTABLE"
        r = run_ensure(cfg, chat, "--preempt")
        assert r.returncode == 0, r.stdout + r.stderr
        _, err = job.communicate(timeout=60)
        assert job.returncode in (143, 0, 1), err  # CMD's own exit after SIGTERM
        assert "preempted" in err
        assert read_record(host, f"run.{tag}")["phase"] == "preempted"
        assert claims(host, keep) and keeper.poll() is None
        assert len(server_pids(chat)) == 1
    finally:
        for p in (job, keeper):
            p.kill()
            p.communicate()
        for pid in claims(host, tag) + claims(host, keep):
            os.kill(pid, signal.SIGKILL)
        kill_servers(chat)


def test_an_unreachable_agent_is_unknown_naming_the_job(tmp_path: Path) -> None:
    """A closed loopback port for the agent: exit 4 before CMD starts, and the line names
    the job (it read 'gpuctl run:  not started: …' with no name)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[hosts.dgx]\nagent = "http://127.0.0.1:{free_port()}"\n')
    marker = tmp_path / "ran"
    r = gpuctl(cfg, "run", "--host", "dgx", "-m", "1GiB", "--", "touch", str(marker))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "gpuctl run: touch not started:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()


def test_timeout_without_a_wait_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--timeout` bounds the queue's wait (--wait) or the wait for the preempted work's
    memory (--preempt); alone it bounded nothing and was taken silently. Now: exit 2, one
    line naming the fix, and CMD never starts."""
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[hosts.box]\nprobe = "sim"\nsim_dir = "{tmp_path / "sim"}"\n')
    marker = tmp_path / "ran"
    r = gpuctl(cfg, "run", "-m", "1GiB", "--timeout", "5s", "--", "touch", str(marker))
    assert r.returncode == 2, r.stdout + r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("gpuctl: error: --timeout") and "--wait" in first, r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()
    # With either wait it is taken (no agent here: the sim GPU read directly, room enough).
    for wait in ("--wait", "--preempt"):
        r = gpuctl(cfg, "run", wait, "-m", "1GiB", "--timeout", "5s", "--", "touch", str(marker))
        assert r.returncode == 0 and marker.exists(), r.stderr
        marker.unlink()


def test_locks_leaves_out_jobs_that_ended_over_an_hour_ago(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every finished `gpuctl run` stayed in `gpuctl locks` as a `stopped` record for
    ever. A job that ended over an hour ago is counted, not listed; --finished lists it."""
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[hosts.box]\nprobe = "sim"\nsim_dir = "{tmp_path / "sim"}"\n')
    for name in ("old", "fresh"):
        assert gpuctl(cfg, "run", "-m", "1GiB", "--name", name, "--", "true").returncode == 0
    # An hour and a bit later, for the old one: the store's own file, as time leaves it.
    path = tmp_path / "state" / "records" / "run.old.json"
    rec = json.loads(path.read_text())
    assert rec["phase"] == "stopped" and rec["handle"] is None and rec["lease"] is None
    rec["since"] -= 3700
    path.write_text(json.dumps(rec))

    env = {**cli_env(cfg), "COLUMNS": "200"}
    r = subprocess.run([gpuctl_exe(), "locks"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "run.fresh" in r.stdout and "run.old" not in r.stdout, r.stdout
    assert "1 `gpuctl run` job that ended over an hour ago not shown" in r.stdout, r.stdout
    obj = json.loads(gpuctl_in_process(cfg, "locks", "--json").stdout)
    assert obj["hidden_jobs"] == 1
    assert [x["service"] for x in obj["records"]] == ["run.fresh"]
    r = subprocess.run(
        [gpuctl_exe(), "locks", "--finished"], env=env, capture_output=True, text=True
    )
    assert "run.old" in r.stdout and "not shown" not in r.stdout, r.stdout
    obj = json.loads(gpuctl_in_process(cfg, "locks", "--finished", "--json").stdout)
    assert obj["hidden_jobs"] == 0
    assert sorted(x["service"] for x in obj["records"]) == ["run.fresh", "run.old"]
    # The name is free again, and its next run is listed (a fresh record).
    assert gpuctl(cfg, "run", "-m", "1GiB", "--name", "old", "--", "true").returncode == 0
    obj = json.loads(gpuctl_in_process(cfg, "locks", "--json").stdout)
    assert obj["hidden_jobs"] == 0 and len(obj["records"]) == 2


def test_only_an_ended_job_that_holds_nothing_is_left_out() -> None:
    from gpuctl.core.jobs import FINISHED_SHOWN_S, finished_long_ago
    from gpuctl.core.record import Failure, Lease, Phase, Record

    now = 10_000_000.0
    old = now - FINISHED_SHOWN_S - 1
    base = Record("run.j", Phase.STOPPED, since=old)
    assert finished_long_ago(base, now)
    assert finished_long_ago(Record("run.j", Phase.PREEMPTED, since=old), now)
    lease = Lease("h", "host", "boot", 42, None, "ensure", now - 5, now + 60)
    kept = [
        Record("run.j", Phase.STOPPED, since=now - 60),  # ended within the hour
        Record("chat", Phase.STOPPED, since=old),  # a service, not a job
        Record("run.j", Phase.RUNNING, since=old, handle={"kind": "run", "pid": 4}),
        Record("run.j", Phase.PREEMPTED, since=old, lease=lease),  # a preemption under way
        Record("run.j", Phase.STOPPED, since=old, handle={"kind": "run", "pid": 4}),
        Record("run.j", Phase.STOPPED, since=old, failure=Failure(old, "x", "", 1, old)),
        Record("run.j", Phase.STOPPED, since=old, recovered="record was unreadable"),
    ]
    for rec in kept:
        assert not finished_long_ago(rec, now), rec
