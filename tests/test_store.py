"""The state store on real files, real locks and real processes.

Most tests run twice: on a ``DirectStore`` over a temporary state directory, and on an
``AgentStore`` that reaches the same directory through a real agent on loopback. A
``DirectStore`` on the same directory (``env.direct``) stands in for another entry point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from msgspec.structs import replace

from gpuctl.adapters import procinfo
from gpuctl.adapters.store import AgentStore, Holder, Store, holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentApp, AgentSettings, create_app
from gpuctl.core.record import Lease, Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import AgentAuthError, GpuctlError, StoreError, UsageError
from tests.agent_helpers import FakeProbe, serve_in_thread

TOKEN = "store-test-token"
SVC = "vllm"
KINDS = ["direct", "agent"]

# A child process that takes the lease of SVC, says so, and then exits or waits.
CHILD = """
import sys, time
from pathlib import Path
from gpuctl.adapters.store import AgentStore, holder_here
from gpuctl.adapters.store.direct import DirectStore

kind, where, then, go_file, token = sys.argv[1:6]
go = Path(go_file) if go_file else None
store = DirectStore(Path(where)) if kind == "direct" else AgentStore(where, token)
while go is not None and not go.exists():
    time.sleep(0.005)
granted, rec = store.acquire("vllm", holder_here("child"), 600)
print("granted" if granted else "refused", rec.lease.holder if rec.lease else "-", flush=True)
if kind != "direct":
    store.close()
if then == "wait":
    time.sleep(600)
"""


class Clock:
    """Real time, shifted by ``offset``: leases expire when a test says so."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class Env:
    kind: str
    store: Store
    direct: DirectStore  # the same directory, straight to the files
    state_dir: Path
    clock: Clock
    url: str = ""

    def record_path(self, service: str = SVC) -> Path:
        return self.state_dir / "records" / f"{service}.json"

    def child(self, then: str, go: Path | None = None, kind: str | None = None) -> list[str]:
        """The command line of a CHILD that reaches this store (or ``kind``'s path to it)."""
        kind = kind or self.kind
        where = self.url if kind == "agent" else str(self.state_dir)
        return [sys.executable, "-c", CHILD, kind, where, then, str(go or ""), TOKEN]


def make_env(kind: str, state_dir: Path) -> Iterator[Env]:
    clock = Clock()
    direct = DirectStore(state_dir, clock=clock)
    if kind == "direct":
        yield Env(kind, direct, direct, state_dir, clock)
        return
    app = create_app(AgentSettings(token=TOKEN, state_dir=str(state_dir)), FakeProbe())
    assert isinstance(app, AgentApp)
    assert app.store_api.store is not None
    app.store_api.store.clock = clock
    with serve_in_thread(app) as url:
        store = AgentStore(url, TOKEN, host_name="testhost")
        try:
            yield Env(kind, store, direct, state_dir, clock, url)
        finally:
            store.close()


@pytest.fixture(params=KINDS)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    yield from make_env(request.param, tmp_path / "state")


@pytest.fixture
def agent_env(tmp_path: Path) -> Iterator[Env]:
    yield from make_env("agent", tmp_path / "state")


def holder(entry: str = "test") -> Holder:
    """A holder in this (live) process; each has its own id."""
    return holder_here(entry)


def put(env: Env, rec: Record) -> None:
    """Write a record file as another machine's gpuctl would have left it."""
    env.record_path(rec.service).parent.mkdir(parents=True, exist_ok=True)
    env.record_path(rec.service).write_text(json.dumps(rec.to_dict()))


def foreign_lease(env: Env, *, host: str, boot_id: str, pid: int, ttl: float) -> Lease:
    now = env.clock()
    return Lease("someone", host, boot_id, pid, None, "cron", now, now + ttl)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    with subprocess.Popen([sys.executable, "-c", "pass"]) as p:
        pass
    assert not psutil.pid_exists(p.pid)
    return p.pid


# --------------------------------------------------------------------------- semantics


def test_acquire_renew_update_release(env: Env) -> None:
    h1, h2 = holder("ensure"), holder("cron")
    fresh = env.store.get(SVC)
    assert fresh == Record(SVC)
    assert env.store.records() == []

    before = env.clock()
    granted, rec = env.store.acquire(SVC, h1, 60)
    assert granted
    assert rec.lease is not None
    assert rec.lease.holder == h1.id
    assert (rec.lease.host, rec.lease.boot_id, rec.lease.pid) == (h1.host, h1.boot_id, h1.pid)
    assert rec.lease.entry == "ensure"
    assert before <= rec.lease.granted <= env.clock()
    assert rec.lease.expires == pytest.approx(rec.lease.granted + 60)

    # the holder may take it again (that renews it); anyone else is refused
    again, rec = env.store.acquire(SVC, h1, 90)
    assert again
    assert rec.lease is not None
    assert rec.lease.expires == pytest.approx(env.clock() + 90, abs=2)
    refused, seen = env.store.acquire(SVC, h2, 60)
    assert not refused
    assert seen.lease is not None
    assert seen.lease.holder == h1.id

    rec = env.store.renew(SVC, h1.id, 300)
    assert rec.lease is not None
    assert rec.lease.expires == pytest.approx(env.clock() + 300, abs=2)

    handle = {"kind": "process", "pid": 77, "pid_start": 12.5}
    rec = env.store.update(
        SVC,
        h1.id,
        RecordUpdate.from_wire(
            {"phase": "starting", "handle": handle, "attempt": {"at": 1, "ok": None}}
        ),
    )
    assert rec.phase is Phase.STARTING
    assert rec.handle == handle
    assert rec.attempts == ({"at": 1, "ok": None},)
    assert env.store.get(SVC) == rec
    assert env.direct.get(SVC) == rec
    assert env.store.records() == [rec]

    released = env.store.release(SVC, h1.id, RecordUpdate.from_wire({"phase": "running"}))
    assert released.lease is None
    assert released.phase is Phase.RUNNING
    assert released.handle == handle
    assert env.store.get(SVC) == released

    granted, rec = env.store.acquire(SVC, h2, 60)
    assert granted
    # a release by a holder that lost the lease changes nothing
    late = env.store.release(SVC, h1.id, RecordUpdate.from_wire({"phase": "stopped"}))
    assert late.lease is not None
    assert late.lease.holder == h2.id
    assert late.phase is Phase.RUNNING
    assert env.store.get(SVC) == late


