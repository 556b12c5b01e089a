"""An idle server yields (issue 16), end to end on the simulated GPU (120 GiB): real
agent, real store, real servers started by the process launcher, the installed CLI.

A server unused for its ``yield_after`` is a victim for any start or job that asks to
preempt, whatever the priorities; a use puts it back under its priority's protection;
a batch never yields; ``status`` says which servers would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests import conftest
from tests.conftest import gpuctl_exe, gpuctl_in_process
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

pytestmark = pytest.mark.e2e

# Short enough for a test; the rule is the same at the default 10 minutes.
# Wide enough that what runs between a use and the next look (an in-process `touch`,
# then a spawned `ensure --preempt`) fits in it on a loaded machine: 6 s did not, beside
# two CPU hogs.
YIELD_AFTER_S = 10.0


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        kill_servers(n)


def service(name: str, gib: int, priority: int, extra: str = "") -> str:
    port = free_port()
    toml = service_toml(
        name, port, model_server_command(name, port, f"{gib}GiB", "1s"), extra=extra
    )
    return toml.replace('memory = "20GiB"', f'memory = "{gib}GiB"\npriority = {priority}')


def gpuctl(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return conftest.gpuctl(cfg, *args, env={"COLUMNS": "250"})  # the table's reasons on one line


def status_of(cfg: Path, name: str) -> dict[str, Any]:
    r = gpuctl_in_process(cfg, "status", "--json", env={"COLUMNS": "250"})
    (s,) = [s for s in json.loads(r.stdout)["services"] if s["name"] == name]
    return s


def idle_past_yield_after(host: SimHost, name: str) -> None:
    """Wait until ``name``'s record says it has been unused for its ``yield_after``."""
    rec = read_record(host, name)
    used = rec["last_used"] if rec["last_used"] is not None else rec["since"]
    time.sleep(max(0.0, used + YIELD_AFTER_S + 0.3 - time.time()))


@pytest.mark.slow
def test_an_idle_server_of_higher_priority_yields_to_ensure_preempt(
    host: SimHost, names: list[str]
) -> None:
    """Chat (80 GiB, priority 100) refused a job of priority 60 for its 30-minute idle
    timeout. Used within its yield_after it still does (BUSY says when it yields); idle
    past it, the job is PREEMPTABLE naming how long chat was idle, `status` says chat
    would yield, `--preempt` stops it; a touch in between puts it back out of reach."""
    chat, job = unique_name("chat"), unique_name("job")
    names += [chat, job]
    cfg = host.write_config(
        f'[defaults]\nyield_after = "{YIELD_AFTER_S:g}s"\n\n'
        + service(chat, 80, 100)
        + "\n"
        + service(job, 80, 60)
    )
    assert run_ensure(cfg, chat).returncode == 0
    (chat_pid,) = server_pids(chat)

    # Just used: its priority protects it, and the refusal says until when.
    r = run_ensure(cfg, job, "--preempt")
    out = json.loads(r.stdout)
    assert r.returncode == 3 and out["decision"] == "BUSY", r.stdout
    assert f"{chat}: priority 100 is not below 60 (used " in out["reason"], out["reason"]
    assert f"it yields once idle {YIELD_AFTER_S:g}s)" in out["reason"], out["reason"]
    s = status_of(cfg, chat)
    assert (s["yields"], s["idle_s"]) == (False, None)

    idle_past_yield_after(host, chat)
    s = status_of(cfg, chat)
    assert s["yields"] is True and s["idle_s"] >= YIELD_AFTER_S, s
    table = gpuctl_in_process(cfg, "status", env={"COLUMNS": "250"}).stdout
    assert "yields to any start that preempts" in table, table

    # A use (touch) and it no longer yields.
    assert gpuctl_in_process(cfg, "touch", chat, env={"COLUMNS": "250"}).returncode == 0
    assert run_ensure(cfg, job, "--preempt").returncode == 3
    assert server_pids(chat) == [chat_pid]

    idle_past_yield_after(host, chat)
    r = run_ensure(cfg, job)  # without --preempt: PREEMPTABLE, nothing stopped
    out = json.loads(r.stdout)
    assert r.returncode == 3 and out["decision"] == "PREEMPTABLE", r.stdout
    assert f"fits once {chat} (priority 100, idle for " in out["reason"], out["reason"]
    assert server_pids(chat) == [chat_pid]
    (victim,) = status_of(cfg, job)["victims"]
    assert victim["name"] == chat and victim["idle_s"] >= YIELD_AFTER_S

    r = run_ensure(cfg, job, "--preempt")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["outcome"] == "ready", r.stdout + r.stderr
    assert any(f"preempted {chat} to make room" in n for n in out["notes"]), out["notes"]
    assert server_pids(chat) == [] and len(server_pids(job)) == 1
    assert read_record(host, chat)["phase"] == "preempted"


