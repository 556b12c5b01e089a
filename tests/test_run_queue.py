"""`gpuctl run --wait` queues in the host's store: separate processes against a simulated
GPU (120 GiB) and its agent (and once without one, on the store's files), proving the
order by which job's CMD gets the memory first. The pure rule is table-tested in
``test_queue.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl, gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import agent_host, cli_env, direct_config, unique_name
from tests.test_run import claims, hold_cmd, wait_for

ROOT = Path(__file__).resolve().parents[1]
JOB_GIB = 30


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


class Jobs:
    """The `gpuctl run --wait` callers of a test, each holding 30 GiB once it runs."""

    def __init__(self, host: SimHost, cfg: Path, env: dict[str, str] | None = None) -> None:
        self.host, self.cfg = host, cfg
        self.env = {**cli_env(cfg), **(env or {})}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.tag = unique_name("q")

    def name(self, short: str) -> str:
        return f"{self.tag}{short}"

    def wait(self, short: str, priority: int, *extra: str) -> subprocess.Popen[str]:
        n = self.name(short)
        p = subprocess.Popen(
            [
                gpuctl_exe(),
                "run",
                "--wait",
                "-m",
                f"{JOB_GIB}GiB",
                "-p",
                str(priority),
                "--name",
                n,
                *extra,
                "--",
                *hold_cmd(n, JOB_GIB),
            ],
            env=self.env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs[short] = p
        return p

    def queued(self) -> list[str]:
        """The queue as `gpuctl locks --json` shows it: short names, in order."""
        obj = locks(self.cfg)
        return [q["name"].removeprefix(f"run.{self.tag}") for q in obj["queue"]]

    def running(self) -> list[str]:
        return [s for s in self.procs if claims(self.host, self.name(s))]

    def finish(self, short: str) -> None:
        """End the job's CMD (it holds its memory until then; on SIGTERM it lets go and
        exits 0): its gpuctl run returns CMD's exit code."""
        (pid,) = claims(self.host, self.name(short))
        os.kill(pid, signal.SIGTERM)
        assert self.procs[short].wait(timeout=60) == 0

    def ended(self) -> dict[str, tuple[int, str]]:
        """The callers that exited: their exit code and stderr (for a failing assert)."""
        out = {}
        for short, p in self.procs.items():
            if p.poll() is not None and p.stderr is not None and not p.stderr.closed:
                out[short] = (p.returncode, p.stderr.read())
                p.stderr.close()
        return out

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()
            if p.stderr is not None:
                p.stderr.close()
        for s in self.procs:
            for pid in claims(self.host, self.name(s)):
                os.kill(pid, signal.SIGKILL)


def locks(cfg: Path) -> dict[str, Any]:
    """`gpuctl locks --json`, checked against its schema. In process: the tests poll it
    while the queue forms, and a spawned interpreter per look would cost the CPU the
    callers under test need."""
    r = gpuctl_in_process(cfg, "locks", "--json")
    obj: dict[str, Any] = json.loads(r.stdout)
    schema = json.loads((ROOT / "schemas" / "locks.schema.json").read_text())
    jsonschema.validate(obj, schema)
    return obj


def full_gpu(host: SimHost) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """70 + 30 GiB held by processes gpuctl did not start: 20 GiB free, no job fits.
    Stopping the 30 GiB one makes room for exactly one 30 GiB job."""
    big, small = unique_name("big"), unique_name("small")
    procs = host.hold(big, "70GiB"), host.hold(small, "30GiB")

    # Until both hold their memory a job fits and is admitted at once, never queued (a
    # loaded CI run saw the first `run --wait` start its CMD and print no wait line).
    def held_mib() -> int:
        from gpuctl.sim.gpu import SimGpu

        return sum(c.memory_mib for c in SimGpu(host.sim_dir).claims() if c.name in (big, small))

    wait_for(lambda: held_mib() == 100 * 1024, "the GPU is full")
    return procs


