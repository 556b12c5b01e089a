"""`gpuctl ensure` end to end on the simulated GPU, with the process launcher.

Real agent, real store, real detached servers. The counts asserted are the point:
exactly one launch, however many callers race.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process, set_marked_failpoints, tagged
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    direct_config,
    kill_servers,
    launches_in_log,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    service_toml,
    sim_claims,
    spawn_ensure,
    unique_name,
)


@pytest.fixture
def host(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimHost]:
    set_marked_failpoints(request, monkeypatch)
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name()
    yield name
    kill_servers(name)


def locks_row(cfg: Path, svc: str) -> dict[str, Any]:
    """The service's row of `gpuctl locks --json`."""
    r = gpuctl_in_process(cfg, "locks", "--json")
    assert r.returncode == 0, r.stderr
    locks = json.loads(r.stdout)
    (row,) = [x for x in locks["records"] if x["service"] == svc]
    return dict(row)


def log_of(host: SimHost, name: str) -> Path:
    return host.state_dir / "logs" / f"{name}.log"


@pytest.mark.slow
def test_ensure_starts_once_and_is_ready(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="2s"))
    )
    r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert out["outcome"] == "ready" and out["launched"] is True and out["decision"] == "IDLE"
    assert out["attempt"]["outcome"] == "ready" and out["attempt"]["duration_s"] > 1.0
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    # The server outlives its caller: the ensure process has exited, the server runs.
    assert len(server_pids(svc)) == 1
    rec = read_record(host, svc)
    assert rec["phase"] == "running" and rec["lease"] is None
    assert rec["handle"]["pid"] == server_pids(svc)[0]  # the server itself, not a wrapper
    # A second ensure finds it healthy: no launch, exit 0.
    r2 = run_ensure(cfg, svc)
    assert r2.returncode == 0 and json.loads(r2.stdout)["launched"] is False
    assert launches_in_log(log_of(host, svc)) == 1
    # locks and status tell the same story.
    row = locks_row(cfg, svc)
    assert row["phase"] == "running" and row["last_used"] is not None
    status = json.loads(gpuctl_in_process(cfg, "status", "--json").stdout)
    (s,) = status["services"]
    assert s["decision"] == "READY" and s["pids"] == server_pids(svc)
    # stop finds it by its record.
    r3 = gpuctl_in_process(cfg, "stop", svc)
    assert r3.returncode == 0, r3.stderr
    assert server_pids(svc) == []
    assert read_record(host, svc)["phase"] == "stopped"


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")  # 32 callers: never beside another heavy test
def test_race_32_processes_and_8_api_calls_one_launch(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="5s"))
    )
    procs = [spawn_ensure(cfg, svc) for _ in range(32)]

    async def api_calls() -> list[api.ReadyResult]:
        return list(
            await asyncio.gather(*(api.ensure_ready(svc, config=cfg, timeout=90) for _ in range(8)))
        )

    results = asyncio.run(api_calls())
    outs = [
        (p.wait(120), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "")
        for p in procs
    ]
    for p in procs:
        for f in (p.stdout, p.stderr):
            if f:
                f.close()
    codes = [rc for rc, _, _ in outs]
    assert codes == [0] * 32, [e[-300:] for rc, _, e in outs if rc]
    assert all(r.ready for r in results), [r.reason for r in results if not r.ready]
    launched = [json.loads(o)["launched"] for _, o, _ in outs] + [r.launched for r in results]
    assert launched.count(True) == 1
    assert launches_in_log(log_of(host, svc)) == 1
    assert len(server_pids(svc)) == 1
    assert len(sim_claims(host, svc)) == 1
    assert "CUDA out of memory" not in log_of(host, svc).read_text()


