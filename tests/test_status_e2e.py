"""`gpuctl status --json` against a real agent on the simulated GPU: the decisions of
issue 2's "done when", through the installed `gpuctl` as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process, tagged
from tests.ensure_helpers import kill_servers, unique_name


def status(cfg: Path, *args: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg)}
    if token is not None:
        env["GPUCTL_DEMO_TOKEN"] = token
    r = subprocess.run(
        [gpuctl_exe(), "status", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def decisions(obj: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["decision"] for s in obj["services"]}


def wait_for(
    cfg: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> dict[str, Any]:
    """The first ``status --json`` that satisfies ``pred`` (the last one at the timeout).
    It polls in process: an interpreter spawned per look would cost the CPU the servers
    under test need; the other looks of these tests go through the installed gpuctl."""
    deadline = time.monotonic() + timeout
    while True:
        r = gpuctl_in_process(cfg, "status", "--json")
        assert r.stdout, r.stderr
        obj = json.loads(r.stdout)
        if pred(obj) or time.monotonic() > deadline:
            return obj
        time.sleep(0.3)


@pytest.mark.e2e
def test_decisions_through_a_real_agent(sim_host: SimHost) -> None:
    llm = unique_name("vllm")
    port = free_port()
    cfg = sim_host.write_config(
        f"""
[services.{llm}]
health = "http://127.0.0.1:{port}/health"
memory = "80GiB"

[services.photos]
match = ["photo-batch-{llm}"]
memory = "30GiB"

