"""Nothing planted in the state folder reaches outside it or wedges it: links are never
followed (set aside and listed), deep JSON never crashes a reader, over-long leases and
entries count for nothing, junk is set aside once, open folders are closed. Real files,
a real agent on loopback."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuctl.adapters import procinfo
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.codec import SEQ_MAX, salvage
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.record import Lease, unreadable_handle
from gpuctl.errors import UsageError
from gpuctl.sim.host import SimHost

DEEP = b"[" * 2000


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def _victim(tmp_path: Path) -> Path:
    d = tmp_path / "elsewhere"
    d.mkdir()
    os.chmod(d, 0o755)
    (d / "keep.json").write_text('{"mine": true}')
    return d


def _untouched(d: Path) -> None:
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert sorted(p.name for p in d.iterdir()) == ["keep.json"]
    assert (d / "keep.json").read_text() == '{"mine": true}'


def test_a_link_at_inflight_svc_is_set_aside_and_nothing_lands_through_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = DirectStore(state)
    store.touch("svc")
    victim = _victim(tmp_path)
    (state / "inflight").mkdir(mode=0o700, exist_ok=True)
    (state / "inflight" / "svc").symlink_to(victim)
    h = holder_here("in_use")
    granted, _ = store.inflight_begin("svc", h, 30)
    assert granted and store.inflight() == {"svc": 1}
    store.inflight_end("svc", h.id)
    _untouched(victim)
    assert not (state / "inflight" / "svc").is_symlink()
    (kept,) = [a for a in store.set_aside() if a.service == "_inflight"]
    assert kept.file.startswith("inflight/svc.link-") and "symbolic link" in kept.why


@pytest.mark.parametrize("sub", ["records", "locks", "logs"])
def test_a_link_at_a_state_subfolder_is_never_chmodded_nor_written(
    tmp_path: Path, sub: str
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    (state / sub).symlink_to(victim)
    store = DirectStore(state)
    store.touch("svc")
    assert store.get("svc").last_used is not None
    _untouched(victim)
    assert (state / sub).is_dir() and not (state / sub).is_symlink()
    assert [a.file.startswith(f"{sub}.link-") for a in store.set_aside()] == [True]


def test_a_link_at_a_lock_file_never_truncates_its_target(tmp_path: Path) -> None:
    """CVE-2025-68146's shape: a link at ``locks/<svc>.lock`` (filelock < 3.20.1
    truncated its target)."""
    state = tmp_path / "state"
    store = DirectStore(state)
    store.touch("other")
    target = tmp_path / "precious"
    target.write_text("do not truncate me")
    (state / "locks" / "svc.lock").symlink_to(target)
    granted, _ = store.acquire("svc", holder_here("t"), 60)
    assert granted
    assert target.read_text() == "do not truncate me"
    assert [a.service for a in store.set_aside()] == ["_locks"]


def test_deep_json_in_queue_and_inflight_never_breaks_the_agent(host: SimHost) -> None:
    store = DirectStore(host.state_dir)
    store.touch("svc")
    for folder in (host.state_dir / "queue", host.state_dir / "inflight" / "svc"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "abc123.json").write_bytes(DEEP)
    auth = {"Authorization": f"Bearer {host.token}"}
    for path, key in (("/records/_queue", "queue"), ("/records/_inflight", "inflight")):
        r = httpx.get(f"{host.agent_url}{path}", headers=auth, timeout=20)
        assert r.status_code == 200, r.text
        assert not r.json()[key]
    # Set aside once, listed, and the originals gone: the next read does not see them.
    kept = sorted(a.service for a in store.set_aside())
    assert kept == ["_inflight", "_queue"]
    assert store.waiters() == [] and store.inflight() == {}


def _lease(pid: int, granted: float, expires: float, *, host: str | None = None) -> Lease:
    me = procinfo.host_identity()
    start = procinfo.start_time(pid)
    return Lease(
        "abcdef12", host or me.hostname, me.boot_id, pid, start, "in_use", granted, expires
    )


def test_a_week_long_inflight_entry_from_elsewhere_counts_for_nothing(host: SimHost) -> None:
    store = DirectStore(host.state_dir)
    store.touch("svc")
    folder = host.state_dir / "inflight" / "svc"
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    week = _lease(4242, now, now + 7 * 86400, host="elsewhere")
    (folder / "abcdef12.json").write_text(json.dumps(week.to_dict()))
    assert store.inflight() == {}
    # On the wire: refused, as over-long queue entries are.
    h = holder_here("in_use")
    body = {"holder": h.to_dict(), "ttl_s": 3600}
    auth = {"Authorization": f"Bearer {host.token}"}
    r = httpx.post(f"{host.agent_url}/records/svc/inflight", json=body, headers=auth, timeout=20)
    assert r.status_code == 400, r.text
    body["ttl_s"] = 30
    r = httpx.post(f"{host.agent_url}/records/svc/inflight", json=body, headers=auth, timeout=20)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("pseudo", ["_reclaim", "_admission"])
def test_an_over_long_reclaim_or_admission_lease_is_void_and_refused(
    tmp_path: Path, pseudo: str
) -> None:
    store = DirectStore(tmp_path / "state")
    with pytest.raises(UsageError):
        store.acquire(pseudo, holder_here("t"), 7 * 86400)
    # Forged in the file (a holder elsewhere, nobody here can tell it died): void.
    now = time.time()
    forged = _lease(4242, now, now + 7 * 86400, host="elsewhere")
    store.touch("other")
    rec = {"schema": 1, "service": pseudo, "lease": forged.to_dict()}
    (tmp_path / "state" / "records" / f"{pseudo}.json").write_text(json.dumps(rec))
    assert store.get(pseudo).lease is None
    granted, _ = store.acquire(pseudo, holder_here("t"), 5)
    assert granted


def test_a_holder_at_pid_1_or_without_a_start_time_counts_for_nothing(tmp_path: Path) -> None:
    store = DirectStore(tmp_path / "state")
    store.touch("svc")
    now = time.time()
    records = tmp_path / "state" / "records"
    for pid, start in ((1, procinfo.start_time(1)), (os.getpid(), None)):
        lease = _lease(pid, now, now + 60)
        lease = Lease(lease.holder, lease.host, lease.boot_id, pid, start, "ensure", now, now + 60)
        rec = {"schema": 1, "service": "svc", "lease": lease.to_dict()}
        (records / "svc.json").write_text(json.dumps(rec))
        assert store.get("svc").lease is None, (pid, start)


def test_a_queue_entry_at_the_top_of_seq_never_breaks_later_joins(tmp_path: Path) -> None:
    store = DirectStore(tmp_path / "state")
    first, _ = store.queue_join(holder_here("run"), 30, name="run.a", priority=1, memory_mib=1)
    data = first.to_dict()
    data["seq"] = SEQ_MAX
    (tmp_path / "state" / "queue" / f"{first.id}.json").write_text(json.dumps(data))
    second, q = store.queue_join(holder_here("run"), 30, name="run.b", priority=1, memory_mib=1)
    assert second.seq == SEQ_MAX and [w.name for w in q] == ["run.a", "run.b"]


def test_folders_left_open_by_an_older_release_are_closed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = DirectStore(state)
    store.queue_join(holder_here("run"), 30, name="run.a", priority=1, memory_mib=1)
    store.inflight_begin("svc", holder_here("in_use"), 30)
    for d in (state, state / "queue", state / "inflight"):
        os.chmod(d, 0o777)
    store.touch("svc")
    for d in (state, state / "queue", state / "inflight"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_ten_thousand_set_aside_copies_are_counted_not_read(host: SimHost) -> None:
    records = host.state_dir / "records"
    DirectStore(host.state_dir).touch("svc")
    for i in range(10_001):
        (records / f"svc.json.corrupt-{1_700_000_000 + i}").write_bytes(b"x")
    auth = {"Authorization": f"Bearer {host.token}"}
    r = httpx.get(f"{host.agent_url}/records", headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    aside = r.json()["set_aside"]
    assert len(aside) == 101
    assert any(a["file"] == "+9901 more" for a in aside)


def test_salvage_keeps_the_sound_fields_of_a_pre_nonce_handle() -> None:
    fixture = Path(__file__).parent / "fixtures" / "records" / "vllm-jupyter.json"
    data = json.loads(fixture.read_text())
    assert "start_nonce" not in data
    data["handle"]["terminal"] = 7  # one field off the schema
    rec = salvage(json.dumps(data).encode(), "vllm-jupyter", time.time())
    assert rec.handle is not None
    assert rec.handle["pid"] == 5150 and rec.handle["kind"] == "jupyter"
    assert "terminal" not in rec.handle


def test_salvage_marks_the_handle_fields_it_dropped() -> None:
    """The mark is what makes a salvaged handle read UNKNOWN (``unreadable_handle``)."""
    fixture = Path(__file__).parent / "fixtures" / "records" / "vllm-jupyter.json"
    data = json.loads(fixture.read_text())
    data["handle"]["pid"] = "5150"
    rec = salvage(json.dumps(data).encode(), "vllm-jupyter", time.time())
    assert rec.handle is not None and "pid" not in rec.handle
    assert unreadable_handle(rec) == "pid"
    data["handle"] = [1]
    rec = salvage(json.dumps(data).encode(), "vllm-jupyter", time.time())
    assert unreadable_handle(rec) == "*"
