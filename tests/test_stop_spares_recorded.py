"""`gpuctl stop X` with no recorded server falls back to X's match keywords, and must
never stop a process another record names: a `gpuctl run` job's CMD (not preemptible)
or another service's recorded server, whose command lines carry X's keyword.

Found by the randomised trials (tests/trials.py): a job named after a service was
stopped by `gpuctl stop` of that service, though it was no permitted victim.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import (
    agent_host,
    cli_env,
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


def test_stop_by_keyword_spares_a_run_job_and_another_services_server(host: SimHost) -> None:
    chat = unique_name("chat")
    # Its name carries chat's keyword (chat's name), and so does its server's command.
    other = f"{chat}embed"
    ports = free_port(), free_port()
    cfg = host.write_config(
        service_toml(chat, ports[0], model_server_command(chat, ports[0], "20GiB", "0.2s"))
        + service_toml(other, ports[1], model_server_command(other, ports[1], "20GiB", "0.2s"))
    )
    job_claim = f"{chat}-transcribe"
    hold = [sys.executable, "-m", "gpuctl.sim.hold", "--name", job_claim, "--memory", "15GiB"]
    job = subprocess.Popen(
        [gpuctl_exe(), "run", "--memory", "15GiB", "--name", "whisper", "--", *hold],
        env=cli_env(cfg),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while not sim_claims(host, job_claim):
            assert time.time() < deadline and job.poll() is None, "the job never held its memory"
            time.sleep(0.05)
        assert run_ensure(cfg, other).returncode == 0
        other_pid = read_record(host, other)["handle"]["pid"]
        assert read_record(host, "run.whisper")["phase"] == "running"

        r = subprocess.run(
            [gpuctl_exe(), "stop", chat, "--json"],
            env=cli_env(cfg),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["stopped"] == [], out
        # Both are still there: the job's CMD holds its memory, the other server runs.
        assert sim_claims(host, job_claim) and job.poll() is None
        assert server_pids(other) == [other_pid]
        assert read_record(host, "run.whisper")["phase"] == "running"
    finally:
        job.terminate()
        job.wait(timeout=30)
        for name in (chat, other):
            kill_servers(name)
