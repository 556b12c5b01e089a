"""`gpuctl status` by priority, end to end on the simulated GPU (120 GiB): real agent on
loopback, real servers started by the process launcher, real `gpuctl run` jobs, a real
foreign process, the installed CLI.

- a service that fits once permitted victims stop is PREEMPTABLE in `status` (text and
  JSON), naming the victims and `gpuctl ensure X --preempt`, exactly as `ensure` says;
- BUSY names who holds the GPU: pid, command, memory, and the service or run job and its
  priority when it is ours; in `status` and in `ensure`, through the agent and directly;
- a server found only by its start nonce, and the processes it forked, are its
  service's, with the memory they hold, in `status` through the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    cli_env,
    direct_config,
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
from tests.test_schemas import check

pytestmark = pytest.mark.e2e

GIB = 1024


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


def service(name: str, port: int, gib: int, priority: int, command: str | None = None) -> str:
    cmd = command or model_server_command(name, port, f"{gib}GiB", "1s")
    toml = service_toml(name, port, cmd)
    return toml.replace('memory = "20GiB"', f'memory = "{gib}GiB"\npriority = {priority}')


def status_json(cfg: Path) -> tuple[int, dict[str, Any]]:
    r = gpuctl_in_process(cfg, "status", "--json")
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def status_text(cfg: Path) -> str:
    r = gpuctl_in_process(cfg, "status", env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())  # the table's wrapping and borders aside


def ensure_text(cfg: Path, name: str) -> list[str]:
    """`gpuctl ensure NAME`'s lines on stderr, as a person reads them (exit 3 expected)."""
    env = {**cli_env(cfg), "COLUMNS": "400", "NO_COLOR": "1"}
    r = subprocess.run(
        [gpuctl_exe(), "ensure", name, "--timeout", "30s"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    return r.stderr.splitlines()


def svc_of(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (s,) = [s for s in obj["services"] if s["name"] == name]
    return s


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_job(cfg: Path, name: str, gib: int, *flags: str) -> subprocess.Popen[bytes]:
    """`gpuctl run --memory G --name N [flags] -- gpuctl sim hold …`: a job holding `gib`."""
    hold = [sys.executable, "-m", "gpuctl", "sim", "hold", "--name", name, "--memory", f"{gib}GiB"]
    return subprocess.Popen(
        [gpuctl_exe(), "run", "--memory", f"{gib}GiB", "--name", name, *flags, "--", *hold],
        env=cli_env(cfg),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_status_is_preemptable_naming_its_victims_and_busy_naming_holders(
    host: SimHost,
) -> None:
    """120 GiB: a foreign 15 GiB job, a 30 GiB batch (priority 50, ours), a 10 GiB
    `gpuctl run --preemptible` job (priority 40) and a 10 GiB run job that is not
    preemptible (priority 70). 55 GiB are free.

    - chat (80 GiB, priority 100) fits once the batch stops: PREEMPTABLE, one victim;
    - llm (90 GiB, priority 100) needs the batch and the preemptible job stopped;
    - big (90 GiB, priority 50) may stop nothing (equal priority, a foreign process, a
      job that is not preemptible, a job of lower priority freeing too little): BUSY,
      naming each holder with its service or job and priority.
    The same through the agent and without it, and `ensure` says the same."""
    chat, llm, big, batch = (unique_name(n) for n in ("chat", "llm", "big", "batch"))
    pjob, keep = unique_name("pjob"), unique_name("keep")
    ports = {n: free_port() for n in (chat, llm, big, batch)}
    toml = "\n".join(
        [
            service(chat, ports[chat], 80, 100),
            service(llm, ports[llm], 90, 100),
            service(big, ports[big], 90, 50),
            service(batch, ports[batch], 30, 50),
        ]
    )
    cfg = host.write_config(toml)
    direct = direct_config(host, toml)
    foreign = host.hold(unique_name("comfyui"), "15GiB")
    jobs = [run_job(cfg, pjob, 10, "--priority", "40", "--preemptible")]
    jobs.append(run_job(cfg, keep, 10, "--priority", "70"))
    try:
        r = run_ensure(cfg, batch)
        assert r.returncode == 0, r.stdout + r.stderr
        (batch_pid,) = server_pids(batch)
        wait_until(lambda: sim_claims(host, pjob) and sim_claims(host, keep), "the jobs' memory")
        (pjob_pid,), (keep_pid,) = sim_claims(host, pjob), sim_claims(host, keep)

        for via in (cfg, direct):
            rc, obj = status_json(via)
            assert rc == 0, obj
            check("status", obj)  # victims and holders as schemas/status.schema.json says
            s = svc_of(obj, chat)
            assert s["decision"] == "PREEMPTABLE", s
            assert s["victims"] == [
                {
                    "name": batch,
                    "gpu": 0,
                    "frees_mib": 30 * GIB,
                    "priority": 50,
                    "job": False,
                    "idle_s": None,
                }
            ]
            assert f"fits once {batch} (priority 50, 30.0 GiB) stops" in s["reason"]
            assert s["hint"].startswith(f"`gpuctl ensure {chat} --preempt` stops {batch} ")
            assert s["gpu"] == 0
            s = svc_of(obj, llm)
            assert s["decision"] == "PREEMPTABLE", s
            assert sorted(v["name"] for v in s["victims"]) == sorted([batch, f"run.{pjob}"])
            assert [v["job"] for v in s["victims"] if v["name"] == f"run.{pjob}"] == [True]
            s = svc_of(obj, big)
            assert s["decision"] == "BUSY" and s["victims"] == [], s
            holders = {h["pid"]: h for h in s["holders"]}
            assert holders[foreign.pid]["service"] is None
            assert holders[foreign.pid]["priority"] is None
            assert holders[foreign.pid]["memory_mib"] == 15 * GIB
            assert "comfyui" in holders[foreign.pid]["command"]
            assert (holders[batch_pid]["service"], holders[batch_pid]["priority"]) == (batch, 50)
            assert holders[batch_pid]["memory_mib"] == 30 * GIB
            assert (holders[pjob_pid]["service"], holders[pjob_pid]["priority"]) == (
                f"run.{pjob}",
                40,
            )
            assert (holders[keep_pid]["service"], holders[keep_pid]["priority"]) == (
                f"run.{keep}",
                70,
            )
            # The reason names them too, and why none of them may be stopped.
            assert f"pid {batch_pid} (" in s["reason"] and f"= {batch}, priority 50" in s["reason"]
            assert f"{batch}: priority 50 is not below 50" in s["reason"]
            # Processes of run jobs are named in the process list.
            procs = {p["pid"]: p for p in obj["hosts"][0]["processes"]}
            assert procs[pjob_pid]["service"] == f"run.{pjob}"
            assert procs[foreign.pid]["service"] is None

        text = status_text(cfg)
        assert "PREEMPTABLE" in text and "BUSY" in text
        assert f"fits once {batch} (priority 50, 30.0 GiB) stops" in text
        assert f"(hint: `gpuctl ensure {chat} --preempt` stops {batch} to make room" in text
        assert f"= run.{keep}, priority 70" in text, text

        # ensure decides the same way: PREEMPTABLE with the same plan, BUSY with holders.
        out = json.loads(run_ensure(cfg, chat).stdout)
        assert out["decision"] == "PREEMPTABLE" and out["exit_code"] == 3
        assert f"fits once {batch} (priority 50, 30.0 GiB) stops" in out["reason"]
        assert out["hint"] == svc_of(status_json(cfg)[1], chat)["hint"]
        # Its text says PREEMPTABLE as status does (it said 'BUSY:'), with the same hint.
        said = ensure_text(cfg, chat)
        assert said[0].startswith(f"{chat}: PREEMPTABLE: "), said
        assert f"fits once {batch} (priority 50, 30.0 GiB) stops" in said[0], said
        assert said[-1] == f"  hint: {out['hint']}", said
        for via in (cfg, direct):
            out = json.loads(run_ensure(via, big).stdout)
            assert out["decision"] == "BUSY" and out["exit_code"] == 3, out
            for words in (
                f"pid {batch_pid} (",
                f"= {batch}, priority 50",
                f"pid {foreign.pid} (",
                "15.0 GiB)",
                f"pid {keep_pid} (",
                f"= run.{keep}, priority 70",
                f"= run.{pjob}, priority 40",
                f"run.{keep}: a run job, not --preemptible",
            ):
                assert words in out["reason"], (words, out["reason"])
            # What to do: stop our service (a run job ends with its command), ask the
            # foreign process's user.
            assert f"`gpuctl stop {batch}`" in out["hint"] and "gpuctl stop run." not in out["hint"]
            assert "ask root to free it" in out["hint"], out["hint"]
        assert server_pids(batch) == [batch_pid]  # status and refusals stopped nothing
    finally:
        for j in jobs:
            j.send_signal(signal.SIGTERM)
            j.wait(30)
        for pid in sim_claims(host, pjob) + sim_claims(host, keep):
            os.kill(pid, signal.SIGKILL)
        for n in (chat, llm, big, batch):
            kill_servers(n)


def test_a_server_found_by_its_nonce_is_its_service_with_its_memory(host: SimHost) -> None:
    """The caller is killed between spawning and recording its server, which runs under
    `sh -c` (the shell keeps its parent: the server is the shell's child). The record
    names no pid, only the start nonce. Through the agent (and directly), `status` shows
    the shell and its child as the service's, the service holding the child's memory."""
    a, server = unique_name("win"), unique_name("anon")  # its command does not name `a`
    rival = unique_name("rival")
    port = free_port()
    inner = model_server_command(server, port, "40GiB", "1s")
    toml = service(a, port, 40, 50, f"sh -c '{inner}; exit 0'")
    toml += "\n" + service(rival, free_port(), 100, 50)
    cfg = host.write_config(toml)
    direct = direct_config(host, toml)
    try:
        caller = ensure_paused_at(cfg, a)
        end_in_window(caller, signal.SIGKILL)
        rec = read_record(host, a)
        assert rec["phase"] == "starting" and rec["start_nonce"] and not rec["handle"]
        (child,) = wait_until(lambda: sim_claims(host, server), "the server's memory")

        def loaded(via: Path) -> dict[str, Any] | None:
            _, obj = status_json(via)
            return obj if svc_of(obj, a)["memory_mib"] == 40 * GIB else None

        for via in (cfg, direct):
            obj = wait_until(lambda via=via: loaded(via), "the service to hold its memory")
            s = svc_of(obj, a)
            assert child in s["pids"], s
            procs = {p["pid"]: p for p in obj["hosts"][0]["processes"]}
            assert procs[child]["service"] == a and procs[child]["memory_mib"] == 40 * GIB
            # A rival that does not fit is BUSY, naming that server as `a`'s.
            s = svc_of(obj, rival)
            assert s["decision"] == "BUSY", s
            assert [(h["pid"], h["service"], h["priority"]) for h in s["holders"]] == [
                (child, a, 50)
            ]
            assert f"pid {child} (" in s["reason"] and f"= {a}, priority 50" in s["reason"]
            # ensure says the same, and its hint knows the server is ours (by its record,
            # not its command line): stop it, rather than ask its user.
            out = json.loads(run_ensure(via, rival).stdout)
            assert out["decision"] == "BUSY" and f"= {a}, priority 50" in out["reason"], out
            assert f"`gpuctl stop {a}`" in out["hint"] and "ask root" not in out["hint"], out
        # Through the agent the shell (no GPU memory) is listed for older clients, as `a`'s.
        _, obj = status_json(cfg)
        shells = [p for p in obj["hosts"][0]["processes"] if p["pid"] != child]
        assert shells and all(p["service"] == a and p["on_gpu"] is False for p in shells)
        text = status_text(cfg)
        assert f"{child} root 40.0 GiB 0% {a} python" in text, text
        # The agent's /metrics counts the child's memory under its service as well.
        metrics = httpx.get(
            f"{host.agent_url}/metrics", headers={"Authorization": f"Bearer {host.token}"}
        ).text
        sample = f'gpuctl_process_memory_bytes{{gpu="0",service="{a}"}} {40 * 2**30}'
        assert sample in metrics.splitlines(), metrics
    finally:
        kill_servers(server)