@pytest.mark.slow
def test_priority_then_arrival_one_at_a_time(host: SimHost) -> None:
    """Arrivals: low (10), eq1 (50), eq2 (50), high (90). With room for one job at a time,
    they run high, eq1, eq2, low: priority first, then arrival, never two at once."""
    cfg = host.write_config("")
    _, small = full_gpu(host)
    jobs = Jobs(host, cfg)
    try:
        for short, prio in (("low", 10), ("eq1", 50), ("eq2", 50), ("high", 90)):
            p = jobs.wait(short, prio)
            assert p.stderr is not None
            assert "waiting for room" in p.stderr.readline()
            wait_for(lambda s=short: s in jobs.queued(), f"{short} is queued")  # type: ignore[misc]
        assert jobs.queued() == ["high", "eq1", "eq2", "low"]
        text = gpuctl_in_process(cfg, "locks")
        assert "waiting (run --wait)" in text.stdout and jobs.name("high") in text.stdout
        host.stop(small)
        for turn, short in enumerate(("high", "eq1", "eq2", "low")):
            wait_for(lambda s=short: jobs.running() == [s], f"{short} runs alone")  # type: ignore[misc]
            left = ["high", "eq1", "eq2", "low"][turn + 1 :]
            assert jobs.queued() == left, jobs.ended()  # admitted: out; the rest in order
            jobs.finish(short)
        assert jobs.queued() == []
    finally:
        jobs.close()


def test_a_waiter_killed_with_kill_9_leaves_nothing_and_blocks_no_one(host: SimHost) -> None:
    cfg = host.write_config("")
    _, small = full_gpu(host)
    jobs = Jobs(host, cfg)
    try:
        head = jobs.wait("head", 90)
        wait_for(lambda: jobs.queued() == ["head"], "head is queued")
        jobs.wait("next", 50)
        wait_for(lambda: jobs.queued() == ["head", "next"], "next is queued behind it")
        head.kill()
        head.wait()
        obj = locks(cfg)
        assert [q["name"] for q in obj["queue"]] == [f"run.{jobs.name('next')}"]
        assert obj["queue"][0]["position"] == 1 and obj["queue"][0]["priority"] == 50
        entries = list((host.state_dir / "queue").glob("*.json"))
        assert len(entries) == 1  # the dead one's file is gone, not just skipped
        host.stop(small)
        wait_for(lambda: jobs.running() == ["next"], "next runs")
        assert jobs.queued() == []
    finally:
        jobs.close()


@pytest.mark.parametrize(
    ("how", "code"),
    [("sigint", 130), ("sigterm", 128 + signal.SIGTERM), ("timeout", 5)],
)
def test_a_waiter_that_gives_up_leaves_the_queue_itself(host: SimHost, how: str, code: int) -> None:
    """Ctrl-C, SIGTERM or --timeout: the caller takes its own entry out (no reader has
    to find it dead), and nothing ran."""
    cfg = host.write_config("")
    full_gpu(host)
    jobs = Jobs(host, cfg)
    try:
        p = jobs.wait("quitter", 50, *(["--timeout", "3s"] if how == "timeout" else []))
        assert p.stderr is not None and "waiting for room" in p.stderr.readline()
        files = host.state_dir / "queue"
        wait_for(lambda: len(list(files.glob("*.json"))) == 1, "its entry is written")
        if how != "timeout":
            p.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        assert p.wait(timeout=60) == code
        assert list(files.glob("*.json")) == []
        assert jobs.running() == []
        if how == "timeout":  # it did wait: the hint is a longer wait, not --wait again
            rest = p.stderr.read()
            assert "a longer --timeout" in rest and "with --wait" not in rest, rest
    finally:
        jobs.close()


def test_a_job_that_does_not_wait_goes_only_ahead_of_lower_priorities(host: SimHost) -> None:
    """A 30 GiB waiter (priority 50) is queued; 20 GiB are free. A 1 GiB job of priority
    50 without --wait would fit, but it arrives behind the waiter: exit 3 naming it. One
    of priority 60 is ahead of everyone queued, and runs."""
    cfg = host.write_config("")
    full_gpu(host)
    jobs = Jobs(host, cfg)
    try:
        jobs.wait("w", 50)
        wait_for(lambda: jobs.queued() == ["w"], "w is queued")
        r = gpuctl(cfg, "run", "-m", "1GiB", "-p", "50", "--", "true")
        assert r.returncode == 3, r.stderr
        assert f"queued behind run.{jobs.name('w')}" in r.stderr
        assert gpuctl(cfg, "run", "-m", "1GiB", "-p", "60", "--", "true").returncode == 0
        # Larger than the GPU: no wait can help, so it does not queue (exit 3 at once).
        r = gpuctl(cfg, "run", "--wait", "-m", "200GiB", "--", "true")
        assert r.returncode == 3 and "never fit" in r.stderr
        assert jobs.queued() == ["w"]
    finally:
        jobs.close()