@pytest.mark.slow
def test_race_across_both_store_paths_one_launch(host: SimHost, svc: str) -> None:
    port = free_port()
    services = service_toml(svc, port, model_server_command(svc, port, load_time="4s"))
    via_agent = host.write_config(services)
    direct = direct_config(host, services)
    procs = [spawn_ensure(via_agent if i % 2 else direct, svc) for i in range(12)]
    outs = [(p.wait(120), p.communicate()) for p in procs]
    assert [rc for rc, _ in outs] == [0] * 12, [o[1][-300:] for rc, o in outs if rc]
    launched = [json.loads(o[0])["launched"] for _, o in outs]
    assert launched.count(True) == 1
    assert launches_in_log(log_of(host, svc)) == 1
    assert len(server_pids(svc)) == 1


def test_holder_killed_mid_start_next_caller_waits(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="6s"))
    )
    first = spawn_ensure(cfg, svc)
    deadline = time.monotonic() + 20
    while not server_pids(svc):  # launched, still loading
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    first.communicate()
    # The lease is void at once (its holder is dead), the server lives on, loading.
    r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert out["launched"] is False and out["decision"] == "LOADING"
    assert launches_in_log(log_of(host, svc)) == 1
    assert len(server_pids(svc)) == 1


def test_holder_dies_before_recording_the_server(host: SimHost, svc: str, tmp_path: Path) -> None:
    """The window between spawning the server and recording it: the keywords catch it."""
    port = free_port()
    cmd = model_server_command(svc, port, load_time="5s")
    cfg = host.write_config(service_toml(svc, port, cmd))
    script = tmp_path / "holder.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import shlex, subprocess, sys, time
            from pathlib import Path
            from gpuctl.adapters.store import Holder, holder_here
            from gpuctl.adapters.store.direct import DirectStore
            store = DirectStore(Path({str(host.state_dir)!r}))
            granted, _ = store.acquire({svc!r}, holder_here("test"), 600)
            assert granted
            subprocess.Popen(shlex.split({cmd!r}), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print("spawned", flush=True)
            time.sleep(600)
            """
        )
    )
    holder = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=cli_env(cfg)
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "spawned"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert out["launched"] is False
    assert len(server_pids(svc)) == 1  # never a second server while the first lives
    assert launches_in_log(log_of(host, svc)) == 0  # gpuctl itself launched nothing
    # Nothing recorded it and it carries no start nonce (its starter was no gpuctl of
    # this release): stop finds it by its keywords, reports it, and signals nothing.
    (server,) = server_pids(svc)

    def stop() -> subprocess.CompletedProcess[str]:
        return gpuctl_in_process(cfg, "stop", svc, "--json")

    r = stop()
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert f"pid {server}" in r.stderr and "no proof" in r.stderr
    assert server_pids(svc) == [server]
    # A person stops it by hand; then `gpuctl stop` clears the record.
    os.kill(server, signal.SIGKILL)
    r = stop()
    assert r.returncode == 0, r.stderr
    assert server_pids(svc) == []


# A minute's back-off, not 10 s: the second call must land inside it however loaded the
# machine is (the 10 s itself: test_record, and test_store through the same store code).
@pytest.mark.failpoints("ensure.backoff=seconds:60")
def test_failed_start_backoff_and_locks(host: SimHost, svc: str) -> None:
    port = free_port()
    cmd = f"{sys.executable} -c \"import sys; print('boom: weights not found'); sys.exit(3)\" {svc}"
    cfg = host.write_config(service_toml(svc, port, cmd))
    r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 1
    assert out["outcome"] == "failed" and "exited" in out["reason"]
    assert "boom: weights not found" in out["log_tail"]
    # The back-off holds the next attempt: FAILED at once, no launch.
    r2 = run_ensure(cfg, svc)
    out2 = json.loads(r2.stdout)
    assert r2.returncode == 1 and out2["decision"] == "FAILED" and out2["launched"] is False
    assert "next try in" in out2["reason"]
    assert launches_in_log(log_of(host, svc)) == 1
    row = locks_row(cfg, svc)
    assert row["phase"] == "failed"
    assert row["failure"]["count"] == 1 and "boom" in row["failure"]["log_tail"]
    assert row["failure"]["backoff_until"] - row["failure"]["at"] == pytest.approx(60, abs=0.5)
    r = gpuctl_in_process(cfg, "locks", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    human = r.stdout
    # The table's "retry in Ns" shows only while the back-off runs (a loaded machine can
    # be past it by now): the back-off itself is asserted on the JSON above.
    assert "exited while loading" in human and "(1x" in human


def wait_until_waiting(host: SimHost, svc: str, proc: subprocess.Popen[str]) -> None:
    """Until ``proc`` (an ensure) waits on its server: the server runs and its handle is
    on record. A server seen before that may still be inside its launcher's return, or
    its handle's write: another window, with tests of its own (test_ensure_races)."""
    deadline = time.monotonic() + 20
    record = host.state_dir / "records" / f"{svc}.json"
    while not (server_pids(svc) and record.exists() and read_record(host, svc)["handle"]):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)


