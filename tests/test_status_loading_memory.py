"""A LOADING service's MEMORY is what its processes hold now, against its budget, as for
READY: a server 40 GiB into its load under a start's lease was shown as ``- / 80.0 GiB``
(and ``memory_mib: 0`` in JSON) while the process table listed its 40 GiB. The real
agent on the simulated GPU, a real `gpuctl ensure` waiting (holding the lease), and the
installed `gpuctl status`, text and JSON."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.core.units import format_mib
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    kill_servers,
    model_server_command,
    service_toml,
    spawn_ensure,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


def _status(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuctl status ARGS``, in process: the test polls it while the server loads, and an
    interpreter spawned per look would cost the CPU the loading server and its waiter
    need."""
    return gpuctl_in_process(cfg, "status", *args, env={"COLUMNS": "220", "NO_COLOR": "1"})


def _holding(obj: dict[str, Any], svc: str) -> list[dict[str, Any]]:
    """The service's processes on the GPU that hold memory, in one status object."""
    procs = obj["hosts"][0]["processes"]
    return [p for p in procs if p["service"] == svc and p["on_gpu"] and p["memory_mib"]]


@pytest.mark.e2e
def test_a_loading_row_shows_what_its_server_holds_under_the_lease(host: SimHost) -> None:
    svc = unique_name("vllm")
    port = free_port()
    cfg = host.write_config(
        service_toml(svc, port, model_server_command(svc, port, memory="20GiB", load_time="60s"))
    )
    waiter = spawn_ensure(cfg, svc)
    try:
        deadline = time.monotonic() + 40
        while True:
            r = _status(cfg, "--json")
            obj = json.loads(r.stdout)
            row = next(s for s in obj["services"] if s["name"] == svc)
            held = _holding(obj, svc)
            # Under the waiting ensure's lease, with its server on the GPU and growing.
            if (held and row["reason"].startswith("being started by")) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.3)
        assert held and row["decision"] == "LOADING", (row, obj["hosts"][0]["processes"])
        assert row["reason"].startswith("being started by"), row
        assert row["memory_mib"] == sum(p["memory_mib"] for p in held) > 0, row
        assert row["budget_mib"] == 20 * 1024
        assert {p["pid"] for p in held} <= set(row["pids"]), row

        # The text view: the row's held figure is the process table's, in the same output.
        while True:
            text = _status(cfg).stdout
            pid = held[0]["pid"]
            proc = re.search(rf"^\W*{pid}\s+\S+\s+(\d+(?:\.\d+)? [GM]iB)\s", text, re.M)
            mine = re.search(
                rf"^\W*{svc}\s+LOADING\s+(.+?) / 20\.0 GiB\s+being started", text, re.M
            )
            if (proc and mine) or time.monotonic() > deadline + 20:
                break
            time.sleep(0.3)
        assert proc and mine, text
        assert mine.group(1) == proc.group(1) != format_mib(0), text
    finally:
        waiter.kill()
        waiter.communicate()
        kill_servers(svc)