[services.trainer]
match = ["trainer-{llm}"]
memory = "120GiB"
"""
    )
    try:
        rc, obj = status(cfg)
        assert rc == 0 and obj["schema"] == 1 and obj["ok"] is True
        assert decisions(obj) == {llm: "IDLE", "photos": "IDLE", "trainer": "IDLE"}
        assert obj["hosts"][0]["is_idle"] is True and obj["hosts"][0]["probe"] == "sim"

        comfy = tagged("comfyui")
        hold = sim_host.hold(comfy, "20GiB")
        obj = wait_for(cfg, lambda o: decisions(o)["trainer"] == "BUSY")
        d = decisions(obj)
        assert d[llm] == "FITS" and d["trainer"] == "BUSY"
        (trainer,) = [s for s in obj["services"] if s["name"] == "trainer"]
        assert f"pid {hold.pid}" in trainer["reason"] and comfy in trainer["reason"]
        (proc,) = obj["hosts"][0]["processes"]
        assert proc["pid"] == hold.pid and proc["memory_mib"] == 20480 and comfy in proc["command"]

        server = sim_host.model_server(llm, "80GiB", "4s", port)
        obj = wait_for(cfg, lambda o: decisions(o)[llm] == "LOADING", 10)
        assert decisions(obj)[llm] == "LOADING"
        # The loading server counts at its full 80 GiB budget: the 30 GiB batch no longer fits.
        assert decisions(obj)["photos"] == "BUSY"

        # READY comes from a health check made now, the memory from the agent's reading
        # (cached up to --cache-ttl): the server's last load step may show a beat later.
        def loaded(o: dict[str, Any]) -> bool:
            (s,) = [s for s in o["services"] if s["name"] == llm]
            return bool(decisions(o)[llm] == "READY" and s["memory_mib"] == 81920)

        obj = wait_for(cfg, loaded, 30)
        assert decisions(obj)[llm] == "READY"
        (svc,) = [s for s in obj["services"] if s["name"] == llm]
        assert svc["pids"] == [server.pid] and svc["memory_mib"] == 81920

        rc, obj = status(cfg, token="wrong-token")
        assert rc == 4 and obj["ok"] is False
        assert "refused our token" in obj["hosts"][0]["error"]
        assert decisions(obj)["trainer"] == "UNKNOWN"
        assert decisions(obj)[llm] == "READY"  # health answers even when the agent refuses us

        sim_host.stop(sim_host.procs[0])  # the agent
        rc, obj = status(cfg)
        assert rc == 4 and decisions(obj)["photos"] == "UNKNOWN"
        assert "refused" in obj["hosts"][0]["error"] or "cannot reach" in obj["hosts"][0]["error"]
    finally:
        kill_servers(llm)


@pytest.mark.e2e
def test_one_dead_host_does_not_slow_the_others(sim_host: SimHost, tmp_path: Path) -> None:
    """--all: a host whose agent hangs shows UNKNOWN after its own timeout."""
    import socket

    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts, never answers
    try:
        cfg = tmp_path / "two.toml"
        cfg.write_text(
            '[defaults]\nagent_timeout = "60s"\n'
            f'[hosts.good]\nagent = "{sim_host.agent_url}"\ntoken_env = "GPUCTL_DEMO_TOKEN"\n'
            f'[hosts.hung]\nagent = "http://127.0.0.1:{hang.getsockname()[1]}"\ntimeout = "1s"\n'
        )
        rc, obj = status(cfg, "--all", token=sim_host.token)
        assert rc == 4
        by = {h["name"]: h for h in obj["hosts"]}
        assert by["good"]["ok"] is True and by["hung"]["ok"] is False
        # The hung host gave up after its own timeout (not the 60 s default).
        assert "did not answer within 1s" in by["hung"]["error"]
    finally:
        hang.close()


@pytest.mark.e2e
def test_human_view_names_everything(sim_host: SimHost) -> None:
    trainer = tagged("trainer")
    cfg = sim_host.write_config(f'[services.{trainer}]\nmatch = ["{trainer}"]\nmemory = "120GiB"\n')
    comfy = tagged("comfyui")
    hold = sim_host.hold(comfy, "20GiB")
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg), "COLUMNS": "140", "NO_COLOR": "1"}
    deadline = time.monotonic() + 10
    while True:
        r = subprocess.run(
            [gpuctl_exe(), "status"], env=env, capture_output=True, text=True, check=False
        )
        if "BUSY" in r.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.returncode == 0, r.stderr
    for word in ("GPU memory", "20.0 GiB / 128.0 GiB", str(hold.pid), comfy, trainer, "BUSY"):
        assert word in r.stdout, (word, r.stdout)


@pytest.mark.e2e
def test_locks_with_an_unreadable_host(sim_host: SimHost) -> None:
    """The host that answered gets its table; the one that did not, an error and a hint on
    stderr (not a cell of the table), and the exit code is 4 (UNKNOWN), text or JSON."""
    svc = unique_name("vllm")
    dead = free_port()
    cfg = sim_host.write_config(
        f'[services.{svc}]\nhost = "sim"\nhealth = "http://127.0.0.1:{free_port()}/health"\n'
        'memory = "8GiB"\n'
    )
    cfg.write_text(
        cfg.read_text()
        + f'\n[hosts.down]\nagent = "http://127.0.0.1:{dead}"\ntoken_env = "GPUCTL_DEMO_TOKEN"\n'
    )
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg), "COLUMNS": "80", "NO_COLOR": "1"}
    r = subprocess.run(
        [gpuctl_exe(), "locks"], env=env, capture_output=True, text=True, check=False
    )
    assert r.returncode == 4, r.stderr
    assert svc in r.stdout and "down" not in r.stdout and "refused" not in r.stdout
    err = r.stderr.splitlines()
    assert err[0] == f"gpuctl: error: down: connection refused by http://127.0.0.1:{dead}", err
    assert err[1].startswith("  hint: ") and "gpuctl agent" in err[1]
    r = subprocess.run(
        [gpuctl_exe(), "locks", "--json"], env=env, capture_output=True, text=True, check=False
    )
    assert r.returncode == 4
    rows = {row["host"]: row for row in json.loads(r.stdout)["records"]}
    assert "refused" in rows["down"]["error"] and rows["sim"]["service"] == svc


@pytest.mark.e2e
def test_ensure_waiting_on_a_keyword_match_names_it(sim_host: SimHost) -> None:
    """Someone else's process whose command line carries the service's keyword keeps
    `ensure` waiting (it may be loading); when the wait ends, the reason names that
    process's command and the hint says how to stop it counting."""
    word = tagged("vllm")
    svc = unique_name("chat")
    cfg = sim_host.write_config(
        f'[services.{svc}]\nhost = "sim"\nhealth = "http://127.0.0.1:{free_port()}/health"\n'
        f'memory = "8GiB"\nmatch = ["{word}"]\nlauncher = "process"\ncommand = "sleep 60"\n'
    )
    other = subprocess.Popen(
        ["python3", "-c", "import time; time.sleep(60)", word, "serve"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        r = subprocess.run(
            [gpuctl_exe(), "ensure", svc, "--timeout", "2s"],
            env={**os.environ, "GPUCTL_CONFIG": str(cfg), "COLUMNS": "200"},
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        other.kill()
        other.wait()
    assert r.returncode == 5, r.stderr
    assert f"pid {other.pid} starting (not on the GPU yet): python3 -c" in r.stderr, r.stderr
    assert f"{word} serve" in r.stderr
    hints = [ln for ln in r.stderr.splitlines() if ln.strip().startswith("hint:")]
    assert len(hints) == 1 and "not yours? narrow the service's `match` keywords" in hints[0]


@pytest.mark.e2e
def test_ensure_with_a_refused_token_hints_once(sim_host: SimHost) -> None:
    svc = unique_name("chat")
    cfg = sim_host.write_config(
        f'[services.{svc}]\nhost = "sim"\nhealth = "http://127.0.0.1:{free_port()}/health"\n'
        'memory = "1GiB"\nlauncher = "process"\ncommand = "sleep 60"\n'
    )
    r = subprocess.run(
        [gpuctl_exe(), "ensure", svc],
        env={**os.environ, "GPUCTL_CONFIG": str(cfg), "GPUCTL_DEMO_TOKEN": "wrong"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 4, r.stderr
    assert "refused our token (HTTP 401)" in r.stderr
    assert r.stderr.count("hint") == 1, r.stderr
    assert "  hint: check hosts.sim.token_env / token_file; `gpuctl status -H sim`" in r.stderr