def test_agent_stopped_mid_wait(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="6s"))
    )
    proc = spawn_ensure(cfg, svc)
    wait_until_waiting(host, svc, proc)
    host.stop(host.procs[0])  # the agent
    out_s, err = proc.communicate(timeout=90)
    out = json.loads(out_s)
    assert proc.returncode == 0, err
    assert out["outcome"] == "ready" and out["launched"] is True
    assert any(n.startswith("agent unavailable") for n in out["notes"]), out["notes"]
    assert len(server_pids(svc)) == 1 and launches_in_log(log_of(host, svc)) == 1


def test_busy_and_unknown_never_start(host: SimHost, svc: str, tmp_path: Path) -> None:
    port = free_port()
    big = service_toml(svc, port, model_server_command(svc, port)).replace(
        'memory = "20GiB"', 'memory = "120GiB"'
    )
    cfg = host.write_config(big)
    comfy = tagged("comfyui")
    holder = host.hold(comfy, "20GiB")
    deadline = time.monotonic() + 10
    r = run_ensure(cfg, svc)
    while r.returncode != 3 and time.monotonic() < deadline:
        time.sleep(0.3)
        r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 3 and out["outcome"] == "busy"
    assert f"pid {holder.pid}" in out["reason"] and comfy in out["reason"]
    host.stop(holder)
    host.stop(host.procs[0])  # the agent: now nobody can tell us what runs
    r = run_ensure(cfg, svc)
    assert r.returncode == 4 and json.loads(r.stdout)["outcome"] == "unknown"
    assert server_pids(svc) == []


def test_sync_api_warm_path_and_misuse(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="1s"))
    )
    r = api.ensure_ready_sync(svc, config=cfg, timeout=60)
    assert r.ready and r.decision == "READY" and r.launched
    warm = api.ensure_ready_sync(svc, config=cfg)
    assert warm.ready and not warm.launched
    from gpuctl.errors import UsageError

    with pytest.raises(UsageError, match="unknown service"):
        api.ensure_ready_sync("nope", config=cfg)


