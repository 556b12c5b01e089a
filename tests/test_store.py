"""The state store (DESIGN §3) on real files, real locks and real processes.

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

from gpuctl.adapters import procinfo
from gpuctl.adapters.store import AgentStore, DirectStore, Holder, Store, holder_here
from gpuctl.agent.app import AgentApp, AgentSettings, create_app
from gpuctl.core.record import Lease, Phase, Record
from gpuctl.errors import AgentAuthError, GpuctlError, StoreError, UsageError
from tests.agent_helpers import FakeProbe, serve_in_thread

TOKEN = "store-test-token"
SVC = "vllm"
KINDS = ["direct", "agent"]

# A child process that takes the lease of SVC, says so, and then exits or waits.
CHILD = """
import sys, time
from pathlib import Path
from gpuctl.adapters.store import AgentStore, DirectStore, holder_here

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
        SVC, h1.id, {"phase": "starting", "handle": handle, "attempt": {"at": 1, "ok": None}}
    )
    assert rec.phase is Phase.STARTING
    assert rec.handle == handle
    assert rec.attempts == ({"at": 1, "ok": None},)
    assert env.store.get(SVC) == rec
    assert env.direct.get(SVC) == rec
    assert env.store.records() == [rec]

    released = env.store.release(SVC, h1.id, {"phase": "running"})
    assert released.lease is None
    assert released.phase is Phase.RUNNING
    assert released.handle == handle
    assert env.store.get(SVC) == released

    granted, rec = env.store.acquire(SVC, h2, 60)
    assert granted
    # a release by a holder that lost the lease changes nothing
    late = env.store.release(SVC, h1.id, {"phase": "stopped"})
    assert late.lease is not None
    assert late.lease.holder == h2.id
    assert late.phase is Phase.RUNNING
    assert env.store.get(SVC) == late


def test_non_holder_cannot_update_or_renew(env: Env) -> None:
    h1, h2 = holder(), holder()
    with pytest.raises(StoreError, match="no longer ours"):
        env.store.update(SVC, h1.id, {"phase": "running"})
    with pytest.raises(StoreError, match="not held"):
        env.store.renew(SVC, h1.id, 60)
    env.store.acquire(SVC, h1, 60)
    with pytest.raises(StoreError, match=r"no longer ours \(held by test pid"):
        env.store.update(SVC, h2.id, {"phase": "running"})
    with pytest.raises(StoreError, match="no longer ours"):
        env.store.renew(SVC, h2.id, 60)
    rec = env.store.get(SVC)
    assert rec.phase is Phase.STOPPED
    assert rec.lease is not None
    assert rec.lease.holder == h1.id
    # the lock was released after each refusal: the holder goes on
    assert env.store.update(SVC, h1.id, {"phase": "running"}).phase is Phase.RUNNING


def test_bad_update_is_refused_and_changes_nothing(env: Env) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    with pytest.raises(GpuctlError, match="bad record update: unknown update key 'lease'"):
        env.store.update(SVC, h.id, {"phase": "running", "lease": None})
    rec = env.store.get(SVC)
    assert rec.phase is Phase.STOPPED
    assert rec.lease is not None


def test_failure_update_sets_backoff(env: Env) -> None:
    h = holder()
    env.store.acquire(SVC, h, 60)
    now = env.clock()
    rec = env.store.release(SVC, h.id, {"failure": {"error": "exit 1", "log_tail": "OOM"}})
    assert rec.phase is Phase.FAILED
    assert rec.failure is not None
    assert rec.failure.count == 1
    assert rec.failure.backoff_until == pytest.approx(now + 10, abs=2)
    env.store.acquire(SVC, h, 60)
    rec = env.store.update(SVC, h.id, {"failure": {"error": "exit 1"}})
    assert rec.failure is not None
    assert rec.failure.count == 2
    assert rec.failure.backoff_until == pytest.approx(now + 20, abs=2)


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
    env.store.update(SVC, h.id, {"phase": "starting", "handle": {"pid": 1}, "touch": True})
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
    env.store.acquire(SVC, h, 60)
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
            env.store.update(SVC, h.id, {"attempt": {"n": i, "pad": "x" * 2000}, "touch": True})
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
        agent_env.direct.update(SVC, via_files.id, {"phase": "running"})
    agent_env.store.release(SVC, via_agent.id)

    assert agent_env.direct.acquire(SVC, via_files, 60)[0]
    refused, rec = agent_env.store.acquire(SVC, via_agent, 60)
    assert not refused
    assert rec.lease is not None
    assert rec.lease.holder == via_files.id
    with pytest.raises(StoreError, match="no longer ours"):
        agent_env.store.update(SVC, via_agent.id, {"phase": "running"})
    assert agent_env.store.update(SVC, via_files.id, {"phase": "running"}).phase is Phase.RUNNING


def test_processes_on_both_paths_race_one_wins(agent_env: Env, tmp_path: Path) -> None:
    outs = race_processes(agent_env, tmp_path, ["agent", "direct"] * 4)
    assert sorted(o[0] for o in outs) == ["granted"] + ["refused"] * 7
    assert len({o[1] for o in outs}) == 1