def test_the_queue_on_the_store_files_without_an_agent(host: SimHost) -> None:
    """The same order through the direct store (the GPU host's own files)."""
    cfg = direct_config(host, "")
    _, small = full_gpu(host)
    jobs = Jobs(host, cfg)
    try:
        jobs.wait("first", 40)
        wait_for(lambda: jobs.queued() == ["first"], "first is queued")
        jobs.wait("second", 80)
        wait_for(lambda: jobs.queued() == ["second", "first"], "second goes ahead")
        host.stop(small)
        wait_for(lambda: jobs.running() == ["second"], "second runs first")
        assert jobs.queued() == ["first"]
        jobs.finish("second")
        wait_for(lambda: jobs.running() == ["first"], "then first")
    finally:
        jobs.close()


def test_a_job_not_on_the_gpu_yet_counts_at_its_budget(host: SimHost) -> None:
    """With no services configured (no keywords to match), a job whose CMD has not
    touched the GPU yet still counts at its budget: the next job is BUSY, naming it. (It
    did not: the agent was asked without `match`, so it listed no recorded servers in
    `starting`, and two jobs admitted a moment apart were both let in: an OOM.)"""
    cfg = host.write_config("")
    host.hold(unique_name("big"), "70GiB")
    tag = unique_name("idle")
    job = subprocess.Popen(
        [gpuctl_exe(), "run", "-m", "30GiB", "--name", tag, "--", "sleep", "60"],
        env=cli_env(cfg),
    )
    try:
        wait_for(lambda: (host.state_dir / "records" / f"run.{tag}.json").exists(), "recorded")
        r = gpuctl(cfg, "run", "-m", "30GiB", "--", "true")
        assert r.returncode == 3 and f"run.{tag}" in r.stderr, r.stderr
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)


@pytest.mark.slow
def test_the_head_keeps_its_place_while_another_start_holds_the_admission_lock(
    host: SimHost,
) -> None:
    """The head waits inside the admission lock's wait (another start holds it) for
    longer than an entry lives without renewal: its naps there renew it, so it is still
    first when the lock is free, and runs first. The entries live 6 s here, not
    QUEUE_TTL_S (15 s), through the test-only ``run_queue.ttl`` failpoint: three beats
    (BEAT_S) still fit in one life."""
    from gpuctl.adapters.store import holder_here
    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.core.record import ADMISSION_TTL_MAX_S
    from gpuctl.flows.admission import ADMISSION
    from gpuctl.flows.run.place import BEAT_S

    ttl_s = 3 * BEAT_S
    cfg = host.write_config("")
    _, small = full_gpu(host)
    jobs = Jobs(host, cfg, env={"GPUCTL_FAILPOINTS": f"run_queue.ttl=seconds:{ttl_s}"})
    store = DirectStore(host.state_dir)
    other = holder_here("ensure")
    try:
        jobs.wait("head", 90)
        wait_for(lambda: jobs.queued() == ["head"], "head is queued")
        jobs.wait("next", 50)
        wait_for(lambda: jobs.queued() == ["head", "next"], "next is queued")
        # The waiters take the admission lock for a moment on each look: until it is ours.
        term = ADMISSION_TTL_MAX_S
        wait_for(lambda: store.acquire(ADMISSION, other, term)[0], "the admission lock is ours")
        first = {q["name"]: q["seq"] for q in locks(cfg)["queue"]}
        # Past the entry's life without a renewal, holding the lock (renewed) throughout.
        until = time.monotonic() + ttl_s + 3
        while time.monotonic() < until:
            time.sleep(1.0)
            store.renew(ADMISSION, other.id, term)
        obj = locks(cfg)
        assert {q["name"]: q["seq"] for q in obj["queue"]} == first  # same places
        store.release(ADMISSION, other.id)
        host.stop(small)
        wait_for(lambda: jobs.running() == ["head"], "head runs first")
        assert jobs.queued() == ["next"]
    finally:
        store.release(ADMISSION, other.id)
        jobs.close()