def test_ctrl_c_stops_waiting_not_the_server(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="5s"))
    )
    proc = spawn_ensure(cfg, svc)
    wait_until_waiting(host, svc, proc)
    (server,) = server_pids(svc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "keeps loading" in err
    assert server_pids(svc) == [server]  # still there, still loading
    rec = read_record(host, svc)
    assert rec["lease"] is None and rec["handle"]["pid"] == server
    assert rec["attempts"][-1]["outcome"] == "interrupted"
    r = run_ensure(cfg, svc)  # the next caller waits for that same server
    assert r.returncode == 0 and json.loads(r.stdout)["launched"] is False
    assert server_pids(svc) == [server]
    # ... and, seeing it answer, tells the record: locks and status agree.
    assert read_record(host, svc)["phase"] == "running"


def test_engine_dead_503_fails_the_wait(host: SimHost, svc: str) -> None:
    """vLLM answers 503 only once its engine is dead: ensure stops waiting, exit 1."""
    port = free_port()
    cmd = model_server_command(svc, port, load_time="1s") + " --engine-dies-after 0s"
    cfg = host.write_config(service_toml(svc, port, cmd))
    r = run_ensure(cfg, svc)
    out = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    assert out["outcome"] == "failed" and "engine is dead" in out["reason"]
    assert "Application startup complete" in out["log_tail"]
    assert read_record(host, svc)["failure"]["count"] == 1


def test_a_pipeline_naming_the_service_does_not_block_its_start(host: SimHost, svc: str) -> None:
    """`gpuctl ensure X | tee X.log`: the tee names X, but it is not X loading."""
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, load_time="1s"))
    )
    log = host.base / f"{svc}.out"
    r = subprocess.run(
        ["sh", "-c", f"{gpuctl_exe()} ensure {svc} --json --timeout 60s | tee {log}"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = json.loads(log.read_text())
    assert out["outcome"] == "ready" and out["launched"] is True, r.stderr
    assert len(server_pids(svc)) == 1


def test_a_recorded_server_counts_whatever_its_command_says(host: SimHost, svc: str) -> None:
    """Its command does not carry the service's keywords (`services.chat` runs `vllm serve`):
    the record's pid still makes it LOADING for its own callers, and 80 GiB for the others."""
    server_name = unique_name("anon")
    port, port2 = free_port(), free_port()
    chat = service_toml(svc, port, model_server_command(server_name, port, "80GiB", "6s"))
    chat = chat.replace('memory = "20GiB"', 'memory = "80GiB"')
    other = unique_name("other")
    big = service_toml(other, port2, model_server_command(other, port2, "80GiB", "1s"))
    big = big.replace('memory = "20GiB"', 'memory = "80GiB"')
    cfg = host.write_config(chat + "\n" + big)
    try:
        r = run_ensure(cfg, svc, "--no-wait")
        assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "started", r.stderr
        # The same service again: it waits for that server, it does not start a second.
        r = run_ensure(cfg, svc)
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["launched"] is False and out["decision"] == "LOADING"
        assert len(server_pids(server_name)) == 1
        # Another 80 GiB service does not fit beside it: BUSY, never an OOM.
        r = run_ensure(cfg, other)
        assert r.returncode == 3, r.stdout
        assert server_pids(other) == []
    finally:
        kill_servers(server_name)
        kill_servers(other)


@pytest.mark.slow
def test_two_services_that_do_not_fit_together_race(host: SimHost) -> None:
    """10 callers each for two 80 GiB services on a 128 GiB GPU, all at once: one service
    starts (its callers all get 0), the other is BUSY (3); never both, never an OOM."""
    a, b = unique_name("race"), unique_name("race")
    pa, pb = free_port(), free_port()
    toml = ""
    for name, port in ((a, pa), (b, pb)):
        t = service_toml(name, port, model_server_command(name, port, "80GiB", "3s"))
        toml += t.replace('memory = "20GiB"', 'memory = "80GiB"') + "\n"
    cfg = host.write_config(toml)
    try:
        procs = [(n, spawn_ensure(cfg, n)) for _ in range(10) for n in (a, b)]
        codes: dict[str, list[int]] = {a: [], b: []}
        for name, p in procs:
            p.communicate(timeout=120)
            codes[name].append(p.returncode)
        started = [n for n in (a, b) if server_pids(n)]
        assert len(started) == 1, codes
        (winner,) = started
        loser = b if winner == a else a
        assert codes[winner] == [0] * 10, codes
        assert codes[loser] == [3] * 10, codes
        assert "CUDA out of memory" not in log_of(host, winner).read_text()
        assert launches_in_log(log_of(host, winner)) == 1
        assert launches_in_log(log_of(host, loser)) == 0
    finally:
        kill_servers(a)
        kill_servers(b)