def test_non_holder_cannot_update_or_renew(env: Env) -> None:
    h1, h2 = holder(), holder()
    with pytest.raises(StoreError, match="no longer ours"):
        env.store.update(SVC, h1.id, RecordUpdate.from_wire({"phase": "running"}))
    with pytest.raises(StoreError, match="not held"):
        env.store.renew(SVC, h1.id, 60)
    env.store.acquire(SVC, h1, 60)
    with pytest.raises(StoreError, match=r"no longer ours \(held by test pid"):
        env.store.update(SVC, h2.id, RecordUpdate.from_wire({"phase": "running"}))
    with pytest.raises(StoreError, match="no longer ours"):
        env.store.renew(SVC, h2.id, 60)
    rec = env.store.get(SVC)
    assert rec.phase is Phase.STOPPED
    assert rec.lease is not None
    assert rec.lease.holder == h1.id
    # the lock was released after each refusal: the holder goes on
    assert (
        env.store.update(SVC, h1.id, RecordUpdate.from_wire({"phase": "running"})).phase
        is Phase.RUNNING
    )


def test_bad_update_is_refused_and_changes_nothing(env: Env) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    bad = RecordUpdate(phase="exploded", touch=True)  # type: ignore[arg-type]
    with pytest.raises(GpuctlError, match=r"update\.phase"):
        env.store.update(SVC, h.id, bad)
    rec = env.store.get(SVC)
    assert rec.phase is Phase.STOPPED
    assert rec.lease is not None


def test_failure_update_sets_backoff(env: Env) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    now = env.clock()
    rec = env.store.release(
        SVC, h.id, RecordUpdate.from_wire({"failure": {"error": "exit 1", "log_tail": "OOM"}})
    )
    assert rec.phase is Phase.FAILED
    assert rec.failure is not None
    assert rec.failure.count == 1
    assert rec.failure.backoff_until == pytest.approx(now + 10, abs=2)
    env.store.acquire(SVC, h, 60)
    rec = env.store.update(SVC, h.id, RecordUpdate.from_wire({"failure": {"error": "exit 1"}}))
    assert rec.failure is not None
    assert rec.failure.count == 2
    assert rec.failure.backoff_until == pytest.approx(now + 20, abs=2)


