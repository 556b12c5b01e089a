"""`gpuctl locks`' STARTS counts the start attempts a record keeps, and the record keeps
only its last ``MAX_ATTEMPTS_KEPT`` (10) and no total: past that the column stopped at
10 as if it were the count. It now says ``10+`` once the history is full, and the JSON
says ``starts`` and ``starts_capped``. Real starts (the process launcher, a simulated
model server) on the simulated GPU without an agent, through the installed CLI."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.record import MAX_ATTEMPTS_KEPT
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.sim.host import free_port
from tests.conftest import gpuctl_either
from tests.ensure_helpers import kill_servers, unique_name


def _locks(env: dict[str, str], svc: str) -> tuple[str, dict[str, Any]]:
    """The STARTS cell of the service's row in the text view, and its JSON row."""
    r = gpuctl_either(env, "locks")
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.split()[:2] == ["box", svc])
    j = gpuctl_either(env, "locks", "--json")
    assert j.returncode == 0, j.stderr
    rec = next(x for x in json.loads(j.stdout)["records"] if x["service"] == svc)
    return row.split()[-1], rec


def _start_and_stop(env: dict[str, str], svc: str) -> None:
    for cmd in ("ensure", "stop"):
        r = gpuctl_either(env, cmd, svc)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)


@pytest.mark.slow
@pytest.mark.e2e
def test_starts_past_the_kept_history_show_as_at_least(tmp_path: Path) -> None:
    assert MAX_ATTEMPTS_KEPT == 10  # the figure the column and the schema name
    svc, port = unique_name("web"), free_port()
    sim = tmp_path / "sim"
    sim.mkdir()
    server = (
        f"{sys.executable} -m gpuctl sim model-server --name {svc} --memory 1GiB "
        f"--load-time 0s --port {port}"
    )
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[hosts.box]\nprobe = "sim"\nsim_dir = "{sim}"\n\n[services.{svc}]\n'
        f'launcher = "process"\ncommand = {json.dumps(server)}\n'
        f'health = "http://127.0.0.1:{port}/health"\nmemory = "1GiB"\nhealth_timeout = "1m"\n'
    )
    state = tmp_path / "state"
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg), "GPUCTL_STATE_DIR": str(state)}
    env.update(GPUCTL_SIM_DIR=str(sim), COLUMNS="120", NO_COLOR="1")
    env.pop("GPUCTL_DEBUG", None)
    # Nine earlier starts, each written as a start's lease holder writes it.
    store = DirectStore(state)
    for i in range(9):
        h = holder_here("ensure")
        ok, _ = store.acquire(svc, h, 60)
        assert ok
        t = time.time() - 3600 + i
        attempt = {"started": t, "ended": t + 1, "duration_s": 1.0}
        store.release(
            svc,
            h.id,
            RecordUpdate.from_wire(
                {"attempt": {**attempt, "launcher": "process", "outcome": "ready"}}
            ),
        )
    store.close()
    try:
        cell, rec = _locks(env, svc)
        assert (cell, rec["starts"], rec["starts_capped"]) == ("9", 9, False), rec

        _start_and_stop(env, svc)  # the tenth: the kept history is now full
        cell, rec = _locks(env, svc)
        assert (cell, rec["starts"], rec["starts_capped"]) == ("10+", 10, True), rec

        _start_and_stop(env, svc)  # the eleventh: the first is dropped from the record
        cell, rec = _locks(env, svc)
        assert (cell, rec["starts"], rec["starts_capped"]) == ("10+", 10, True), rec
        assert len(rec["attempts"]) == 10
        assert [a["outcome"] for a in rec["attempts"][-2:]] == ["ready", "ready"]
        assert [a["launcher"] for a in rec["attempts"][-2:]] == ["process", "process"]
    finally:
        kill_servers(svc)