def test_a_forged_head_that_can_never_fit_blocks_no_one(host: SimHost) -> None:
    """The attacker's stuck queue, within the term cap: an entry of priority 1,000,000,
    larger than the GPU, held by a live process of this host and renewed for 290 s. A
    job without --wait and one with it both run: the head is skipped, not waited on. The
    same entry held by pid 1 is void (pid 1 is never a caller)."""
    from tests.test_queue import forged

    cfg = host.write_config("")
    queue = host.state_dir / "queue"
    queue.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (queue / "forged1.json").write_text(
        json.dumps(forged("forged1", granted=now, expires=now + 290))
    )
    assert [q["name"] for q in locks(cfg)["queue"]] == []  # void: held by pid 1
    holder = subprocess.Popen(["sleep", "300"])
    try:
        (queue / "forged9.json").write_text(
            json.dumps(forged("forged9", granted=now, expires=now + 290, pid=holder.pid))
        )
        assert [q["name"] for q in locks(cfg)["queue"]] == ["run.forged"]  # there, live
        r = gpuctl(cfg, "run", "-m", "1GiB", "-p", "10", "--", "true")
        assert r.returncode == 0, r.stderr
        r = gpuctl(cfg, "run", "--wait", "--timeout", "60s", "-m", "1GiB", "--", "true")
        assert r.returncode == 0, r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_service_does_not_jump_a_higher_priority_waiter(host: SimHost) -> None:
    """The attacker's priority inversion, on the 120 GiB sim GPU: 60 GiB held by a stranger,
    hi (70 GiB, priority 90) waits in the queue. ensure of low (50 GiB, priority 10) would
    fit in the 60 GiB free but take hi's room: BUSY naming hi. ensure of top (50 GiB,
    priority 95, above hi) starts. Once top and the stranger go, hi runs first; then low
    starts beside it."""
    from gpuctl.sim.host import free_port
    from tests.ensure_helpers import kill_servers, model_server_command, run_ensure, service_toml

    low, top = unique_name("low"), unique_name("top")
    toml = ""
    for svc, prio in ((low, 10), (top, 95)):
        port = free_port()
        t = service_toml(svc, port, model_server_command(svc, port, "50GiB", "1s"))
        toml += t.replace('memory = "20GiB"', f'memory = "50GiB"\npriority = {prio}') + "\n"
    cfg = host.write_config(toml)
    stranger = host.hold(unique_name("big"), "60GiB")
    jobs = Jobs(host, cfg)
    try:
        p = jobs.wait("hi", 90, "-m", "70GiB")
        assert p.stderr is not None and "waiting for room" in p.stderr.readline()
        wait_for(lambda: jobs.queued() == ["hi"], "hi is queued")
        r = run_ensure(cfg, low)
        assert r.returncode == 3, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["decision"] == "BUSY"
        assert f"queued: run.{jobs.name('hi')}, priority 90, 70.0 GiB" in out["reason"]
        assert jobs.queued() == ["hi"] and jobs.running() == []
        r = run_ensure(cfg, top)  # above the waiter: it goes
        assert r.returncode == 0, r.stdout + r.stderr
        assert jobs.running() == []  # hi still waits: 60 + 50 held, 10 free
        assert gpuctl_in_process(cfg, "stop", top).returncode == 0
        host.stop(stranger)
        wait_for(lambda: jobs.running() == ["hi"], "hi runs first", timeout=60)
        r = run_ensure(cfg, low)  # 50 GiB free beside hi's 70: now it fits
        assert r.returncode == 0, r.stdout + r.stderr
        assert jobs.running() == ["hi"]
    finally:
        jobs.close()
        kill_servers(low)
        kill_servers(top)