def test_a_test_sets_the_first_backoff_through_the_failpoint(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ensure.backoff=seconds:S`` (test-only): the process that writes the record starts
    the back-off at S, and it doubles from there as the 10 s does."""
    from gpuctl import failpoints

    monkeypatch.setenv(failpoints.ENV, "ensure.backoff=seconds:60")
    failpoints.reset()
    try:
        h = holder()
        env.store.acquire(SVC, h, 60)
        now = env.clock()
        rec = env.store.update(SVC, h.id, RecordUpdate.from_wire({"failure": {"error": "exit 1"}}))
        assert rec.failure is not None
        assert rec.failure.backoff_until == pytest.approx(now + 60, abs=2)
        rec = env.store.update(SVC, h.id, RecordUpdate.from_wire({"failure": {"error": "exit 1"}}))
        assert rec.failure is not None
        assert rec.failure.backoff_until == pytest.approx(now + 120, abs=2)
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reset()


def test_touch_sets_last_used_and_keeps_the_lease(env: Env) -> None:
    before = env.clock()
    rec = env.store.touch(SVC)
    assert rec.last_used is not None
    assert before <= rec.last_used <= env.clock()
    assert rec.phase is Phase.STOPPED
    h = holder()
    env.store.acquire(SVC, h, 60)
    env.clock.offset += 5
    touched = env.store.touch(SVC)
    assert touched.last_used is not None
    assert touched.last_used >= rec.last_used + 5
    assert touched.lease is not None
    assert touched.lease.holder == h.id
    assert env.direct.get(SVC).last_used == touched.last_used


def test_bad_service_names_are_refused(env: Env) -> None:
    for name in ("", "../etc", "a/b", "-x", "x" * 200, "sp ace"):
        with pytest.raises(UsageError, match="invalid service name"):
            env.store.get(name)
        with pytest.raises(UsageError):
            env.store.acquire(name, holder(), 60)


def test_record_json_on_disk(env: Env) -> None:
    h = holder("ensure")
    env.store.acquire(SVC, h, 60)
    env.store.update(
        SVC,
        h.id,
        RecordUpdate.from_wire({"phase": "starting", "handle": {"pid": 1}, "touch": True}),
    )
    on_disk = json.loads(env.record_path().read_text())
    assert {
        "schema",
        "service",
        "phase",
        "since",
        "last_used",
        "lease",
        "handle",
        "attempts",
        "failure",
    } <= set(on_disk)
    assert on_disk["schema"] == 1
    assert on_disk["service"] == SVC
    assert on_disk["phase"] == "starting"
    assert isinstance(on_disk["since"], float)
    assert isinstance(on_disk["last_used"], float)
    assert set(on_disk["lease"]) == {
        "holder",
        "host",
        "boot_id",
        "pid",
        "pid_start",
        "entry",
        "granted",
        "expires",
    }
    assert on_disk["lease"]["holder"] == h.id
    assert on_disk["lease"]["pid"] == os.getpid()
    assert on_disk["lease"]["pid_start"] == pytest.approx(procinfo.start_time(os.getpid()))
    assert on_disk["handle"] == {"pid": 1}
    assert on_disk["attempts"] == []
    assert on_disk["failure"] is None
    assert on_disk.get("recovered") is None
    # no temp files left behind
    assert [p.name for p in env.record_path().parent.iterdir()] == [f"{SVC}.json"]


# --------------------------------------------------------------------------- dead holders


def test_holder_that_exited_leaves_a_void_lease(env: Env) -> None:
    out = subprocess.run(
        env.child("exit"), capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out[0] == "granted"
    on_disk = json.loads(env.record_path().read_text())
    assert on_disk["lease"]["holder"] == out[1]  # still written down...
    assert env.store.get(SVC).lease is None  # ...but void at once, not at expiry
    granted, rec = env.store.acquire(SVC, holder(), 60)
    assert granted
    assert rec.lease is not None
    assert rec.lease.pid == os.getpid()


def test_holder_killed_and_not_reaped_is_dead(env: Env) -> None:
    """A zombie (SIGKILLed, its parent has not waited for it) holds nothing."""
    with subprocess.Popen(env.child("wait"), stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().split()[0] == "granted"
            refused, rec = env.store.acquire(SVC, holder(), 60)
            assert not refused  # alive: its lease is honoured
            assert rec.lease is not None
            assert rec.lease.pid == child.pid
            os.kill(child.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, "the child did not become a zombie"
                time.sleep(0.01)
            assert psutil.pid_exists(child.pid)  # kill(pid, 0) would call it alive
            assert env.store.get(SVC).lease is None
            granted, rec = env.store.acquire(SVC, holder(), 60)
            assert granted
        finally:
            if child.poll() is None:
                child.kill()


def test_live_holder_on_another_host_is_honoured_until_expiry(env: Env) -> None:
    here = procinfo.host_identity()
    # its pid is dead *here*, but that says nothing about a process on another machine
    lease = foreign_lease(env, host="laptop", boot_id=here.boot_id, pid=dead_pid(), ttl=30)
    put(env, Record(SVC, phase=Phase.STARTING, lease=lease))
    assert env.store.get(SVC).lease == lease
    refused, rec = env.store.acquire(SVC, holder(), 60)
    assert not refused
    assert rec.lease == lease
    env.clock.offset += 29
    assert env.store.get(SVC).lease == lease
    env.clock.offset += 1.5
    expired = env.store.get(SVC)
    assert expired.lease is None
    assert expired.phase is Phase.STARTING
    granted, rec = env.store.acquire(SVC, holder(), 60)
    assert granted


def test_same_hostname_other_boot_is_not_void(env: Env) -> None:
    """After a reboot the old boot's pids mean nothing: the lease runs to its expiry."""
    here = procinfo.host_identity()
    lease = foreign_lease(env, host=here.hostname, boot_id="an-old-boot", pid=dead_pid(), ttl=30)
    put(env, Record(SVC, lease=lease))
    assert env.store.get(SVC).lease == lease
    env.clock.offset += 31
    assert env.store.get(SVC).lease is None


def test_dead_holder_on_this_host_is_void(env: Env) -> None:
    here = procinfo.host_identity()
    lease = foreign_lease(env, host=here.hostname, boot_id=here.boot_id, pid=dead_pid(), ttl=600)
    put(env, Record(SVC, lease=lease))
    assert env.store.get(SVC).lease is None
    assert env.store.acquire(SVC, holder(), 60)[0]


def test_reused_pid_is_void(env: Env) -> None:
    """Our pid, but a start time 100 s off: another process that got the pid later."""
    here = procinfo.host_identity()
    started = procinfo.start_time(os.getpid())
    assert started is not None
    now = env.clock()
    stale = Lease(
        "old", here.hostname, here.boot_id, os.getpid(), started - 100, "x", now, now + 600
    )
    put(env, Record(SVC, lease=stale))
    assert env.store.get(SVC).lease is None
    assert env.store.acquire(SVC, holder(), 60)[0]
    # the control: the right start time is a live holder
    right = Lease("ours", here.hostname, here.boot_id, os.getpid(), started, "x", now, now + 600)
    put(env, Record(SVC, lease=right))
    assert env.store.get(SVC).lease == right
    assert not env.store.acquire(SVC, holder(), 60)[0]


# --------------------------------------------------------------------------- broken files


CORRUPT = {
    "garbage": b"\xff\xfe\x00\x9c binary \x80",
    "half-written": b'{"schema": 1, "service": "vllm", "phase": "runn',
    "empty": b"",
    "nul-filled": b"\x00" * 512,
    "not-an-object": b"[1, 2, 3]",
    "bad-phase": b'{"service": "vllm", "phase": "exploded"}',
    "bad-lease": b'{"service": "vllm", "lease": {"holder": "h"}}',
    "wrong-service": json.dumps(Record("sglang", phase=Phase.RUNNING).to_dict()).encode(),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
@pytest.mark.parametrize("op", ["get", "records", "acquire", "touch"])
def test_broken_record_is_set_aside_and_reported(env: Env, op: str, content: bytes) -> None:
    path = env.record_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    t0 = int(env.clock())
    if op == "get":
        rec = env.store.get(SVC)
    elif op == "records":
        (rec,) = env.store.records()
    elif op == "acquire":
        granted, rec = env.store.acquire(SVC, holder(), 60)
        assert granted
    else:
        rec = env.store.touch(SVC)
    t1 = int(env.clock())
    assert rec.service == SVC
    assert rec.recovered is not None
    assert "record was unreadable" in rec.recovered
    (kept,) = path.parent.glob(f"{SVC}.json.corrupt-*")
    m = re.fullmatch(rf"{SVC}\.json\.corrupt-(\d+)", kept.name)
    assert m is not None
    assert t0 <= int(m.group(1)) <= t1
    assert kept.name in rec.recovered
    assert kept.read_bytes() == content
    # a fresh, valid record took its place, and the next reader is not told again
    assert json.loads(path.read_text())["service"] == SVC
    again = env.store.get(SVC)
    assert again.recovered is None
    assert again.phase is Phase.STOPPED
    assert (again.lease is not None) == (op == "acquire")
    assert env.direct.acquire(SVC, holder(), 60)[0] == (op != "acquire")


def test_wrong_service_names_the_service(env: Env) -> None:
    put(env, Record("sglang"))
    os.replace(env.record_path("sglang"), env.record_path())
    rec = env.store.get(SVC)
    assert rec.recovered is not None
    assert "it names service 'sglang'" in rec.recovered


def test_leftover_temp_and_corrupt_files_are_not_records(env: Env) -> None:
    env.store.touch(SVC)
    d = env.record_path().parent
    (d / f".{SVC}.json.abc123.tmp").write_text('{"half')
    (d / f"{SVC}.json.corrupt-1").write_text("junk")
    (d / "README").write_text("hello")
    assert [r.service for r in env.store.records()] == [SVC]


def test_unwritable_state_dir_is_a_store_error_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a regular file, not a directory")
    store = DirectStore(tmp_path / "file" / "x")
    with pytest.raises(StoreError, match="cannot create the state directory") as info:
        store.acquire(SVC, holder(), 60)
    assert "GPUCTL_STATE_DIR" in info.value.hint
    with pytest.raises(StoreError) as info:
        store.touch(SVC)
    assert "GPUCTL_STATE_DIR" in info.value.hint
    with pytest.raises(StoreError) as info:
        store.renew(SVC, "h", 60)
    assert "GPUCTL_STATE_DIR" in info.value.hint
    assert store.records() == []


def test_agent_with_an_unwritable_state_dir_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    app = create_app(
        AgentSettings(token=TOKEN, state_dir=str(tmp_path / "file" / "x")), FakeProbe()
    )
    with serve_in_thread(app) as url:
        store = AgentStore(url, TOKEN)
        try:
            with pytest.raises(GpuctlError, match="cannot create the state directory"):
                store.acquire(SVC, holder(), 60)
        finally:
            store.close()


# --------------------------------------------------------------------------- races


def test_threads_race_for_the_lease_one_wins(env: Env) -> None:
    n = 16
    barrier = threading.Barrier(n)
    results: list[tuple[bool, str]] = []
    errors: list[BaseException] = []

    def take(h: Holder) -> None:
        try:
            barrier.wait()
            granted, rec = env.store.acquire(SVC, h, 60)
            assert rec.lease is not None
            results.append((granted, rec.lease.holder))
        except BaseException as e:
            errors.append(e)

    holders = [holder(f"t{i}") for i in range(n)]
    threads = [threading.Thread(target=take, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == n
    winners = [who for granted, who in results if granted]
    assert len(winners) == 1
    # every loser saw the winner's lease
    assert {who for _, who in results} == {winners[0]}
    assert env.direct.get(SVC).lease is not None
    assert env.direct.get(SVC).lease.holder == winners[0]  # type: ignore[union-attr]


def race_processes(env: Env, tmp_path: Path, kinds: list[str]) -> list[list[str]]:
    """Start one CHILD per kind, let them all acquire at once, and collect their answers.

    They stay alive until every one has answered: a holder that exits leaves a void lease,
    and a late one would rightly be granted it.
    """
    go = tmp_path / "go"
    children = [
        subprocess.Popen(env.child("wait", go, kind), stdout=subprocess.PIPE, text=True)
        for kind in kinds
    ]
    try:
        time.sleep(1.0)  # let them all import and wait for the start signal
        go.touch()
        outs = []
        for child in children:
            assert child.stdout is not None
            outs.append(child.stdout.readline().split())
        return outs
    finally:
        for child in children:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()


def test_processes_race_for_the_lease_one_wins(env: Env, tmp_path: Path) -> None:
    outs = race_processes(env, tmp_path, [env.kind] * 8)
    assert sorted(o[0] for o in outs) == ["granted"] + ["refused"] * 7
    assert len({o[1] for o in outs}) == 1


# --------------------------------------------------------------------------- atomic writes


def test_readers_never_see_a_partial_write(env: Env) -> None:
    h = holder()
    # 300 fsynced writes outlast a 60 s lease on a loaded machine; the lease is not the point.
    env.store.acquire(SVC, h, 3600)
    path = env.record_path()
    stop = threading.Event()
    seen: list[int] = []
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                bad.append("the record vanished")
                continue
            try:
                d = json.loads(raw)
            except ValueError:
                bad.append(raw.decode(errors="replace")[-80:])
                continue
            seen.append(len(d["attempts"]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            # Big writes (2,000 characters of padding, in values the wire allows) so that
            # a torn write would show.
            pad = {f"pad{k}": "x" * 1000 for k in range(2)}
            env.store.update(
                SVC, h.id, RecordUpdate.from_wire({"attempt": {"n": i, **pad}, "touch": True})
            )
    finally:
        stop.set()
        reader.join(30)
    assert not bad
    assert len(seen) > 10
    assert seen == sorted(seen)  # never an older version after a newer one
    assert len(env.store.get(SVC).attempts) == 10


# --------------------------------------------------------------------------- the agent path


def test_agent_needs_the_token(agent_env: Env) -> None:
    for token in (None, "wrong"):
        store = AgentStore(agent_env.url, token, host_name="dgx")
        try:
            with pytest.raises(AgentAuthError, match="HTTP 401") as info:
                store.get(SVC)
            assert "hosts.dgx.token" in info.value.hint
            with pytest.raises(AgentAuthError):
                store.acquire(SVC, holder(), 60)
        finally:
            store.close()
    assert not agent_env.record_path().exists()


def test_agent_refuses_a_non_holder_with_409(agent_env: Env) -> None:
    agent_env.store.acquire(SVC, holder(), 60)
    r = httpx.patch(
        f"{agent_env.url}/records/{SVC}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"holder": "not-me", "update": {"phase": "running"}},
    )
    assert r.status_code == 409
    assert "no longer ours" in r.json()["error"]
    r = httpx.post(
        f"{agent_env.url}/records/{SVC}/lease/renew",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"holder": "not-me", "ttl_s": 60},
    )
    assert r.status_code == 409


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "fragment"),
    [
        ("GET", "/records/-bad", None, 400, "invalid service name"),
        ("GET", "/records/bad%20name", None, 400, "invalid service name"),
        ("POST", "/records/-bad/touch", None, 400, "invalid service name"),
        # The agent names the field (before: "KeyError", or the store's words).
        ("POST", "/records/vllm/lease", {"ttl_s": 5}, 400, "holder: missing"),
        (
            "POST",
            "/records/vllm/lease",
            {"holder": "h", "ttl_s": 5},
            400,
            "holder: expected an object",
        ),
        ("POST", "/records/vllm/lease/renew", {"holder": "h"}, 400, "ttl_s: missing"),
        (
            "POST",
            "/records/vllm/lease/renew",
            {"holder": "h", "ttl_s": "NaN"},
            400,
            "ttl_s: expected a number",
        ),
        (
            "PATCH",
            "/records/vllm",
            {"holder": "h", "update": [1]},
            400,
            "update: expected an object",
        ),
        ("POST", "/records", None, 405, "not allowed"),
        ("GET", "/records/vllm/nope", None, 404, "no such endpoint"),
    ],
)
def test_agent_rejects_bad_requests(
    agent_env: Env, method: str, path: str, body: Any, status: int, fragment: str
) -> None:
    r = httpx.request(
        method,
        f"{agent_env.url}{path}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json=body,
    )
    assert r.status_code == status
    assert fragment in r.json()["error"]


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 0, -5])
def test_agent_refuses_a_lease_that_never_expires(agent_env: Env, ttl: float) -> None:
    h = holder()
    r = httpx.post(
        f"{agent_env.url}/records/{SVC}/lease",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        content=json.dumps({"holder": h.to_dict(), "ttl_s": ttl}),
    )
    assert r.status_code == 400
    assert agent_env.direct.get(SVC).lease is None


def test_agent_answers_with_the_record_json(agent_env: Env) -> None:
    h = holder()
    agent_env.store.acquire(SVC, h, 60)
    r = httpx.get(f"{agent_env.url}/records", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    (wire,) = r.json()["records"]
    assert wire == agent_env.direct.get(SVC).to_dict()
    assert wire["lease"]["holder"] == h.id


def test_a_lease_taken_through_the_agent_blocks_the_files_and_back(agent_env: Env) -> None:
    via_agent, via_files = holder("agent"), holder("files")
    assert agent_env.store.acquire(SVC, via_agent, 60)[0]
    refused, rec = agent_env.direct.acquire(SVC, via_files, 60)
    assert not refused
    assert rec.lease is not None
    assert rec.lease.holder == via_agent.id
    with pytest.raises(StoreError):
        agent_env.direct.update(SVC, via_files.id, RecordUpdate.from_wire({"phase": "running"}))
    agent_env.store.release(SVC, via_agent.id)

    assert agent_env.direct.acquire(SVC, via_files, 60)[0]
    refused, rec = agent_env.store.acquire(SVC, via_agent, 60)
    assert not refused
    assert rec.lease is not None
    assert rec.lease.holder == via_files.id
    with pytest.raises(StoreError, match="no longer ours"):
        agent_env.store.update(SVC, via_agent.id, RecordUpdate.from_wire({"phase": "running"}))
    assert (
        agent_env.store.update(
            SVC, via_files.id, RecordUpdate.from_wire({"phase": "running"})
        ).phase
        is Phase.RUNNING
    )


def test_processes_on_both_paths_race_one_wins(agent_env: Env, tmp_path: Path) -> None:
    outs = race_processes(agent_env, tmp_path, ["agent", "direct"] * 4)
    assert sorted(o[0] for o in outs) == ["granted"] + ["refused"] * 7
    assert len({o[1] for o in outs}) == 1


# --------------------------------------------------------------------------- the poisoned store

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_poisoned_lease_is_refused_and_the_records_still_answer(agent_env: Env) -> None:
    """One POST with pid 2**31 once poisoned the store: GET /records and /metrics
    answered 500 for good. Now it is a 400 naming the field, and nothing is written."""
    body = {"holder": {**holder().to_dict(), "pid": 2147483648}, "ttl_s": 60}
    r = httpx.post(f"{agent_env.url}/records/{SVC}/lease", headers=AUTH, json=body)
    assert r.status_code == 400
    assert "holder.pid: 2147483648 is out of range" in r.json()["error"]
    for field, value, where in [
        ("pid", True, "$.holder.pid"),
        ("pid", "4242", "$.holder.pid"),
        ("pid_start", 1e308, "$.holder.pid_start"),
        ("entry", ["x"], "$.holder.entry"),
        ("id", "", "$.holder.id"),
    ]:
        body = {"holder": {**holder().to_dict(), field: value}, "ttl_s": 60}
        r = httpx.post(f"{agent_env.url}/records/{SVC}/lease", headers=AUTH, json=body)
        assert r.status_code == 400, (field, value)
        assert f"{where.removeprefix('$.')}:" in r.json()["error"]
    assert not agent_env.record_path().exists()
    assert httpx.get(f"{agent_env.url}/records", headers=AUTH).status_code == 200
    assert httpx.get(f"{agent_env.url}/metrics", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("update", "where"),
    [
        ({"handle": {"kind": "process", "pid": 2147483648}}, "$.handle.pid"),
        ({"handle": {"kind": "process", "pid": True}}, "$.handle.pid"),
        ({"handle": {"kind": "docker", "deep": [[[[1]]]]}}, "$.handle.deep"),
        ({"start_nonce": "not hex!"}, "$.start_nonce"),
        ({"health": "ftp://x/"}, "$.health"),
        ({"touch": "no"}, "update.touch"),
    ],
)
def test_a_bad_update_is_refused_naming_the_field(
    env: Env, update: dict[str, Any], where: str
) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    before = env.record_path().read_bytes()
    with pytest.raises(UsageError) as info:
        env.store.update(SVC, h.id, RecordUpdate(**update))
    assert where.removeprefix("$.") in info.value.message
    assert env.record_path().read_bytes() == before
    if env.kind == "agent":
        r = httpx.patch(
            f"{env.url}/records/{SVC}", headers=AUTH, json={"holder": h.id, "update": update}
        )
        assert r.status_code == 400
        assert f"{where.removeprefix('$.')}: " in r.json()["error"]


POISON = {
    "huge-pid": json.dumps({"service": SVC, "handle": {"kind": "process", "pid": 2147483648}}),
    "lease-pid": json.dumps(
        {
            "service": SVC,
            "lease": {
                **Lease("h", "dgx", "b", 2147483648, None, "x", 1.0, 2e9).to_dict(),
            },
        }
    ),
    "nan-since": '{"service": "vllm", "since": NaN}',
    "huge-expiry": json.dumps(
        {"service": SVC, "lease": Lease("h", "dgx", "b", 1, None, "x", 1.0, 1e308).to_dict()}
    ),
    "inf-last-used": '{"service": "vllm", "last_used": 1e999}',
    "deep": "[" * 100_000 + "]" * 100_000,
    "not-utf8": '{"service": "vllm", "recovered": "\xff"}',
    "no-is-not-a-bool": '{"service": "vllm", "failure": {"at": 1, "count": "no"}}',
    "true-is-not-a-pid": '{"service": "vllm", "handle": {"kind": "process", "pid": true}}',
    # A run job's budget as text was read as a job that holds nothing (core.jobs.job_spec).
    "a-run-budget-in-text": '{"service": "vllm", "phase": "running", "handle": '
    '{"kind": "run", "pid": 4242, "memory_mib": "80GiB", "priority": 50}}',
    "a-run-without-budget": '{"service": "vllm", "phase": "running", "handle": '
    '{"kind": "run", "pid": 4242, "priority": 50}}',
    "a-run-priority-float": '{"service": "vllm", "phase": "running", "handle": '
    '{"kind": "run", "pid": 4242, "memory_mib": 100, "priority": 5.5}}',
    "a-run-preemptible-text": '{"service": "vllm", "phase": "running", "handle": '
    '{"kind": "run", "pid": 4242, "memory_mib": 100, "priority": 5, "preemptible": "yes"}}',
}


@pytest.mark.parametrize("content", POISON.values(), ids=POISON.keys())
def test_a_poisoned_record_file_is_set_aside_and_the_rest_works(env: Env, content: str) -> None:
    other = holder()
    assert env.store.acquire("sglang", other, 600)[0]
    path = env.record_path()
    path.write_bytes(content.encode("latin-1") if "\xff" in content else content.encode())
    recs = {r.service: r for r in env.store.records()}
    assert set(recs) == {SVC, "sglang"}
    assert recs["sglang"].lease is not None
    assert recs["sglang"].lease.holder == other.id  # the rest of the store is untouched
    note = recs[SVC].recovered
    assert note is not None
    assert "record was unreadable (at $" in note
    assert recs[SVC].lease is None
    (kept,) = env.direct.set_aside()
    assert kept.service == SVC
    assert kept.file in note
    assert kept.why.startswith("at $")
    assert kept.size == len(path.with_name(kept.file).read_bytes())
    assert env.store.set_aside() == [kept]
    # the store keeps working, for this service too
    h = holder()
    granted, rec = env.store.acquire(SVC, h, 60)
    assert granted
    assert rec.lease is not None
    assert env.store.touch(SVC).last_used is not None
    assert env.direct.recorded_pids() == []
    if env.kind == "agent":
        r = httpx.get(f"{env.url}/records", headers=AUTH)
        assert r.status_code == 200
        assert [a["file"] for a in r.json()["set_aside"]] == [kept.file]
        assert httpx.get(f"{env.url}/metrics", headers=AUTH).status_code == 200


def test_the_agent_reads_a_poisoned_record_without_a_500(agent_env: Env) -> None:
    """The reads that once answered 500: the list, the one record, and the recorded pids
    the agent's /status asks the store for."""
    agent_env.record_path().parent.mkdir(parents=True)
    agent_env.record_path().write_text(POISON["huge-pid"])
    assert agent_env.direct.recorded_pids() == []
    r = httpx.get(f"{agent_env.url}/records/{SVC}", headers=AUTH)
    assert r.status_code == 200
    assert "at $.handle.pid" in r.json()["recovered"]
    assert httpx.get(f"{agent_env.url}/status", headers=AUTH).status_code == 200


def test_a_record_that_is_a_symlink_is_set_aside_not_followed(env: Env, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(Record(SVC, phase=Phase.RUNNING).to_dict()))
    env.record_path().parent.mkdir(parents=True)
    env.record_path().symlink_to(secret)
    rec = env.store.get(SVC)
    assert rec.phase is Phase.STOPPED
    assert rec.recovered is not None
    assert "symbolic link" in rec.recovered
    assert secret.exists()


def test_set_aside_copies_are_listed_until_removed(env: Env) -> None:
    path = env.record_path()
    path.parent.mkdir(parents=True)
    for content in ("junk", '{"service": "vllm", "since": NaN}'):
        path.write_text(content)
        env.store.get(SVC)
        env.clock.offset += 1  # another second, another copy
    kept = env.store.set_aside()
    assert [k.why.split(":")[0] for k in kept] == ["at $", "at $.since"]
    assert kept[0].at < kept[1].at
    for k in kept:
        (path.parent / k.file).unlink()
    assert env.store.set_aside() == []
    assert env.store.get(SVC).recovered is None


# --------------------------------------------------------------------------- touch vs stop


def stopped_by_a_stop(env: Env) -> None:
    """A start that ended running, then a ``gpuctl stop`` run to completion."""
    starter = holder("ensure")
    env.store.acquire(SVC, starter, 60)
    env.store.update(
        SVC,
        starter.id,
        RecordUpdate.from_wire({"phase": "starting", "handle": {"kind": "process", "pid": 1}}),
    )
    env.store.release(SVC, starter.id, RecordUpdate.from_wire({"phase": "running", "touch": True}))
    stopper = holder("stop")
    assert env.store.acquire(SVC, stopper, 60)[0]
    env.store.update(SVC, stopper.id, RecordUpdate.from_wire({"phase": "stopping"}))
    env.store.release(SVC, stopper.id, RecordUpdate.from_wire({"phase": "stopped", "handle": None}))


def test_a_touch_after_a_stop_does_not_bring_it_back(env: Env) -> None:
    """The waiter that saw the server answer, then paused while ``stop`` ran to the end,
    touches with ``ready``: the record stays stopped, with no server named."""
    stopped_by_a_stop(env)
    env.clock.offset += 5
    rec = env.store.touch(SVC, ready=True)
    assert rec.phase is Phase.STOPPED
    assert rec.handle is None
    assert rec.last_used == pytest.approx(env.clock(), abs=2)  # the use still counts
    on_disk = env.direct.get(SVC)
    assert (on_disk.phase, on_disk.handle) == (Phase.STOPPED, None)


@pytest.mark.parametrize("phase", ["preempted", "failed", "stopped", "sleeping", "stopping"])
def test_a_ready_touch_changes_no_phase_but_starting(env: Env, phase: str) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    env.store.release(SVC, h.id, RecordUpdate.from_wire({"phase": phase}))
    since = env.direct.get(SVC).since
    env.clock.offset += 5
    rec = env.store.touch(SVC, ready=True)
    assert (rec.phase.value, rec.since) == (phase, since)


def test_a_ready_touch_completes_a_start(env: Env) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    env.store.release(
        SVC,
        h.id,
        RecordUpdate.from_wire(
            {"phase": "starting", "failure": {"error": "an earlier try", "log_tail": ""}}
        ),
    )
    env.clock.offset += 5
    rec = env.store.touch(SVC, ready=True)
    assert rec.phase is Phase.FAILED  # a failure release is failed, not starting
    h2 = holder()
    env.store.acquire(SVC, h2, 60)
    env.store.release(SVC, h2.id, RecordUpdate.from_wire({"phase": "starting"}))
    rec = env.store.touch(SVC, ready=True)
    assert rec.phase is Phase.RUNNING
    assert rec.failure is None
    assert env.store.touch(SVC, ready=False).phase is Phase.RUNNING


# --------------------------------------------------------------------------- file modes

MODES = """
import os, sys
from pathlib import Path
os.umask(0)
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
store = DirectStore(Path(sys.argv[1]))
h = holder_here("test")
store.acquire("vllm", h, 60)
from gpuctl.core.record_shapes import RecordUpdate
store.release("vllm", h.id, RecordUpdate(touch=True))
store.inflight_begin("vllm", h, 30)
"""


def modes_under(state_dir: Path) -> dict[str, int]:
    out = {}
    for p in [state_dir, *sorted(state_dir.rglob("*"))]:
        out[str(p.relative_to(state_dir))] = p.stat().st_mode & 0o7777
    return out


def test_modes_for_one_user_whatever_the_umask(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # a folder an older release made 0777 under umask 000 is closed too
    (state / "records").mkdir(parents=True)
    os.chmod(state / "records", 0o777)
    os.chmod(state, 0o700)
    subprocess.run([sys.executable, "-c", MODES, str(state)], check=True)
    modes = modes_under(state)
    folders = {k: v for k, v in modes.items() if (state / k).is_dir()}
    files = {k: v for k, v in modes.items() if (state / k).is_file()}
    assert {"records", "locks", "logs", "records/vllm.json", "locks/vllm.lock"} <= set(modes)
    assert set(folders.values()) == {0o700}, folders
    assert set(files.values()) == {0o600}, files


def test_modes_for_a_group_shared_state_dir_whatever_the_umask(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o2770)  # install -d -m 2770 -g gpuctl: setgid, the group's
    subprocess.run([sys.executable, "-c", MODES, str(state)], check=True)
    modes = modes_under(state)
    folders = {k: v for k, v in modes.items() if (state / k).is_dir() and k != "."}
    files = {k: v for k, v in modes.items() if (state / k).is_file()}
    assert {"records", "locks", "logs", "records/vllm.json", "locks/vllm.lock"} <= set(modes)
    assert set(folders.values()) == {0o2770}, folders
    assert set(files.values()) == {0o660}, files


def test_a_new_state_dir_is_private(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    subprocess.run([sys.executable, "-c", MODES, str(state)], check=True)
    assert state.stat().st_mode & 0o7777 == 0o700


# --------------------------------------------------------------------------- clear store errors

# The path comes in the environment: on its command line it would carry the service's
# name, and the agent would count this process as the service loading.
HOLD_LOCK = """
import fcntl, os, time
f = open(os.environ["LOCK"], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def held_lock(env: Env) -> Iterator[Path]:
    lock = env.state_dir / "locks" / f"{SVC}.lock"
    env.direct.touch("other")  # makes the folders
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOCK": str(lock)},
    ) as p:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "held"
        try:
            yield lock
        finally:
            p.kill()


def test_a_held_lock_is_a_store_error_naming_the_file(
    env: Env, held_lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuctl.adapters.store import direct

    monkeypatch.setattr(direct, "LOCK_TIMEOUT_S", 0.3)
    for call in (
        lambda: env.store.acquire(SVC, holder(), 60),
        lambda: env.store.touch(SVC),
    ):
        with pytest.raises(StoreError) as info:  # through the agent too: not "agent down"
            call()
        assert str(held_lock) in info.value.message
        assert "held for more than" in info.value.message
        assert str(held_lock) in info.value.hint


DROP_TO_NOBODY_AND_ACQUIRE = """
import os, sys
from pathlib import Path
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.errors import StoreError
h = holder_here("t")
store = DirectStore(Path(sys.argv[1]))
store.modes()
if os.geteuid() == 0:  # after the imports: nobody cannot read root's Python
    os.setgid(65534)
    os.setuid(65534)
try:
    store.acquire("vllm", h, 60)
except StoreError as e:
    print("StoreError:", e.message, "|", e.hint)
"""


def test_a_read_only_records_folder_is_a_store_error_with_a_hint() -> None:
    import shutil
    import tempfile

    # Root ignores modes: the store runs as nobody in a folder nobody may only read.
    base = Path(tempfile.mkdtemp(prefix="gpuctl-ro-"))
    try:
        os.chmod(base, 0o755)
        state = base / "state"
        DirectStore(state).touch("other")
        os.chmod(state, 0o755)
        os.chmod(state / "locks", 0o777)
        os.chmod(state / "records", 0o555)
        out = subprocess.run(
            [sys.executable, "-c", DROP_TO_NOBODY_AND_ACQUIRE, str(state)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.startswith("StoreError: cannot write in ")
        assert str(state / "records") in out.stdout
        assert "must be writable by this user" in out.stdout
        assert "Traceback" not in out.stderr
    finally:
        shutil.rmtree(base)


# --------------------------------------------------------------------------- through the CLI


@pytest.fixture
def sim_host(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    from gpuctl.sim.host import SimHost
    from tests.conftest import set_marked_failpoints

    set_marked_failpoints(request, monkeypatch)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["agent", "direct"])
def test_status_is_unknown_when_the_records_cannot_be_read(sim_host: Any, path: str) -> None:
    """Without its records a host's leases are unknown: never IDLE, exit 4, through the
    agent and on the files directly."""
    from tests.conftest import gpuctl_exe
    from tests.ensure_helpers import cli_env, direct_config, service_toml

    services = service_toml("llmx", 1, "sleep 1")
    cfg = sim_host.write_config(services) if path == "agent" else direct_config(sim_host, services)
    sim_host.state_dir.mkdir(parents=True, exist_ok=True)
    # The records folder is a file: no record can be read (``glob`` in it finds nothing,
    # which must not read as "no records"). A folder named ``llmx.json`` used to stand
    # for this; it is now set aside like any bad record (tests/test_store_file_kinds.py)
    # and its service is UNKNOWN for the start it may hide (below).
    (sim_host.state_dir / "records").write_text("")
    out = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 4, out.stderr
    (svc,) = json.loads(out.stdout)["services"]
    assert svc["decision"] == "UNKNOWN"
    assert "records" in svc["reason"] and "not a directory" in svc["reason"], svc["reason"]
    (sim_host.state_dir / "records").unlink()
    (sim_host.state_dir / "records").mkdir()
    (sim_host.state_dir / "records" / "llmx.json").mkdir()  # not a record file
    out = subprocess.run(
        [gpuctl_exe(), "status", "--json"], env=cli_env(cfg), capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    (svc,) = json.loads(out.stdout)["services"]
    assert svc["decision"] == "UNKNOWN", svc  # never IDLE: it may have hidden a start
    assert "llmx.json" in svc["reason"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.failpoints("store.lock_timeout=seconds:2")
def test_ensure_json_prints_its_object_when_a_lock_is_held(sim_host: Any) -> None:
    """A lock file held on the host: the agent says so within the client's timeout,
    and ``ensure --json`` prints its object (exit 1) naming the lock, not the agent.
    (The agent gives up on the lock after 2 s here, 10 s in use: the same path.)"""
    from tests.ensure_helpers import run_ensure, service_toml

    cfg = sim_host.write_config(service_toml("llmy", 1, "sleep 1"))
    lock = sim_host.state_dir / "locks" / "llmy.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOCK": str(lock)},
    ) as p:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "held"
        try:
            out = run_ensure(cfg, "llmy")
        finally:
            p.kill()
    assert out.returncode == 1, (out.stdout, out.stderr)
    result = json.loads(out.stdout)
    assert result["outcome"] == "failed"
    assert str(lock) in result["reason"]
    assert "fuser" in result["hint"]
    assert "agent" not in result["reason"].replace("the store on", "")


@pytest.mark.e2e
def test_locks_touch_and_status_live_with_a_poisoned_record(sim_host: Any) -> None:
    """The poisoned store, as a user meets it: ``locks`` lists the set-aside file and
    exits 0, ``touch`` works, ``status`` answers; no "internal error" anywhere."""
    from tests.conftest import gpuctl_in_process
    from tests.ensure_helpers import service_toml

    cfg = sim_host.write_config(service_toml("llmz", 1, "sleep 1"))
    records = sim_host.state_dir / "records"
    records.mkdir(parents=True, exist_ok=True)
    (records / "llmz.json").write_text(POISON["lease-pid"].replace(SVC, "llmz"))

    locks = gpuctl_in_process(cfg, "locks", "--json")
    assert locks.returncode == 0, locks.stderr
    report = json.loads(locks.stdout)
    (kept,) = report["set_aside"]
    assert kept["service"] == "llmz"
    assert kept["why"].startswith("at $.lease.pid: 2147483648 is out of range")
    assert (records / kept["file"]).exists()
    text = gpuctl_in_process(cfg, "locks")
    assert text.returncode == 0
    assert kept["file"] in text.stdout + text.stderr
    touch = gpuctl_in_process(cfg, "touch", "llmz")
    assert touch.returncode == 0, touch.stderr
    status = gpuctl_in_process(cfg, "status", "--json")
    assert status.returncode == 0, status.stderr  # a pid of 2**31 never held anything
    (svc,) = json.loads(status.stdout)["services"]
    assert svc["name"] == "llmz"
    again = json.loads(gpuctl_in_process(cfg, "locks", "--json").stdout)
    assert [a["file"] for a in again["set_aside"]] == [kept["file"]]


def test_an_ensure_that_saw_it_answer_then_paused_while_stop_ran_does_not_revive_it(
    tmp_path: Path,
) -> None:
    """The race as it happened (8 of 8 tries): a waiter's health check passes, ``stop``
    runs to completion before the waiter's touch, then the waiter touches. The flows
    and the store are real; the health check itself runs the stop, so the window is hit
    every time."""
    from gpuctl.core.decision import Health
    from gpuctl.flows.ensure.rounds import ensure
    from gpuctl.flows.op_results import Outcome
    from gpuctl.flows.service_ops import stop
    from tests.flow_fakes import world

    w = world(tmp_path)
    starter = holder("ensure")
    w.store.acquire("vllm", starter, 60)
    w.store.release(
        "vllm",
        starter.id,
        RecordUpdate.from_wire({"phase": "running", "handle": {"kind": "process", "pid": 4242}}),
    )
    stops: list[str] = []

    def health_then_stop() -> Health:
        if not stops:
            stops.append(stop(w.deps()).reason)  # the stop, to the end
        return Health("ready", "HTTP 200", 200)  # what the waiter saw just before

    deps = w.deps()
    deps.servers = replace(deps.servers, health=health_then_stop)
    result = ensure(deps)
    assert stops == ["stopped pid 4242"]
    assert [h.pid for h in w.launcher.stopped] == [4242]
    assert result.outcome is Outcome.READY  # it did answer, when it looked
    rec = w.store.get("vllm")
    assert rec.phase is Phase.STOPPED  # and the touch after the stop brought nothing back
    assert rec.handle is None
    assert rec.last_used == w.clock()


def test_a_start_under_way_survives_its_poisoned_lease(env: Env) -> None:
    """The poisoned record of the report: a start under way whose lease names pid
    2**31. The file is set aside; what passes is kept, so the start still counts (an
    orphaned start: phase starting, its nonce, no lease) instead of reading as stopped."""
    since = env.clock() - 5
    poisoned = {
        "schema": 1,
        "service": SVC,
        "phase": "starting",
        "since": since,
        "last_used": since,
        "start_nonce": "0123456789abcdef",
        "health": "http://127.0.0.1:8000/health",
        "lease": Lease("h", "dgx", "b", 2147483648, None, "ensure", since, since + 600).to_dict(),
        "handle": None,
    }
    env.record_path().parent.mkdir(parents=True)
    env.record_path().write_text(json.dumps(poisoned))
    rec = env.store.get(SVC)
    assert rec.recovered is not None
    assert "at $.lease.pid" in rec.recovered
    assert "kept its valid fields" in rec.recovered
    assert (rec.phase, rec.since, rec.start_nonce) == (Phase.STARTING, since, "0123456789abcdef")
    assert rec.health == "http://127.0.0.1:8000/health"
    assert rec.lease is None
    assert env.direct.get(SVC) == rec  # and so it stays on disk
    (kept,) = env.store.set_aside()
    assert kept.why.startswith("at $.lease.pid")


@pytest.mark.e2e
def test_ensure_json_prints_its_object_when_records_are_read_only(tmp_path: Path) -> None:
    """A read-only ``records/`` once gave "internal error: PermissionError". Run as
    root, modes do not stop a write, so the folder is bind-mounted read-only in a mount
    namespace of the command's own (nothing outside it sees the mount)."""
    import shutil

    from gpuctl.sim.host import SimHost
    from tests.conftest import gpuctl_exe
    from tests.ensure_helpers import cli_env, direct_config, service_toml

    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-m", "true"], capture_output=True, check=False)
    if unshare is None or probe.returncode != 0:
        pytest.skip("needs unshare -m (a mount namespace) to make a folder read-only")
    with SimHost(root=tmp_path / "simhost") as host:
        cfg = direct_config(host, service_toml("llmro", 1, "sleep 1"))
        env = {**cli_env(cfg), "GPUCTL_STATE_DIR": str(host.state_dir)}
        DirectStore(host.state_dir).touch("llmro")  # the folders and a record exist
        records = host.state_dir / "records"
        script = (
            f'mount --bind "{records}" "{records}" && '
            f'mount -o remount,bind,ro "{records}" && '
            f'exec "{gpuctl_exe()}" ensure llmro --json'
        )
        out = subprocess.run(
            [unshare, "-m", "sh", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 1, (out.stdout, out.stderr)
    result = json.loads(out.stdout)
    assert result["outcome"] == "failed"
    assert f"cannot write in {records}" in result["reason"]
    assert "Read-only file system" in result["reason"]
    assert "must be writable" in result["hint"]
    assert "internal error" not in out.stderr


def peer_answering(status: int, body: bytes) -> Any:
    """An ASGI app that answers every request with ``status`` and ``body`` as JSON: an
    agent gone wrong, or something else on its port."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


BROKEN_ANSWERS = {
    "deep": (200, b"[" * 100_000 + b"]" * 100_000),
    "deep-error": (503, b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "not-an-object": (200, b"[1, 2]"),
    "records-not-a-list": (200, b'{"records": {"vllm": 1}}'),
    "poisoned-record": (
        200,
        json.dumps({"records": [{"service": SVC, "handle": {"pid": 2**31}}]}).encode(),
    ),
    "granted-no": (200, b'{"granted": "no", "record": {"service": "vllm"}}'),
}


@pytest.mark.parametrize(("status", "body"), BROKEN_ANSWERS.values(), ids=BROKEN_ANSWERS.keys())
def test_an_agent_that_answers_nonsense_is_unavailable_not_a_crash(
    status: int, body: bytes
) -> None:
    """Whatever the peer on the agent's port answers, the agent store raises one of
    gpuctl's errors (UNKNOWN for status), never RecursionError or a KeyError."""
    from gpuctl.errors import AgentUnavailable

    with serve_in_thread(peer_answering(status, body)) as url:
        store = AgentStore(url, TOKEN, host_name="testhost")
        try:
            with pytest.raises(AgentUnavailable):  # none of them is a list of records
                store.records()
            for call in (
                store.set_aside,  # an answer without the key is an agent before it: []
                lambda: store.get(SVC),
                lambda: store.acquire(SVC, holder(), 60),
                lambda: store.touch(SVC),
            ):
                try:
                    got = call()
                except (AgentUnavailable, StoreError):
                    continue
                assert got == [], got  # the one sound answer among these
        finally:
            store.close()
