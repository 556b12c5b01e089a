"""A service whose lease is held counts at its budget, admitted or not yet.

The real CLI on the 120 GiB simulated GPU with its agent. A caller that took a
service's lease (an ``ensure`` waiting for the admission lock, or for the memory of what
it preempts) may start it any moment: ``status`` and ``ensure`` of another service
count that service's budget as promised, as README says, rather than as nothing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.store import DirectStore, holder_here
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    model_server_command,
    run_ensure,
    service_toml,
    unique_name,
)

GiB = 1024


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch, "120GiB")


def status_json(cfg: Path) -> dict[str, Any]:
    r = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        check=False,
    )
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


def test_a_held_lease_not_yet_admitted_counts_at_its_budget(host: SimHost) -> None:
    big, small = unique_name("big"), unique_name("small")
    toml = ""
    for svc, gib in ((big, 80), (small, 50)):
        port = free_port()
        t = service_toml(svc, port, model_server_command(svc, port, f"{gib}GiB", "1s"))
        toml += t.replace('memory = "20GiB"', f'memory = "{gib}GiB"') + "\n"
    cfg = host.write_config(toml)
    store = DirectStore(host.state_dir)
    # Another caller's ensure of big took its lease and waits for admission: its record
    # is not `starting` yet (the phase it had before).
    starter = holder_here("ensure")
    granted, rec = store.acquire(big, starter, 600)
    assert granted and rec.phase.value != "starting"
    try:
        obj = status_json(cfg)
        rows = {s["name"]: s for s in obj["services"]}
        assert rows[big]["decision"] == "LOADING", rows[big]
        # 80 GiB promised to big: 50 more do not fit in 120.
        assert rows[small]["decision"] == "BUSY", rows[small]
        (h,) = obj["hosts"]
        assert h["memory_promised_mib"] == 80 * GiB, h
        r = run_ensure(cfg, small)
        assert r.returncode == 3, r.stdout + r.stderr
        assert json.loads(r.stdout)["launched"] is False
        # The lease let go (that caller gave up): the room is free again, and an ensure
        # of big itself is not held back by any lease of its own.
        store.release(big, starter.id)
        assert status_json(cfg)["hosts"][0]["memory_promised_mib"] == 0
        r = run_ensure(cfg, big)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["launched"] is True
    finally:
        kill_servers(big)
        kill_servers(small)
