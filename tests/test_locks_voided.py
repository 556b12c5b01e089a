"""`gpuctl locks` shows what was voided (issue 17): a lease or an entry whose term is
longer than its kind's documented one, or whose holder on this host is at pid 1, counts
for nothing, and a person sees who planted it and why it is void.

Planted in the real state folder of a simulated host: a week-long in-flight entry from
another host, a 1-hour ``_admission`` lease, a ``_reclaim`` lease held by pid 1 and a
queue entry held by pid 1. The installed CLI lists each, through a real agent on
loopback and through the files directly, in its JSON (checked against the schema) and
its table; the store's decisions still treat each as nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from msgspec.structs import replace

from gpuctl.adapters import procinfo
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Lease
from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl_in_process
from tests.ensure_helpers import agent_host, direct_config

SCHEMA = Path(__file__).parent.parent / "schemas" / "locks.schema.json"
# (kind, service, holder host ("" = this one), pid, why)
PLANTED = [
    ("inflight", "svc", "elsewhere", 4242, "term longer than 30 s"),
    ("lease", "_admission", "elsewhere", 4243, "term longer than 10 s"),
    ("lease", "_reclaim", "", 1, "holder at pid 1"),
    ("queue", "_queue", "", 1, "holder at pid 1"),
]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


def _plant(state: Path) -> None:
    me = procinfo.host_identity()
    now = time.time()
    DirectStore(state).touch("svc")
    week = Lease("abcdef12", "elsewhere", "b00t", 4242, 1.0, "in_use", now, now + 7 * 86400)
    (state / "inflight" / "svc").mkdir(parents=True, exist_ok=True)
    (state / "inflight" / "svc" / "abcdef12.json").write_text(json.dumps(week.to_dict()))
    hour = Lease("adm1", "elsewhere", "b00t", 4243, 1.0, "ensure", now, now + 3600)
    one = Lease(
        "rec1", me.hostname, me.boot_id, 1, procinfo.start_time(1), "reclaim", now, now + 60
    )
    for svc, lease in (("_admission", hour), ("_reclaim", one)):
        rec = {"schema": 1, "service": svc, "lease": lease.to_dict()}
        (state / "records" / f"{svc}.json").write_text(json.dumps(rec))
    queued = Waiter("run.x", 0, 1, 1, now, replace(one, id="q1"))
    (state / "queue").mkdir(exist_ok=True)
    (state / "queue" / "q1.json").write_text(json.dumps(queued.to_dict()))


def _locks(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    r = gpuctl_in_process(config, "locks", *args, env={"COLUMNS": "200"})
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r


def _listed(config: Path) -> list[dict[str, Any]]:
    out = json.loads(_locks(config, "--json").stdout)
    Draft202012Validator(json.loads(SCHEMA.read_text())).validate(out)
    return list(out["voided"])


def _check(config: Path) -> None:
    here = procinfo.host_identity().hostname
    got = {(v["kind"], v["service"]): v for v in _listed(config)}
    for kind, svc, holder, pid, why in PLANTED:
        v = got[kind, svc]
        assert v["why"] == why, v
        assert v["holder"] == {"host": holder or here, "pid": pid}, v
        assert v["host"] == "sim"
    table = _locks(config).stdout
    assert "voided" in table
    for kind, svc, holder, pid, why in PLANTED:
        line = next(ln for ln in table.splitlines() if f" {kind} " in ln and svc in ln)
        assert why in line and f"pid {pid}@{holder or here}" in line, line


def _treated_as_nothing(state: Path) -> None:
    store = DirectStore(state)
    assert store.inflight() == {}
    assert store.waiters() == []
    assert store.get("_admission").lease is None
    granted, _ = store.acquire("_reclaim", holder_here("reclaim"), 5)
    assert granted


def test_locks_through_the_agent_shows_what_was_voided(host: SimHost) -> None:
    _plant(host.state_dir)
    config = host.write_config("")
    _check(config)
    _treated_as_nothing(host.state_dir)
    # The forged _reclaim lease was replaced by a sound one: its copy is still listed.
    kept = [v for v in _listed(config) if v["service"] == "_reclaim"]
    assert [v["why"] for v in kept] == ["holder at pid 1"]
    assert kept[0]["file"].startswith("records/_reclaim.json.void-")


def test_locks_on_the_files_shows_what_was_voided(host: SimHost) -> None:
    _plant(host.state_dir)
    config = direct_config(host, "")
    _check(config)
    _treated_as_nothing(host.state_dir)
    # Kept on disk for a person, not deleted: the entries renamed beside themselves.
    kept = [p.name for p in (host.state_dir / "inflight" / "svc").iterdir()]
    assert len(kept) == 1 and kept[0].startswith("abcdef12.json.void-"), kept
    assert (host.state_dir / "queue" / "q1.json").exists() is False
    assert any(p.name.startswith("q1.json.void-") for p in (host.state_dir / "queue").iterdir())
