"""The millisecond windows of a start, hit on purpose (failpoints), with the process
launcher on the simulated GPU: real agent, real store, real detached servers.

The docker and jupyter launchers have the same window; their tests live beside their
other ensure tests (tests/test_ensure_docker.py, tests/test_ensure_jupyter.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    big_service,
    cli_env,
    end_in_window,
    ensure_paused_at,
    kill_servers,
    launches_in_log,
    model_server_command,
    plant_record,
    read_record,
    run_ensure,
    server_pids,
    service_toml,
    sim_claims,
    unique_name,
)

# Heavy: many processes at once, and windows that a second heavy test beside it would widen.
# With -n, the "heavy" group runs on one worker, one test after another.
pytestmark = pytest.mark.xdist_group("heavy")


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        kill_servers(n)


def log_of(host: SimHost, name: str) -> Path:
    return host.state_dir / "logs" / f"{name}.log"


@pytest.mark.parametrize(
    ("sig", "window", "via"),
    [
        (signal.SIGKILL, "ensure.after_spawn", "agent"),
        (signal.SIGKILL, "ensure.after_spawn", "direct"),
        (signal.SIGINT, "ensure.after_spawn", "agent"),
        (signal.SIGINT, "ensure.after_spawn", "direct"),
        # A kill -9 there: test_orphaned_start_...; the flow's units: test_flows.
        (signal.SIGINT, "launch.spawned", "agent"),
    ],
    ids=["kill-9-agent", "kill-9-direct", "ctrl-c-agent", "ctrl-c-direct", "ctrl-c-in-launcher"],
)
def test_caller_killed_between_spawn_and_record(
    host: SimHost, names: list[str], sig: int, via: str, window: str
) -> None:
    """The caller dies after its server is spawned and before it is recorded: in the
    launcher, before it returns the handle, or after. A rival 80 GiB service asked at
    once is BUSY (no OOM); the same service asked again waits for that server (found by
    its start nonce), never starts a second, and records it. Through the agent and on
    the direct path (no agent: this machine read by gpuctl)."""
    from tests.ensure_helpers import direct_config

    a, b = unique_name("win"), unique_name("rival")
    server = unique_name("anon")  # its command line does not name `a`
    names += [a, b, server]
    pa, pb = free_port(), free_port()
    toml = big_service(a, pa, server, load_time="4s") + "\n" + big_service(b, pb, b, "1s")
    cfg = host.write_config(toml) if via == "agent" else direct_config(host, toml)
    caller = ensure_paused_at(cfg, a, window)
    end_in_window(caller, sig)
    rec = read_record(host, a)
    assert rec["phase"] == "starting" and rec["start_nonce"]
    # Ctrl-C records the handle on the way out where the launcher had returned it.
    assert bool(rec["handle"]) is (sig == signal.SIGINT and window == "ensure.after_spawn")
    if sig == signal.SIGINT:  # ... as a Ctrl-C while waiting does: attempt, lease back
        assert rec["attempts"][-1]["outcome"] == "interrupted" and rec["lease"] is None
    assert len(server_pids(server)) == 1

    r = run_ensure(cfg, b)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["outcome"] == "busy"
    assert server_pids(b) == []

    r = run_ensure(cfg, a)
    out = json.loads(r.stdout)
    assert r.returncode == 0, (out["reason"], out["notes"], r.stderr)
    assert out["outcome"] == "ready" and out["launched"] is False
    (pid,) = server_pids(server)
    assert launches_in_log(log_of(host, a)) == 1
    assert "CUDA out of memory" not in log_of(host, a).read_text()
    rec = read_record(host, a)
    assert rec["phase"] == "running"
    assert rec["handle"]["pid"] == pid
    assert [c for c in sim_claims(host, b)] == []


@pytest.mark.parametrize("via", ["agent", "direct"])
def test_a_server_ready_before_anyone_records_it_gets_its_handle(
    host: SimHost, names: list[str], via: str
) -> None:
    """The caller dies between spawn and record, and its server is up before the next
    use: the agent (or that use) marks it running. The next `ensure` still finds the
    server by its start nonce and records its handle: stop, heal and reclaim then know
    its pid, not only its nonce."""
    from tests.ensure_helpers import direct_config

    a = unique_name("win")
    server = unique_name("anon")
    names += [a, server]
    pa = free_port()
    toml = big_service(a, pa, server, load_time="1s")
    cfg = host.write_config(toml) if via == "agent" else direct_config(host, toml)
    end_in_window(ensure_paused_at(cfg, a), signal.SIGKILL)
    (pid,) = server_pids(server)
    deadline = time.monotonic() + 60
    while True:  # its health answers (and, through the agent, the agent promotes it)
        try:
            up = httpx.get(f"http://127.0.0.1:{pa}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            up = False
        if up and (via == "direct" or read_record(host, a)["phase"] == "running"):
            break
        assert time.monotonic() < deadline, read_record(host, a)
        time.sleep(0.2)
    assert not read_record(host, a)["handle"]

    r = run_ensure(cfg, a)
    out = json.loads(r.stdout)
    assert r.returncode == 0, (out["reason"], out["notes"], r.stderr)
    assert out["outcome"] == "ready" and out["launched"] is False
    assert any("found the server of an earlier start" in n for n in out["notes"]), out["notes"]
    rec = read_record(host, a)
    assert rec["phase"] == "running" and rec["handle"]["pid"] == pid and rec["lease"] is None
    assert server_pids(server) == [pid]


def test_a_handle_that_names_no_server_is_no_proof_of_a_stop(
    host: SimHost, names: list[str]
) -> None:
    """A record whose handle lost its pid (salvaged from a broken file) once made `gpuctl
    stop` say "stopped process" and stop nothing. Such a handle is no handle: the start
    nonce finds the server, and the stop ends it."""
    a = unique_name("nopid")
    names.append(a)
    port = free_port()
    cfg = host.write_config(service_toml(a, port, model_server_command(a, port, load_time="1s")))
    r = run_ensure(cfg, a)
    assert r.returncode == 0, (r.stdout, r.stderr)
    (pid,) = server_pids(a)
    path = host.state_dir / "records" / f"{a}.json"
    data = json.loads(path.read_text())
    assert data["handle"]["pid"] == pid and data["start_nonce"]
    data["handle"] = {k: v for k, v in data["handle"].items() if k not in ("pid", "pid_start")}
    plant_record(path, data)
    s = gpuctl_in_process(cfg, "stop", a)
    assert s.returncode == 0, (s.stdout, s.stderr)
    assert f"pid {pid}" in s.stdout + s.stderr, s.stdout + s.stderr
    deadline = time.monotonic() + 30
    while server_pids(a):
        assert time.monotonic() < deadline, "the server still runs"
        time.sleep(0.1)


def test_orphaned_start_without_a_server_is_started_again(host: SimHost, names: list[str]) -> None:
    """Killed after admission and before spawning: nothing carries the nonce, so the next
    caller proves the start dead and launches, once."""
    a = unique_name("win")
    names.append(a)
    pa = free_port()
    cfg = host.write_config(service_toml(a, pa, model_server_command(a, pa, load_time="1s")))
    env = cli_env(cfg)
    env["GPUCTL_FAILPOINTS"] = "launch.spawned=kill"  # dies right after its Popen
    first = subprocess.run(
        [gpuctl_exe(), "ensure", a, "--json"], env=env, capture_output=True, text=True, check=False
    )
    assert first.returncode == -signal.SIGKILL
    (orphan,) = server_pids(a)  # spawned, then the caller died: same as after_spawn
    r = run_ensure(cfg, a)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["launched"] is False, r.stdout
    assert server_pids(a) == [orphan]
    kill_servers(a)
    # Now no server carries the nonce: a start that died is started again.
    rec_file = host.state_dir / "records" / f"{a}.json"
    data = json.loads(rec_file.read_text())
    data.update(phase="starting", handle=None, lease=None, since=time.time())
    plant_record(rec_file, data)
    r = run_ensure(cfg, a)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["launched"] is True, r.stdout
    assert len(server_pids(a)) == 1


def one_second_service(host: SimHost, names: list[str], tag: str) -> tuple[str, Path]:
    """A service of its own (a 1 s load) in the host's config: its name and the config."""
    a = unique_name(tag)
    names.append(a)
    pa = free_port()
    return a, host.write_config(service_toml(a, pa, model_server_command(a, pa, load_time="1s")))


