"""`gpuctl run --preempt`, and preempting run jobs through the agent, end to end on the
simulated GPU (120 GiB): the real agent on loopback, its store, the installed CLI, real
processes holding simulated GPU memory.

A second machine is played by a caller whose idea of "this machine" is another host
(``as_machine``): it reaches the GPU host only through the agent, as a laptop does, and
any local signal it tried to send to a job would fail its run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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
from tests.pid_helpers import OwnPids

GIB = 1024


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


# A job's CMD: claims its memory on the simulated GPU at once (exit 1 with an
# out-of-memory line when it does not fit), then holds it. On SIGTERM it keeps the memory
# for a while (saving a checkpoint), writes the signal's number to argv[3] and exits 75.
JOB = r"""
import os, signal, sys, time
from gpuctl.sim.errors import SimOutOfMemory
from gpuctl.sim.gpu import SimGpu
got = []
signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
with SimGpu(os.environ["GPUCTL_SIM_DIR"]).claim(sys.argv[1], 0) as claim:
    try:
        claim.set(int(sys.argv[2]))
    except SimOutOfMemory as e:
        print("torch.OutOfMemoryError:", e.message, file=sys.stderr, flush=True)
        sys.exit(1)
    print("holding", flush=True)
    while not got:
        time.sleep(0.05)
    time.sleep(float(os.environ.get("JOB_SAVE_S", "0.5")))
open(sys.argv[3], "w").write(str(got[0]))
sys.exit(75)
"""

# The new job's CMD: writes which claims the GPU has as it starts, then claims its own
# memory (exit 1 when it does not fit: the victims' memory was not back).
NEW = r"""
import json, os, sys
from gpuctl.sim.errors import SimOutOfMemory
from gpuctl.sim.gpu import SimGpu
sim = SimGpu(os.environ["GPUCTL_SIM_DIR"])
seen = sorted(c.name for c in sim.claims())
with sim.claim(sys.argv[1], 0) as claim:
    try:
        claim.set(int(sys.argv[2]))
    except SimOutOfMemory as e:
        print("torch.OutOfMemoryError:", e.message, file=sys.stderr, flush=True)
        sys.exit(1)
open(sys.argv[3], "w").write(json.dumps(seen))
"""

# Runs the CLI as if on another machine ("laptop"): procinfo says so, and the local job
# signalling fails loudly, so a job on the GPU host can only be stopped by the agent.
AS_MACHINE = r"""
import sys
from gpuctl.adapters import job_cmd, procinfo
from gpuctl.core.snapshot import HostIdentity
machine = sys.argv[1]
procinfo.host_identity = lambda: HostIdentity(machine, "boot-of-" + machine)
def refuse(*a, **k):
    raise RuntimeError("a local signal to a job from " + machine)
job_cmd.stop_job = job_cmd.signal_job = refuse
sys.argv = ["gpuctl", *sys.argv[2:]]
from gpuctl.cli.app import main
main()
"""


def as_machine(machine: str, *args: str) -> list[str]:
    return [sys.executable, "-c", AS_MACHINE, machine, *args]


def job_cmd(tag: str, gib: int, out: Path) -> list[str]:
    return [sys.executable, "-c", JOB, tag, str(gib * GIB), str(out)]


def new_cmd(tag: str, gib: int, out: Path) -> list[str]:
    return [sys.executable, "-c", NEW, tag, str(gib * GIB), str(out)]


def start_job(
    cfg: Path, tag: str, gib: int, out: Path, *opts: str, prefix: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    """``gpuctl run -m GIB --name TAG OPTS -- JOB``; returns once CMD holds its memory."""
    cmd = [*prefix] if prefix else [gpuctl_exe()]
    p = subprocess.Popen(
        [*cmd, "run", "-m", f"{gib}GiB", "--name", tag, *opts, "--", *job_cmd(tag, gib, out)],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "holding", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def claims(host: SimHost) -> dict[str, int]:
    from gpuctl.sim.gpu import SimGpu

    return {c.name: c.pid for c in SimGpu(host.sim_dir).claims()}


def service(name: str, port: int, gib: int, priority: int, extra: str = "") -> str:
    toml = service_toml(
        name, port, model_server_command(name, port, f"{gib}GiB", "1s"), extra=extra
    )
    return toml.replace('memory = "20GiB"', f'memory = "{gib}GiB"\npriority = {priority}')


def end(host: SimHost, *procs: subprocess.Popen[str]) -> None:
    """Stop the gpuctl runs and their CMDs (in their own sessions, they outlive a kill of
    gpuctl run, and hold its pipes open)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for pid in claims(host).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=60)