def test_a_run_preempt_job_stops_an_idle_server_but_never_a_batch(
    host: SimHost, names: list[str], tmp_path: Path
) -> None:
    """`gpuctl run --preempt` is a job that asks to preempt: an idle server of higher
    priority yields to it. A batch of the same priority, idle as far as requests go, is
    working: it never yields, and the job is BUSY naming why."""
    chat, batch, never = unique_name("chat"), unique_name("batch"), unique_name("keep")
    names += [chat, batch, never]
    cfg = host.write_config(
        f'[defaults]\nyield_after = "{YIELD_AFTER_S:g}s"\n\n'
        + service(batch, 60, 100, 'kind = "batch"')
        + "\n"
        + service(never, 20, 100, 'yield_after = "never"')
        + "\n"
        + service(chat, 30, 100)
    )
    for n in (batch, never, chat):
        assert run_ensure(cfg, n).returncode == 0, n
    for n in (batch, never, chat):
        idle_past_yield_after(host, n)
    assert status_of(cfg, batch)["yields"] is False
    assert status_of(cfg, never)["yields"] is False
    assert status_of(cfg, chat)["yields"] is True

    marker = tmp_path / "ran"
    touch = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    # 40 GiB: chat's 30 and the 10 free are enough; the batch's and keep's are not asked.
    r = gpuctl(cfg, "run", "-m", "40GiB", "-p", "60", "--preempt", "--timeout", "60s", "--", *touch)
    assert r.returncode == 0, r.stderr
    assert f"preempted {chat} to make room" in r.stderr, r.stderr
    assert marker.exists()
    assert server_pids(chat) == [] and len(server_pids(batch)) == 1
    assert len(server_pids(never)) == 1

    # 70 GiB would need the batch or keep: neither yields.
    r = gpuctl(cfg, "run", "-m", "70GiB", "-p", "60", "--preempt", "--timeout", "5s", "--", "true")
    assert r.returncode == 3, r.stderr
    assert f"{batch}: priority 100 is not below 60" in r.stderr, r.stderr
    assert f'{never}: priority 100 is not below 60 (yield_after = "never")' in r.stderr, r.stderr
    assert len(server_pids(batch)) == 1 and len(server_pids(never)) == 1


def test_a_use_between_the_plan_and_the_victims_lease_keeps_the_server(
    host: SimHost, names: list[str]
) -> None:
    """The plan saw chat idle; a request (here a touch) comes before the preemptor takes
    chat's lease. Under the lease it is no longer idle: nothing is stopped, and the
    preemptor, looking again, is BUSY."""
    chat, job = unique_name("chat"), unique_name("job")
    names += [chat, job]
    cfg = host.write_config(
        f'[defaults]\nyield_after = "{YIELD_AFTER_S:g}s"\n\n'
        + service(chat, 80, 100)
        + "\n"
        + service(job, 80, 60)
    )
    assert run_ensure(cfg, chat).returncode == 0
    (chat_pid,) = server_pids(chat)
    idle_past_yield_after(host, chat)
    env = {**cli_env(cfg), "GPUCTL_FAILPOINTS": "preempt.before_leases=stop"}
    p = subprocess.Popen(
        [gpuctl_exe(), "ensure", job, "--preempt", "--json", "--timeout", "30s"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    line = p.stderr.readline()
    assert "gpuctl failpoint preempt.before_leases: stop" in line, line
    assert gpuctl_in_process(cfg, "touch", chat, env={"COLUMNS": "250"}).returncode == 0
    os.kill(p.pid, signal.SIGCONT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, out + err
    assert json.loads(out)["decision"] == "BUSY", out
    assert server_pids(chat) == [chat_pid]
    assert read_record(host, chat)["phase"] == "running"