def test_the_attackers_inversion_repro_runs_hi_first(host: SimHost) -> None:
    """The reviewer's repro, as separate processes: a stranger holds 100 GiB for a few
    seconds; `run --wait` hi (30 GiB, priority 90) queues; ensure of low (100 GiB,
    priority 10) is tried in a loop until it starts. hi's CMD ran (it printed HI and
    exited 0): with low holding 100 of the 120 GiB it could not have run after low, so it
    ran first. (Before the fix low took the memory and hi waited for good.)"""
    from gpuctl.sim.host import free_port
    from tests.ensure_helpers import kill_servers, model_server_command, run_ensure, service_toml

    low = unique_name("low")
    port = free_port()
    toml = service_toml(low, port, model_server_command(low, port, "100GiB", "1s"))
    cfg = host.write_config(toml.replace('memory = "20GiB"', 'memory = "100GiB"\npriority = 10'))
    hold = host.hold(unique_name("big"), "100GiB")
    hi_name = unique_name("hi")
    argv = ["run", "--wait", "-m", "30GiB", "-p", "90", "--name", hi_name, "--", "echo", "HI"]
    hi = subprocess.Popen(
        [gpuctl_exe(), *argv],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert hi.stderr is not None and "waiting for room" in hi.stderr.readline()
        wait_for(
            lambda: [q["name"] for q in locks(cfg)["queue"]] == [f"run.{hi_name}"], "hi queued"
        )
        assert run_ensure(cfg, low).returncode == 3  # the stranger's 100 GiB: it does not fit
        host.stop(hold)
        deadline = time.time() + 60
        while (r := run_ensure(cfg, low)).returncode != 0:
            assert time.time() < deadline, r.stdout + r.stderr
            time.sleep(0.2)
        out, err = hi.communicate(timeout=60)
        assert hi.returncode == 0 and out.strip() == "HI", err
        assert locks(cfg)["queue"] == []
    finally:
        hi.kill()
        hi.communicate()
        kill_servers(low)


def test_status_holds_back_a_service_for_the_queue_as_ensure_does(host: SimHost) -> None:
    """60 GiB held by a stranger, hi (70 GiB, priority 90) queued: low (50 GiB, priority
    10) would fit in the 60 GiB free, but ensure refuses it for hi's room. status says so
    too (text and --json, the same reason); top (priority 95, above hi) FITS in both."""
    from gpuctl.sim.host import free_port
    from tests.ensure_helpers import kill_servers, model_server_command, run_ensure, service_toml

    low, top = unique_name("low"), unique_name("top")
    toml = ""
    for svc, prio in ((low, 10), (top, 95)):
        port = free_port()
        t = service_toml(svc, port, model_server_command(svc, port, "50GiB", "1s"))
        toml += t.replace('memory = "20GiB"', f'memory = "50GiB"\npriority = {prio}') + "\n"
    cfg = host.write_config(toml)
    stranger = host.hold(unique_name("big"), "60GiB")
    jobs = Jobs(host, cfg)
    try:
        p = jobs.wait("hi", 90, "-m", "70GiB")
        assert p.stderr is not None and "waiting for room" in p.stderr.readline()
        wait_for(lambda: jobs.queued() == ["hi"], "hi is queued")
        queued = f"queued: run.{jobs.name('hi')}, priority 90, 70.0 GiB"
        obj = json.loads(gpuctl_in_process(cfg, "status", "--json").stdout)
        rows = {s["name"]: s for s in obj["services"]}
        assert rows[low]["decision"] == "BUSY", rows[low]
        assert queued in rows[low]["reason"]
        assert rows[top]["decision"] == "FITS", rows[top]
        text = subprocess.run(
            [gpuctl_exe(), "status"],
            env={**cli_env(cfg), "COLUMNS": "250"},
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        (line,) = [ln for ln in text.splitlines() if low in ln]
        assert "BUSY" in line and "FITS" not in line, text
        assert queued in text.replace("\n", " "), text
        r = run_ensure(cfg, low)
        assert r.returncode == 3 and queued in json.loads(r.stdout)["reason"], r.stdout
        assert jobs.queued() == ["hi"] and jobs.running() == []
    finally:
        host.stop(stranger)
        jobs.close()
        kill_servers(low)
        kill_servers(top)