@pytest.fixture
def jobs_cleanup(host: SimHost) -> Iterator[list[str]]:
    """Service names to kill afterwards; every claim left on the GPU is killed too."""
    names: list[str] = []
    yield names
    for n in names:
        kill_servers(n)
    for pid in claims(host).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_run_preempt_stops_only_permitted_victims_then_starts_cmd(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """120 GiB: a batch service (30, priority 50), an equal-priority service (20, 70), a
    job that is not --preemptible (15, 10) and a --preemptible one (25, 10) hold 90. A
    75 GiB job of priority 70 fits once the batch and the preemptible job stop: without
    --preempt it exits 3 naming them, CMD never started; with it, exactly those two are
    stopped (the job's own gpuctl run says it was preempted, with CMD's exit code), and
    CMD starts only once their memory is back."""
    batch, peer = unique_name("batch"), unique_name("peer")
    jobs_cleanup += [batch, peer]
    cfg = host.write_config(
        service(batch, free_port(), 30, 50, 'kind = "batch"')
        + "\n"
        + service(peer, free_port(), 20, 70)
    )
    assert run_ensure(cfg, batch).returncode == 0
    assert run_ensure(cfg, peer).returncode == 0
    keep, pjob, new = unique_name("keep"), unique_name("pjob"), unique_name("new")
    keeper = start_job(cfg, keep, 15, tmp_path / "keep.sig", "-p", "10")
    victim = start_job(cfg, pjob, 25, tmp_path / "pjob.sig", "-p", "10", "--preemptible")
    try:
        marker = tmp_path / "new.json"
        args = ("run", "-m", "75GiB", "-p", "70", "--name", new)
        r = gpuctl(cfg, *args, "--", *new_cmd(new, 75, marker))
        assert r.returncode == 3, r.stderr
        assert "fits once" in r.stderr and f"run job run.{pjob}" in r.stderr, r.stderr
        assert batch in r.stderr and "--preempt" in r.stderr, r.stderr
        assert not marker.exists() and new not in claims(host)
        assert len(server_pids(batch)) == 1 and victim.poll() is None

        r = gpuctl(cfg, *args, "--preempt", "--", *new_cmd(new, 75, marker))
        assert r.returncode == 0, r.stderr
        assert "preempted" in r.stderr and f"run.{pjob}" in r.stderr, r.stderr
        # CMD saw neither victim's memory when it started, and its own fitted.
        seen = json.loads(marker.read_text())
        assert pjob not in seen and batch not in seen, seen
        assert keep in seen and peer in seen, seen
        assert server_pids(batch) == [] and len(server_pids(peer)) == 1
        assert keeper.poll() is None and keep in claims(host)
        assert read_record(host, batch)["phase"] == "preempted"
        # The preempted job: its CMD got SIGTERM and ended on its own; its gpuctl run
        # says so and returns CMD's exit code.
        _, err = victim.communicate(timeout=60)
        assert victim.returncode == 75, err
        assert f"{pjob} was preempted" in err, err
        assert (tmp_path / "pjob.sig").read_text() == str(int(signal.SIGTERM))
        assert read_record(host, f"run.{pjob}")["phase"] == "preempted"
        assert read_record(host, f"run.{keep}")["phase"] == "running"
    finally:
        end(host, keeper, victim)


def test_run_preempt_stops_a_job_on_the_gpu_host_through_the_agent(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """A --preemptible job runs on the GPU host; `gpuctl run --preempt` from a laptop
    (another machine, the agent's store) stops it through the agent: the job's CMD gets
    SIGTERM, its gpuctl run reports the preemption, and the laptop's job starts."""
    cfg = host.write_config("")
    pjob, new = unique_name("pjob"), unique_name("new")
    victim = start_job(cfg, pjob, 60, tmp_path / "pjob.sig", "-p", "10", "--preemptible")
    try:
        marker = tmp_path / "new.json"
        r = subprocess.run(
            as_machine(
                "laptop",
                "run",
                "-m",
                "80GiB",
                "-p",
                "50",
                "--name",
                new,
                "--preempt",
                "--",
                *new_cmd(new, 80, marker),
            ),
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert f"preempted run.{pjob}" in r.stderr, r.stderr
        assert pjob not in json.loads(marker.read_text())
        _, err = victim.communicate(timeout=60)
        assert victim.returncode == 75 and f"{pjob} was preempted" in err, err
        assert (tmp_path / "pjob.sig").read_text() == str(int(signal.SIGTERM))
        assert read_record(host, f"run.{pjob}")["phase"] == "preempted"
    finally:
        end(host, victim)


def test_a_job_nobody_here_can_signal_is_no_victim(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """A --preemptible job whose record says it runs on a workstation (neither this
    machine nor the agent's) is never planned: BUSY, naming why, and it keeps running."""
    cfg = host.write_config("")
    pjob = unique_name("pjob")
    victim = start_job(
        cfg,
        pjob,
        60,
        tmp_path / "pjob.sig",
        "-p",
        "10",
        "--preemptible",
        prefix=tuple(as_machine("workstation")),
    )
    try:
        marker = tmp_path / "never"
        r = gpuctl(cfg, "run", "-m", "80GiB", "-p", "50", "--preempt", "--", "touch", str(marker))
        assert r.returncode == 3, r.stderr
        assert "not stoppable" in r.stderr and "on workstation" in r.stderr, r.stderr
        assert not marker.exists() and victim.poll() is None and pjob in claims(host)
    finally:
        end(host, victim)


# ---- the agent's endpoint, asked directly


def post(host: SimHost, job: str, body: Any, token: str | None = "") -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token or host.token}"}
    return httpx.post(
        f"{host.agent_url}/records/{job}/stop",
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )


def lease(host: SimHost, job: str) -> str:
    """Take the job's lease as a preemption does; returns the holder id."""
    from gpuctl.adapters.store import holder_here

    h = holder_here("preempt")
    r = httpx.post(
        f"{host.agent_url}/records/{job}/lease",
        json={"holder": h.to_dict(), "ttl_s": 60},
        headers={"Authorization": f"Bearer {host.token}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["granted"], r.text
    return h.id


def release(host: SimHost, job: str, holder: str) -> None:
    """Give the lease back with phase preempted, as a preemption does after the stop."""
    r = httpx.post(
        f"{host.agent_url}/records/{job}/lease/release",
        json={"holder": holder, "update": {"phase": "preempted"}},
        headers={"Authorization": f"Bearer {host.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_the_stop_endpoint_refuses_all_but_a_held_preemptible_job(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    cfg = host.write_config("")
    keep, pjob = unique_name("keep"), unique_name("pjob")
    keeper = start_job(cfg, keep, 10, tmp_path / "keep.sig", "-p", "10")
    victim = start_job(cfg, pjob, 10, tmp_path / "pjob.sig", "--preemptible")
    try:
        k, v = f"run.{keep}", f"run.{pjob}"
        hk = read_record(host, k)["handle"]
        hv = read_record(host, v)["handle"]
        body_k = {"holder": lease(host, k), "pid": hk["pid"], "pid_start": hk["pid_start"]}
        holder = lease(host, v)
        body = {"holder": holder, "pid": hv["pid"], "pid_start": hv["pid_start"], "grace_s": 5}

        def refused(job: str, b: Any, status: int, words: str, token: str | None = "") -> None:
            r = post(host, job, b, token)
            assert r.status_code == status, (r.status_code, r.text)
            assert words in r.json()["error"], r.text

        # Auth: the write token only.
        refused(v, body, 401, "requires a bearer token", token=None)
        refused(v, body, 401, "wrong", token="not-the-token")
        # Bad bodies: 400 naming the field.
        refused(v, b"{", 400, "")
        refused(v, {**body, "pid": "1"}, 400, "pid")
        refused(v, {**body, "pid": 0}, 400, "pid")
        refused(v, {**body, "pid_start": -1}, 400, "pid_start")
        refused(v, b'{"holder": "x", "pid": 5, "pid_start": NaN}', 400, "")
        refused(v, {k2: x for k2, x in body.items() if k2 != "holder"}, 400, "holder")
        refused(v, {**body, "grace_s": 3600}, 400, "grace_s")
        refused(v, {**body, "signal": 9}, 400, "signal")
        refused("..bad", body, 400, "invalid service name")
        # Not a live preemptible run record naming that pid.
        refused("someservice", body, 404, "not a run job")
        refused(f"run.{unique_name('none')}", body, 404, "no running job")
        refused(k, body_k, 403, "not started with --preemptible")
        refused(v, {**body, "pid": hk["pid"]}, 409, "names pid")
        refused(v, {**body, "pid_start": hv["pid_start"] + 5}, 409, "names pid")
        refused(v, {**body, "holder": "someone-else"}, 409, "does not hold the lease")
        # Nothing was signalled.
        assert keeper.poll() is None and victim.poll() is None
        assert not (tmp_path / "pjob.sig").exists()
        # The one request that passes: SIGTERM, and CMD ends within the grace period.
        r = post(host, v, body)
        assert r.status_code == 200 and r.json() == {"killed": False}, r.text
        assert (tmp_path / "pjob.sig").read_text() == str(int(signal.SIGTERM))
        release(host, v, holder)
        _, err = victim.communicate(timeout=60)
        assert victim.returncode == 75 and f"{pjob} was preempted" in err, err
        # Once it has ended there is nothing left to signal.
        refused(v, body, 404, "no running job")
    finally:
        end(host, keeper, victim)


def patch(host: SimHost, job: str, holder: str, update: dict[str, Any]) -> None:
    r = httpx.patch(
        f"{host.agent_url}/records/{job}",
        json={"holder": holder, "update": update},
        headers={"Authorization": f"Bearer {host.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_a_forged_job_record_never_gets_a_process_signalled(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """The attack: the write token leases run.NAME and PATCHes its record to name a pid
    gpuctl run did not start (a `sleep` leading its own session), with its real start
    time, this host and boot, preemptible. The stop is refused (403) and nothing is
    signalled; so is a forged record naming a real preemptible job's pid and nonce under
    another job's name, and a non-preemptible job's record made preemptible. The real
    job is still stopped through its own record."""
    from gpuctl.adapters import procinfo

    here = procinfo.host_identity()
    cfg = host.write_config("")
    keep, pjob = unique_name("keep"), unique_name("pjob")
    keeper = start_job(cfg, keep, 10, tmp_path / "keep.sig", "-p", "10")
    victim = start_job(cfg, pjob, 10, tmp_path / "pjob.sig", "--preemptible")
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        hv = read_record(host, f"run.{pjob}")["handle"]
        start = procinfo.start_time(sleeper.pid)
        assert start is not None

        def forge(job: str, pid: int, pid_start: float, **extra: Any) -> Any:
            holder = lease(host, job)
            handle = {
                "kind": "run",
                "pid": pid,
                "pid_start": pid_start,
                "memory_mib": 1024,
                "priority": 0,
                "preemptible": True,
                "host": here.hostname,
                "boot_id": here.boot_id,
                "command": "sleep",
                **extra,
            }
            patch(host, job, holder, {"phase": "running", "handle": handle})
            r = post(host, job, {"holder": holder, "pid": pid, "pid_start": pid_start})
            return r

        for extra in ({}, {"run_nonce": "0" * 32}, {"run_nonce": hv["run_nonce"]}):
            r = forge(f"run.{unique_name('evil')}", sleeper.pid, start, **extra)
            assert r.status_code == 403, r.text
            assert "not run." in r.json()["error"] or "no run nonce" in r.json()["error"]
        # Another job's real CMD and its real nonce, under the attacker's job name.
        evil = f"run.{unique_name('evil')}"
        r = forge(evil, hv["pid"], hv["pid_start"], run_nonce=hv["run_nonce"])
        assert r.status_code == 403 and "not run." in r.json()["error"], r.text
        # A real job started without --preemptible, its record made preemptible.
        hk = read_record(host, f"run.{keep}")["handle"]
        r = forge(f"run.{keep}", hk["pid"], hk["pid_start"], run_nonce=hk["run_nonce"])
        assert r.status_code == 403 and "--preemptible mark" in r.json()["error"], r.text
        # Nothing was signalled: the sleep, the keeper and the victim all live.
        time.sleep(0.5)
        assert sleeper.poll() is None and keeper.poll() is None and victim.poll() is None
        assert not (tmp_path / "pjob.sig").exists() and not (tmp_path / "keep.sig").exists()
        # The real preemptible job, through its own record: stopped.
        v = f"run.{pjob}"
        holder = lease(host, v)
        r = post(host, v, {"holder": holder, "pid": hv["pid"], "pid_start": hv["pid_start"]})
        assert r.status_code == 200 and r.json() == {"killed": False}, r.text
        release(host, v, holder)
        _, err = victim.communicate(timeout=60)
        assert victim.returncode == 75 and f"{pjob} was preempted" in err, err
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        end(host, keeper, victim)


def test_verify_job_refuses_an_unreadable_environment(tmp_path: Path) -> None:
    """An environment the stopper cannot read is a refusal, never a signal."""
    from gpuctl.adapters.job_cmd import verify_job
    from gpuctl.errors import LauncherError

    with pytest.raises(LauncherError, match="cannot read pid 4242's environment"):
        verify_job(4242, "j", "a" * 32, proc_root=str(tmp_path))
    # A session leader carrying every mark passes; one that leads no session does not.
    d = tmp_path / "4242"
    d.mkdir()
    marks = b"GPUCTL_RUN_JOB=j\0GPUCTL_RUN_NONCE=" + b"a" * 32 + b"\0GPUCTL_RUN_PREEMPTIBLE=1\0"
    (d / "environ").write_bytes(marks)
    (d / "stat").write_text("4242 (x y) S 1 4242 4242 0")
    verify_job(4242, "j", "a" * 32, proc_root=str(tmp_path))
    (d / "stat").write_text("4242 (x y) S 1 4242 17 0")
    with pytest.raises(LauncherError, match="does not lead its own session"):
        verify_job(4242, "j", "a" * 32, proc_root=str(tmp_path))


def test_the_stop_endpoint_kills_a_job_that_outlives_its_grace(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    cfg = host.write_config("")
    pjob = unique_name("pjob")
    env = {**cli_env(cfg), "JOB_SAVE_S": "600"}
    p = subprocess.Popen(
        [
            gpuctl_exe(),
            "run",
            "-m",
            "10GiB",
            "--name",
            pjob,
            "--preemptible",
            "--",
            *job_cmd(pjob, 10, tmp_path / "sig"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "holding"
        v = f"run.{pjob}"
        h = read_record(host, v)["handle"]
        holder = lease(host, v)
        t0 = time.monotonic()
        r = post(
            host, v, {"holder": holder, "pid": h["pid"], "pid_start": h["pid_start"], "grace_s": 1}
        )
        assert r.status_code == 200 and r.json() == {"killed": True}, r.text
        # It had its grace period before the SIGKILL.
        assert time.monotonic() - t0 >= 1.0
        release(host, v, holder)
        p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGKILL
    finally:
        end(host, p)


def test_the_room_a_run_preempt_makes_is_kept_for_it(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """Between its victims' stops and CMD's start, `gpuctl run --preempt` keeps the room
    it made: its record is `starting` with its budget, so a resume of the preempted batch
    in that window is BUSY naming the job, and CMD then gets its memory. (Without the
    promise, that resume started the batch in the room made for the job.)"""
    batch, new = unique_name("batch"), unique_name("new")
    jobs_cleanup.append(batch)
    cfg = host.write_config(service(batch, free_port(), 30, 50, 'resume = true\nkind = "batch"'))
    assert run_ensure(cfg, batch).returncode == 0
    env = cli_env(cfg)
    env["GPUCTL_FAILPOINTS"] = "preempt.after_stops=sleep:3"  # widen the window
    marker = tmp_path / "new.json"
    preempting = subprocess.Popen(
        [
            gpuctl_exe(),
            "run",
            "-m",
            "100GiB",
            "-p",
            "100",
            "--name",
            new,
            "--preempt",
            "--",
            *new_cmd(new, 100, marker),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while read_record(host, batch)["phase"] != "preempted" or server_pids(batch):
            assert time.time() < deadline and preempting.poll() is None, preempting.communicate()
            time.sleep(0.05)
        promise = read_record(host, f"run.{new}")
        assert promise["phase"] == "starting" and promise["handle"]["memory_mib"] == 100 * GIB
        r = gpuctl_in_process(cfg, "resume", batch, "--json")
        assert r.returncode == 3, r.stdout + r.stderr
        assert f"run.{new}" in json.loads(r.stdout)["reason"], r.stdout
        _, err = preempting.communicate(timeout=60)
        assert preempting.returncode == 0, err
        assert batch not in json.loads(marker.read_text())
        assert read_record(host, f"run.{new}")["phase"] == "stopped"
        # Once CMD has ended, its gpuctl run brings the preempted batch back.
        assert f"resumed {batch}" in err, err
    finally:
        end(host, preempting)


def test_job_stopper_routes_by_where_cmd_runs() -> None:
    """The stopper's one rule (core.jobs.job_route), as the planner's: this machine's job
    is signalled here, the agent's machine's through the agent (with the lease holder,
    pid and start time), any other refused; and without an agent only here."""
    from gpuctl.core.jobs import JOB_GRACE_S
    from gpuctl.core.snapshot import HostIdentity, Snapshot
    from gpuctl.errors import LauncherError
    from gpuctl.wiring.build import job_stopper

    here, dgx = HostIdentity("laptop", "b1"), HostIdentity("dgx", "b2")
    local: list[dict[str, Any]] = []

    def stop_here(h: dict[str, Any], job: str) -> bool:
        local.append(h)
        return False

    asked: list[tuple[object, ...]] = []

    def agent_stop(*args: object) -> bool:
        asked.append(args)
        return True

    snap = Snapshot(None, None, False, "sim", "2026-11-30T00:00:00.000Z", host=dgx)
    stop = job_stopper(here, stop_here, agent_stop)

    def handle(host: str, boot: str) -> dict[str, Any]:
        return {"kind": "run", "pid": 4242, "pid_start": 17.5, "host": host, "boot_id": boot}

    assert stop("run.a", handle("laptop", "b1"), "h1", snap) is False
    assert local == [handle("laptop", "b1")] and asked == []
    assert stop("run.b", handle("dgx", "b2"), "h2", snap) is True
    assert asked == [("run.b", "h2", 4242, 17.5, JOB_GRACE_S)]
    with pytest.raises(LauncherError, match="a run job on ws"):
        stop("run.c", handle("ws", "b3"), "h3", snap)
    with pytest.raises(LauncherError, match="no agent"):
        job_stopper(here, stop_here, None)("run.d", handle("dgx", "b2"), "h4", snap)
    assert len(local) == 1 and len(asked) == 1


def test_a_promise_is_given_back_once_the_job_no_longer_needs_room(tmp_path: Path) -> None:
    """The store on disk, no agent: a `run --preempt` job's promise (record `starting`
    with its budget, under its lease) is taken when it preempts, and given back (the
    record as it was, no lease) when a later look is no longer PREEMPTABLE, so a job
    that then waits holds no memory it does not use."""
    from types import SimpleNamespace

    from gpuctl.adapters.machine import ThisMachine
    from gpuctl.adapters.store import holder_here
    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.core.decision import Decision, Verdict
    from gpuctl.core.jobs import JobSpec, job_spec
    from gpuctl.core.plan import Plan, Victim
    from gpuctl.flows.run.room import Preemption

    store = DirectStore(tmp_path / "state")
    told: list[str] = []
    deps = SimpleNamespace(
        config=None,
        store=store,
        stop_job=None,
        launcher_for=None,
        clock=time.time,
        sleep=time.sleep,
        tell=told.append,
        server_in_flight=None,
        machine=ThisMachine(),
    )
    spec = JobSpec("run.big", 80 * GIB, 100)
    pre = Preemption(deps, spec, [], "python")  # type: ignore[arg-type]
    # A plan whose victim's lease cannot be taken: the preemption goes stale at once
    # (nothing stopped), and the job looks again.
    busy = holder_here("test")
    assert store.acquire("run.victim", busy, 60)[0]
    plan = Plan(0, (Victim("run.victim", 0, 40 * GIB, 10, job=True),), 80 * GIB, 50 * GIB)
    verdict = Verdict("run.big", Decision.PREEMPTABLE, "fits once …", plan=plan)
    assert pre.make_room(verdict, None, time.time() + 30, lambda: verdict) is None
    rec = store.get("run.big")
    assert rec.phase.value == "starting" and rec.lease is not None
    promised = job_spec(rec)
    assert promised is not None and promised.memory_mib == 80 * GIB and promised.pid is None
    # The next look: BUSY (its room went elsewhere): the promise is given back.
    busy_verdict = Verdict("run.big", Decision.BUSY, "held by others")
    assert pre.make_room(busy_verdict, None, time.time() + 30, lambda: busy_verdict) is False
    rec = store.get("run.big")
    assert rec.phase.value == "stopped" and rec.lease is None and rec.handle is None
    assert pre.holder is None


def wait_running(host: SimHost, job: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            rec = read_record(host, job)
            if rec["phase"] == "running" and (rec.get("handle") or {}).get("pid"):
                return rec
        time.sleep(0.1)
    raise AssertionError(f"{job} never ran")


def test_a_job_whose_cmd_shows_no_memory_yet_is_still_a_victim(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """A job's CMD alive (pid recorded) but not on the GPU yet counts at its budget as
    starting: a --preemptible one is still preempted; a plain one is refused with why."""
    cfg = host.write_config("")
    pj, keep = unique_name("pj"), unique_name("keep")
    common = ("run", "--priority", "5", "--memory", "100GiB")
    victim = subprocess.Popen(
        [gpuctl_exe(), *common, "--preemptible", "--name", pj, "--", "sleep", "600"],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pj_pid = 0
    try:
        pj_pid = wait_running(host, f"run.{pj}")["handle"]["pid"]
        r = gpuctl(cfg, "run", "--preempt", "--priority", "6", "--memory", "30GiB", "--", "true")
        assert r.returncode == 0, r.stderr
        victim.communicate(timeout=60)
        assert pj in r.stderr, r.stderr
    finally:
        if victim.poll() is None:
            victim.kill()
        if pj_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pj_pid, signal.SIGKILL)
        victim.communicate(timeout=60)
    keeper = subprocess.Popen(
        [gpuctl_exe(), *common, "--name", keep, "--", "sleep", "600"],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cmd_pid = 0
    try:
        cmd_pid = wait_running(host, f"run.{keep}")["handle"]["pid"]
        r = gpuctl(cfg, "run", "--preempt", "--priority", "6", "--memory", "30GiB", "--", "true")
        assert r.returncode == 3, r.stderr
        assert "not --preemptible" in r.stderr, r.stderr
        assert keeper.poll() is None
    finally:
        keeper.kill()
        if cmd_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(cmd_pid, signal.SIGKILL)
        keeper.communicate(timeout=60)


# A job's CMD that takes SIGTERM as a note (writes argv[1]) and runs on: its stop waits
# out the whole grace period.
DEAF = r"""
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda n, f: pathlib.Path(sys.argv[1]).write_text("term"))
print("holding", flush=True)
while True:
    time.sleep(1)
"""


def test_slow_job_stops_never_hold_record_reads(
    host: SimHost, tmp_path: Path, jobs_cleanup: list[str]
) -> None:
    """As many stops as the shared thread pool has threads (cpu + 4, at most 32: six once
    held GET /records for 27.9 s), of jobs that outlive SIGTERM, with a long grace: GET
    /records answers while every one of them is still under way."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuctl.agent.store_api import STOP_WORKERS

    n = min(32, (os.cpu_count() or 1) + 4)
    cfg = host.write_config("")
    procs: list[subprocess.Popen[str]] = []
    pids = OwnPids()  # killed at the end only while still the job's CMD
    pool = ThreadPoolExecutor(n)
    try:
        stops = []
        for i in range(n):
            tag = unique_name("deaf")
            cmd = [sys.executable, "-c", DEAF, str(tmp_path / f"term{i}")]
            p = subprocess.Popen(
                [gpuctl_exe(), "run", "-m", "1GiB", "--name", tag, "--preemptible", "--", *cmd],
                env=cli_env(cfg),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "holding"
            v = f"run.{tag}"
            h = read_record(host, v)["handle"]
            pids.append(h["pid"])
            body = {"holder": lease(host, v), "pid": h["pid"], "pid_start": h["pid_start"]}
            stops.append(pool.submit(post, host, v, {**body, "grace_s": 120}))
        # Every stop that has a thread has sent its SIGTERM: it is in its grace period.
        deadline = time.monotonic() + 60
        while sum((tmp_path / f"term{i}").exists() for i in range(n)) < min(n, STOP_WORKERS):
            assert time.monotonic() < deadline, "the stops did not begin"
            time.sleep(0.05)
        r = httpx.get(
            f"{host.agent_url}/records",
            headers={"Authorization": f"Bearer {host.token}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert not any(s.done() for s in stops), "a stop ended before the read was answered"
    finally:
        pids.kill_all(group=True)
        pool.shutdown(wait=True)
        end(host, *procs)
