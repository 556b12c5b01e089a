"""The original scenario end to end on the simulated GPU (120 GiB), through the CLI:

- a VLM photo batch (30 GiB, priority 50, resume = true, kind = "batch") works through a
  folder of items, checkpointing each;
- whisper runs through `gpuctl run` (15 GiB, priority 60, not preemptible);
- the chat LLM (80 GiB, priority 100, preempt = true, a simulated vLLM with a slow load)
  arrives: the batch is preempted, whisper stays, the LLM starts once;
- the chat goes idle past its timeout: `gpuctl reclaim` stops the LLM and the batch
  resumes from its checkpoint. No item is processed twice or lost; nothing ran out of
  memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import (
    cli_env,
    kill_servers,
    launches_in_log,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    unique_name,
)

# Enough work (160 x 150 ms = 24 s) that the batch is still busy when chat preempts it
# on a loaded machine: with 40 (6 s) it once finished every item before chat arrived
# (`done_at_preemption < ITEMS` failed), which proves nothing about checkpoints.
ITEMS = 160


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "120GiB")
    api._reset_for_tests()
    with SimHost(gpu_memory="120GiB", root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h
    api._reset_for_tests()


def claims(host: SimHost) -> dict[str, int]:
    from gpuctl.sim.gpu import SimGpu

    return {c.name: c.pid for c in SimGpu(host.sim_dir).claims()}


def used_gib(host: SimHost) -> float:
    from gpuctl.sim.gpu import SimGpu

    return sum(c.memory_mib for c in SimGpu(host.sim_dir).claims()) / 1024


def wait_for(cond, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def batch_pids(tag: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        argv = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and "gpuctl.sim.batch" in argv and tag in argv:
            out.append(p.info["pid"])
    return out


@pytest.mark.slow
def test_the_original_scenario(host: SimHost, tmp_path: Path) -> None:
    chat, photos, whisper = unique_name("chat"), unique_name("photos"), unique_name("whisper")
    pc, pp = free_port(), free_port()
    items = tmp_path / "photos"
    items.mkdir()
    for i in range(ITEMS):
        (items / f"img{i:03d}.jpg").write_text(f"photo {i}")
    batch_cmd = (
        f"{sys.executable} -m gpuctl.sim.batch --name {photos} --memory 30GiB "
        f"--items {items} --port {pp} --per-item 150ms"
    )
    cfg = host.write_config(
        f"""
[services.{chat}]
launcher = "process"
command = {json.dumps(model_server_command(chat, pc, "80GiB", "3s"))}
health = "http://127.0.0.1:{pc}/health"
memory = "80GiB"
priority = 100
preempt = true
idle_timeout = "2s"
health_timeout = "60s"

[services.{photos}]
launcher = "process"
command = {json.dumps(batch_cmd)}
health = "http://127.0.0.1:{pp}/health"
match = ["{photos}"]
memory = "30GiB"
priority = 50
resume = true
kind = "batch"
idle_timeout = "never"
stop_timeout = "5s"
health_timeout = "60s"
"""
    )
    log = items / ".done.log"
    wjob = None
    try:
        r = run_ensure(cfg, photos)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: log.exists() and len(log.read_text().split("\n")) > 5, "items done")

        wjob = subprocess.Popen(
            [
                gpuctl_exe(),
                "run",
                "--memory",
                "15GiB",
                "--priority",
                "60",
                "--name",
                whisper,
                "--",
                sys.executable,
                "-m",
                "gpuctl",
                "sim",
                "hold",
                "--name",
                whisper,
                "--memory",
                "15GiB",
            ],
            env=cli_env(cfg),
            stdout=subprocess.DEVNULL,
        )
        wait_for(lambda: used_gib(host) == 45, "whisper holds its memory")

        # Chat arrives: the batch is preempted, whisper stays, the LLM starts once.
        r = run_ensure(cfg, chat)
        out = json.loads(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr
        assert any(f"preempted {photos}" in n for n in out["notes"]), out["notes"]
        assert batch_pids(photos) == [] and photos not in claims(host)
        assert read_record(host, photos)["phase"] == "preempted"
        assert whisper in claims(host) and wjob.poll() is None
        assert len(server_pids(chat)) == 1
        assert used_gib(host) == 95
        done_at_preemption = len(log.read_text().splitlines())
        assert done_at_preemption < ITEMS

        # While the chat holds it, the batch stays preempted (resume refuses: exit 3).
        r = subprocess.run(
            [gpuctl_exe(), "resume", photos],
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 3, r.stderr

        # Chat idle past its timeout: reclaim stops the LLM, then resumes the batch.
        deadline = time.time() + 60
        while True:
            r = subprocess.run(
                [gpuctl_exe(), "reclaim"],
                env=cli_env(cfg),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert r.returncode == 0, r.stdout + r.stderr
            if f"resumed {photos}" in r.stdout:
                break
            assert time.time() < deadline, r.stdout
            time.sleep(0.5)
        assert f"stopped {chat}" in r.stdout
        assert server_pids(chat) == []
        wait_for(lambda: len(batch_pids(photos)) == 1, "the batch runs again")
        wait_for(lambda: len(log.read_text().splitlines()) == ITEMS, "every item done", timeout=120)
        # Resumed from its checkpoint: each item exactly once, none lost.
        lines = log.read_text().splitlines()
        counts = Counter(lines)
        assert sorted(counts) == [f"done img{i:03d}.jpg" for i in range(ITEMS)]
        assert max(counts.values()) == 1
        assert wjob.poll() is None  # whisper ran through it all
        assert launches_in_log(host.state_dir / "logs" / f"{chat}.log") == 1
        for name in (chat, photos):
            text = (host.state_dir / "logs" / f"{name}.log").read_text().lower()
            assert "out of memory" not in text
    finally:
        if wjob is not None:
            wjob.send_signal(signal.SIGTERM)
            wjob.wait(timeout=30)
        kill_servers(chat)
        for pid in batch_pids(photos):
            os.kill(pid, signal.SIGKILL)