def hold_admission(host: SimHost, cfg: Path, tmp_path: Path) -> subprocess.Popen[str]:
    """Another caller holding the host's admission lock (renewed) until it is killed."""
    script = tmp_path / "holder.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from pathlib import Path
            from gpuctl.adapters.store import holder_here
            from gpuctl.adapters.store.direct import DirectStore
            store = DirectStore(Path({str(host.state_dir)!r}))
            h = holder_here("test")
            granted, _ = store.acquire("_admission", h, 10)  # its longest term; renewed
            assert granted
            print("held", flush=True)
            for _ in range(300):
                time.sleep(2)
                store.renew("_admission", h.id, 10)
            """
        )
    )
    holder = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=cli_env(cfg)
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_ctrl_c_before_the_start_says_nothing_was_started(
    host: SimHost, names: list[str], tmp_path: Path
) -> None:
    """Ctrl-C while `ensure` waits for the admission lock (its lease taken, nothing
    launched): exit 130, it says nothing was started (never "keeps loading"), the lease
    goes back, no attempt is recorded and no server runs."""
    a, cfg = one_second_service(host, names, "early")
    holder = hold_admission(host, cfg, tmp_path)
    try:
        for args in ((), ("--json",)):
            p = subprocess.Popen(
                [gpuctl_exe(), "ensure", a, *args],
                env=cli_env(cfg),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            deadline = time.monotonic() + 30
            rec_file = host.state_dir / "records" / f"{a}.json"
            while not (rec_file.exists() and read_record(host, a)["lease"]):  # at admission
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
            assert p.returncode == 130, (out, err)
            assert "keeps loading" not in err + out and "Traceback" not in err, err
            if args:
                result = json.loads(out)
                assert result["outcome"] == "interrupted" and result["decision"] == "UNKNOWN"
                assert result["reason"] == "interrupted before anything was started"
            else:
                assert f"stopped before starting {a}; nothing was started" in err, err
            rec = read_record(host, a)
            assert rec["lease"] is None and not rec["attempts"], rec
        assert server_pids(a) == []
    finally:
        holder.kill()
        holder.communicate()


def test_timeout_bounds_the_wait_for_the_admission_lock(
    host: SimHost, names: list[str], tmp_path: Path
) -> None:
    """Another caller holds the host's admission lock: `ensure --timeout 3s` gives up at
    its own deadline (exit 5) and launches nothing, even after the lock is free."""
    a, cfg = one_second_service(host, names, "late")
    holder = hold_admission(host, cfg, tmp_path)
    try:
        r = run_ensure(cfg, a, "--timeout", "3s", timeout=50)
        out = json.loads(r.stdout)
        assert r.returncode == 5, (r.stdout, r.stderr)
        assert out["outcome"] == "timeout" and out["launched"] is False
        assert "admission" in out["reason"]
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.communicate()
    time.sleep(1.0)  # anything that would still launch late would have by now
    assert server_pids(a) == []
    assert launches_in_log(log_of(host, a)) == 0


def test_two_stops_one_pid(host: SimHost, names: list[str]) -> None:
    """Two stops at once of a server gpuctl started (its record names it, its start
    nonce proves it): one reports stopping it; the other acts on a fresh reading and
    reports nothing. (A server found only by its keywords is never signalled:
    tests/test_reach.py.)"""
    a = unique_name("stop")
    names.append(a)
    pa = free_port()
    cfg = host.write_config(service_toml(a, pa, model_server_command(a, pa, load_time="0s")))
    r = run_ensure(cfg, a)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 20
    while not sim_claims(host, a):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    procs = [
        subprocess.Popen(
            [gpuctl_exe(), "stop", a, "--json"],
            env=cli_env(cfg),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out)["stopped"])
    assert sorted(len(s) for s in results) == [0, 1], results
    assert server_pids(a) == []


def test_touch_completes_a_start_that_answers(host: SimHost, names: list[str]) -> None:
    """After --no-wait the record says `starting`; a touch that sees the server answer
    moves it to `running` (so do status, locks, reclaim and ensure on a host without an
    agent: tests/test_heal.py). On the direct path, with the agent
    stopped: an agent on the same store completes it itself once it sees the record's
    health URL answer."""
    from tests.ensure_helpers import direct_config

    for proc in host.procs:  # the agent
        host.stop(proc)
    host.procs.clear()
    a = unique_name("touch")
    names.append(a)
    pa = free_port()
    cfg = direct_config(host, service_toml(a, pa, model_server_command(a, pa, load_time="1s")))
    r = run_ensure(cfg, a, "--no-wait")
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "started", r.stderr
    assert read_record(host, a)["phase"] == "starting"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{pa}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = gpuctl_in_process(cfg, "touch", a)
    assert r.returncode == 0, r.stderr
    assert read_record(host, a)["phase"] == "running"


@pytest.mark.parametrize("via", ["agent", "direct"])
def test_pipelines_are_not_servers_but_background_jobs_are(
    host: SimHost, names: list[str], via: str
) -> None:
    """`ensure X | cat | tee X.log` starts X; `status | cat | grep X` does not call X
    LOADING; a `… X … &` job of the same script, writing into the same pipe, counts."""
    from tests.ensure_helpers import direct_config

    a = unique_name("pipe")
    names.append(a)
    pa = free_port()
    toml = service_toml(a, pa, model_server_command(a, pa, load_time="1s"))
    cfg = host.write_config(toml) if via == "agent" else direct_config(host, toml)
    exe = gpuctl_exe()

    # status | cat | tee X.status | grep X: tee and grep name X, pipes away.
    r = subprocess.run(
        ["sh", "-c", f"{exe} status --json | cat | tee {host.base}/{a}.status | grep -q {a}"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    (s,) = json.loads((host.base / f"{a}.status").read_text())["services"]
    assert s["decision"] != "LOADING", s

    # A background job of the same script that names X, writing into the same pipe as
    # gpuctl: not in the pipeline, so it counts (LOADING).
    r = subprocess.run(
        [
            "sh",
            "-c",
            f"{sys.executable} -c 'import time; time.sleep(30)' {a} & "
            f"sleep 0.3; {exe} status --json | cat; kill $!",
        ],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    (s,) = json.loads(r.stdout)["services"]
    assert s["decision"] == "LOADING", s

    # ensure X --json | cat | tee X.log: starts it, once.
    log = host.base / f"{a}.out"
    r = subprocess.run(
        ["sh", "-c", f"{exe} ensure {a} --json --timeout 60s | cat | tee {log}"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = json.loads(log.read_text())
    assert out["outcome"] == "ready" and out["launched"] is True, (out, r.stderr)
    assert len(server_pids(a)) == 1
