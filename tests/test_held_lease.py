"""A service whose lease is held counts at its budget once its start is admitted; a
lease still on its way to the admission lock counts only when an older release wrote it.

The real CLI on the 120 GiB simulated GPU with its agent. An older release's caller that
took a service's lease may spawn it any moment without marking it ``starting``: ``status``
and ``ensure`` of another service count that service's budget as promised, as
docs/explanation/decisions.md says, rather than as nothing. This release's caller
re-checks under the admission lock before it spawns, so the lock orders two rivals: the first admitted starts, the other
then finds it ``starting`` and is BUSY, and neither's callers are refused by a rival
that never started.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.promise import Promise
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
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
    r = gpuctl_in_process(cfg, "status", "--json")
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


def big_and_small(host: SimHost) -> tuple[str, str, Path]:
    """Two services on the 120 GiB GPU that do not fit together: big (80 GiB) and small
    (50 GiB); their names and the config."""
    big, small = unique_name("big"), unique_name("small")
    toml = ""
    for svc, gib in ((big, 80), (small, 50)):
        port = free_port()
        t = service_toml(svc, port, model_server_command(svc, port, f"{gib}GiB", "1s"))
        toml += t.replace('memory = "20GiB"', f'memory = "{gib}GiB"') + "\n"
    return big, small, host.write_config(toml)


@pytest.mark.slow
def test_an_older_releases_lease_not_yet_admitted_counts_at_its_budget(host: SimHost) -> None:
    big, small, cfg = big_and_small(host)
    store = DirectStore(host.state_dir)
    # An older release's ensure of big took its lease (no promise in the record): its
    # record is not `starting` yet (the phase it had before).
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


def test_a_lease_waiting_for_admission_does_not_refuse_a_rival(host: SimHost) -> None:
    """This release's caller of big holds its lease (with big's promise) and has not
    been admitted: small is admitted first and starts; big, admitted after it, finds
    small `starting` and is BUSY: the admission lock decided, and nothing over-commits."""
    big, small, cfg = big_and_small(host)
    store = DirectStore(host.state_dir)
    starter = holder_here("ensure")
    granted, rec = store.acquire(big, starter, 600, Promise(memory_mib=80 * GiB, priority=50))
    assert granted and rec.promise is not None and rec.phase.value != "starting"
    try:
        obj = status_json(cfg)
        rows = {s["name"]: s for s in obj["services"]}
        assert rows[big]["decision"] == "LOADING", rows[big]
        assert rows[small]["decision"] in ("IDLE", "FITS"), rows[small]
        assert obj["hosts"][0]["memory_promised_mib"] == 0, obj["hosts"][0]
        r = run_ensure(cfg, small)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["launched"] is True
        # The waiting caller gives up; big's next start finds small in its room: BUSY.
        store.release(big, starter.id)
        r = run_ensure(cfg, big)
        assert r.returncode == 3, r.stdout + r.stderr
        assert json.loads(r.stdout)["launched"] is False
    finally:
        kill_servers(big)
        kill_servers(small)
