"""The journal (``adapters.store.journal``) on real files: a witness that never fails its
caller, safe among many writers and against kill -9, links and corrupt files; and the
usage arithmetic (``core.usage``) against the clock."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store import journal as jmod
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.adapters.store.journal import Journal
from gpuctl.core.events import Cause, Event, Kind, event_from_dict, words
from gpuctl.core.record import Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.usage import DAY_S, fold, group
from tests.conftest import gpuctl_in_process

ROOT = Path(__file__).resolve().parents[1]


def ev(at: float, kind: Kind, service: str, **kw: object) -> Event:
    figures = kw.pop("figures", {})
    who = kw.pop("who", {"user": "alice", "entry": "test"})
    return Event(at, kind, service, who=who, figures=figures, **kw)  # type: ignore[arg-type]


def test_events_round_trip_redacted_and_bounded(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    e = ev(100.0, Kind.LAUNCH, "chat", command="vllm serve --api-key sk-secret123 m")
    raw = event_from_dict(json.loads(json.dumps(e.to_dict())))
    assert "sk-secret123" not in (raw.command or "")
    assert j.write(raw)
    [(rid, back)] = j.read(0.0)
    assert rid == 1 and back.kind is Kind.LAUNCH and "sk-secret123" not in (back.command or "")
    with pytest.raises(ValueError, match=r"event\.reason"):
        event_from_dict({**e.to_dict(), "reason": "x" * 501})
    with pytest.raises(ValueError, match="unknown field"):
        event_from_dict({**e.to_dict(), "extra": 1})


def test_the_journal_is_made_with_the_stores_modes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    old = os.umask(0)
    try:
        assert Journal(state).write(ev(1.0, Kind.ADMIT, "a"))
    finally:
        os.umask(old)
    for name in ("journal.db", "journal.db-wal", "journal.db-shm"):
        assert (state / name).stat().st_mode & 0o777 == 0o600, name


def test_a_link_in_place_of_the_journal_is_set_aside_never_followed(tmp_path: Path) -> None:
    state, elsewhere = tmp_path / "state", tmp_path / "victim"
    state.mkdir()
    elsewhere.write_text("precious")
    (state / "journal.db").symlink_to(elsewhere)
    (state / "journal.db-wal").symlink_to(tmp_path / "wal-target")
    assert Journal(state).write(ev(1.0, Kind.ADMIT, "a"))
    assert elsewhere.read_text() == "precious"
    assert not (tmp_path / "wal-target").exists()
    assert not (state / "journal.db").is_symlink()
    kept = sorted(p.name for p in state.iterdir() if ".link-" in p.name)
    assert len(kept) == 2 and all(p.startswith("journal.db") for p in kept)


def test_a_corrupt_journal_is_set_aside_and_a_new_one_started(tmp_path: Path) -> None:
    (tmp_path / "journal.db").write_bytes(b"this is not a database" * 500)
    j = Journal(tmp_path)
    assert j.write(ev(5.0, Kind.ADMIT, "a"))
    assert [e.service for _, e in j.read(0.0)] == ["a"]
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("journal.db.corrupt-")]
    assert len(kept) == 1 and kept[0].read_bytes().startswith(b"this is not")


def test_a_full_disk_never_fails_a_start_or_a_stop(tmp_path: Path) -> None:
    """SQLite's own "database or disk is full" (its page limit reached): the record
    writes go on, the events are dropped and counted."""
    store = DirectStore(tmp_path)
    j = jmod.journal_for(tmp_path)
    assert j.write(ev(1.0, Kind.ADMIT, "svc"))
    with j._db() as db:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
    before = jmod.failures()
    holder = holder_here("test")
    big = "x" * 400
    for i in range(40):
        granted, _ = store.acquire("svc", holder, 30.0, event=ev(i, Kind.LAUNCH, "svc", reason=big))
        assert granted
        store.update(
            "svc", holder.id, RecordUpdate(phase=Phase.RUNNING), event=ev(i, Kind.READY, "svc")
        )
        rec = store.release(
            "svc", holder.id, RecordUpdate(phase=Phase.STOPPED),
            event=ev(i, Kind.STOP, "svc", cause=Cause.MANUAL, reason=big),
        )  # fmt: skip
        assert rec.phase.value == "stopped"
    assert jmod.failures() > before
    j.close()
    jmod._journals.pop(tmp_path, None)


def test_an_unwritable_journal_warns_once_and_the_cli_goes_on(tmp_path: Path) -> None:
    """journal.db a folder (it cannot be opened): ensure-like writes through the store
    succeed, and the process says so on stderr once."""
    state = tmp_path / "state"
    (state / "journal.db").mkdir(parents=True)
    code = (
        "import sys; from pathlib import Path\n"
        "from gpuctl.adapters.store import holder_here\n"
        "from gpuctl.adapters.store.direct import DirectStore\n"
        "from gpuctl.core.events import Event, Kind\n"
        "from gpuctl.core.record import Phase\n"
        "from gpuctl.core.record_shapes import RecordUpdate\n"
        f"s = DirectStore(Path({str(state)!r})); h = holder_here('t')\n"
        "for i in range(5):\n"
        "    ok, _ = s.acquire('svc', h, 30.0, event=Event(i, Kind.LAUNCH, 'svc'))\n"
        "    assert ok\n"
        "    s.release('svc', h.id, RecordUpdate(phase=Phase.STOPPED), event=Event(i, Kind.STOP, 'svc'))\n"
        "print('done')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert r.stderr.count("the journal cannot be written") == 1, r.stderr


_WRITER = """
import os, sys, time
from collections.abc import Iterator
from pathlib import Path
from gpuctl.adapters.store.journal import Journal
from gpuctl.core.events import Event, Kind
j = Journal(Path(sys.argv[1]))
tag, n = sys.argv[2], int(sys.argv[3])
for i in range(n):
    assert j.write(Event(time.time(), Kind.ADMIT, "svc", who={"entry": tag, "pid": str(i)}))
"""


def test_32_writers_and_the_agent_lose_and_duplicate_no_event(tmp_path: Path) -> None:
    from gpuctl.sim.host import SimHost

    per = 15
    with SimHost(gpu_memory="24GiB", root=tmp_path / "host") as h:
        h.start_agent()
        state = h.state_dir
        procs = [
            subprocess.Popen([sys.executable, "-c", _WRITER, str(state), f"w{k}", str(per)])
            for k in range(32)
        ]
        import httpx

        headers = {"Authorization": f"Bearer {h.token}"}
        for i in range(per):
            body = {"events": [{"at": time.time(), "kind": "admit", "service": "svc",
                                "who": {"entry": "agent", "pid": str(i)}}]}  # fmt: skip
            r = httpx.post(f"{h.agent_url}/events", json=body, headers=headers, timeout=30)
            assert r.status_code == 200 and r.json() == {"written": 1}, r.text
        for p in procs:
            assert p.wait(timeout=120) == 0
        got = Journal(state).read(0.0)
    seen = [(e.who["entry"], e.who["pid"]) for _, e in got]
    expected = {(f"w{k}", str(i)) for k in range(32) for i in range(per)}
    expected |= {("agent", str(i)) for i in range(per)}
    assert len(seen) == len(expected)
    assert set(seen) == expected
    assert len({rid for rid, _ in got}) == len(got)


_HOLDER = """
import sys, time, sqlite3
from collections.abc import Iterator
from pathlib import Path
from gpuctl.adapters.store.journal import Journal
from gpuctl.core.events import Event, Kind
j = Journal(Path(sys.argv[1]))
assert j.write(Event(1.0, Kind.ADMIT, "before"))
db = j._open()
db.execute("BEGIN IMMEDIATE")
for i in range(500):
    db.execute("INSERT INTO events(at, service, kind, body) VALUES (?,?,?,?)",
               (2.0, "torn", "admit", '{"at":2.0,"kind":"admit","service":"torn"}'))
print("mid", flush=True)
time.sleep(60)
"""


def test_kill_9_mid_transaction_leaves_a_readable_journal(tmp_path: Path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "mid"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    p.stdout.close()
    j = Journal(tmp_path)
    assert [e.service for _, e in j.read(0.0)] == ["before"]
    assert j.write(ev(3.0, Kind.ADMIT, "after"))  # the dead writer's lock went with it
    assert [e.service for _, e in j.read(0.0)] == ["before", "after"]
    with sqlite3.connect(tmp_path / "journal.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_usage_over_a_scripted_hour_matches_the_clock() -> None:
    """A fake-clock hour: chat loaded 20 min (80 GiB), preempting photos (30 GiB, back
    after); tiny (no budget) loaded 30 min. Within 2 % of the truth (here: exact)."""
    t0 = 1_767_225_600.0 + 3600  # 01:00 UTC
    events = [
        ev(t0, Kind.LAUNCH, "photos", figures={"budget_mib": 30 * 1024}),
        ev(t0 + 60, Kind.READY, "photos", figures={"cold_start_s": 60.0, "memory_mib": 28 * 1024}),
        ev(t0 + 600, Kind.LAUNCH, "chat", figures={"budget_mib": 80 * 1024},
           who={"user": "bob", "entry": "proxy"}),
        ev(t0 + 600, Kind.STOP, "photos", cause=Cause.PREEMPTED, by="chat",
           who={"user": "bob", "entry": "preempt"}),
        ev(t0 + 700, Kind.READY, "chat", figures={"cold_start_s": 100.0}),
        ev(t0 + 1800, Kind.STOP, "chat", cause=Cause.IDLE, figures={"idle_s": 900.0}),
        ev(t0 + 1800, Kind.RESUME, "photos", figures={"budget_mib": 30 * 1024}),
        ev(t0 + 1800, Kind.LAUNCH, "tiny"),
        ev(t0 + 3000, Kind.STOP, "tiny", cause=Cause.MANUAL),
    ]  # fmt: skip
    rows, held = fold(events, t0, t0 + 3600)
    by = group(rows, "service")
    truth = {"photos": (600 + 1800) / 3600 * 30, "chat": 1200 / 3600 * 80}
    for name, gib_h in truth.items():
        assert abs(by[name].gib_hours - gib_h) <= 0.02 * gib_h, (name, by[name])
    assert by["tiny"].gib_hours == 0 and by["tiny"].unknown_hours == pytest.approx(1200 / 3600)
    assert by["photos"].preempted == 1 and by["chat"].preempting == 1
    assert by["chat"].idle_before_stop_s == 900.0
    assert by["chat"].cold_median_s() == 100.0
    assert by["photos"].seen_gib_hours == pytest.approx(28 * 540 / 3600)
    assert set(held) == {"photos"}  # still loaded at the end of the hour
    users = group(rows, "user")
    assert users["bob"].preempting == 1 and users["alice"].preempted == 1


def test_usage_of_a_short_real_run_matches_the_wall_clock(tmp_path: Path) -> None:
    """The held time ``usage`` adds up from the launch and stop events matches the time
    the service was held, measured on the monotonic clock at the same two moments (the
    store's own cost, the journal's first open included, is outside that span)."""
    store = DirectStore(tmp_path)
    holder = holder_here("test")
    begin = time.time()
    launched, launched_mono = time.time(), time.monotonic()
    store.acquire("svc", holder, 30.0, event=ev(launched, Kind.LAUNCH, "svc",
                                                 figures={"budget_mib": 10240.0}))  # fmt: skip
    time.sleep(2.0)
    stopped, stopped_mono = time.time(), time.monotonic()
    store.release("svc", holder.id, RecordUpdate(phase=Phase.STOPPED),
                  event=ev(stopped, Kind.STOP, "svc", cause=Cause.MANUAL))  # fmt: skip
    wall = stopped_mono - launched_mono
    rows = jmod.journal_for(tmp_path).usage(begin - 60)
    held = group(rows, "service")["svc"].held_s
    assert abs(held - wall) <= 0.02 * wall, (held, wall)
    assert group(rows, "service")["svc"].gib_hours == pytest.approx(10 * held / 3600)


def test_usage_shows_no_idle_time_for_a_service_never_stopped_for_idleness() -> None:
    """The IDLE→STOP column is the idle time before stops for idleness (reclaim, yield):
    "-" where there were none, never a 0s that reads as an instant stop."""
    from gpuctl.core.usage import Tally
    from gpuctl.render.events_view import usage_lines, usage_row

    idle = Tally(held_s=3600.0, idle_before_stop_s=900.0, stops={"idle": 1})
    manual = Tally(held_s=3600.0, stops={"manual": 2})
    head, chat, photos = usage_lines(
        [usage_row("chat", idle), usage_row("photos", manual)], "service"
    )
    column = head.index("IDLE")
    assert chat[column:].split()[0] == "15m00s"
    assert photos[column:].split()[0] == "-"


def test_pruned_days_survive_as_daily_rows(tmp_path: Path) -> None:
    now = time.time()
    today = now - now % DAY_S
    j = Journal(tmp_path, clock=lambda: now)
    events = []
    for d in range(10, 0, -1):  # one 2-hour hold a day, 10 days back to yesterday
        start = today - d * DAY_S + 3600
        events += [
            ev(start, Kind.LAUNCH, "chat", figures={"budget_mib": 1024.0}),
            ev(start + 7200, Kind.STOP, "chat", cause=Cause.IDLE, figures={"idle_s": 60.0}),
        ]
    events.append(ev(today + 60, Kind.LAUNCH, "chat", figures={"budget_mib": 1024.0}))
    assert j.write(*events)
    before = group(j.usage(today - 10 * DAY_S), "service")["chat"]
    gone = j.maintain(days=3)
    assert gone == sum(1 for e in events if e.at < now - 3 * DAY_S)
    after = group(j.usage(today - 10 * DAY_S), "service")["chat"]
    assert after.gib_hours == pytest.approx(before.gib_hours)
    assert after.stops == before.stops == {"idle": 10}
    assert after.held_s == pytest.approx(20 * 3600 + now - today - 60)
    assert len(j.read(0.0)) == len(events) - gone


def test_words_say_who_and_why() -> None:
    e = ev(0.0, Kind.STOP, "photos", cause=Cause.PREEMPTED, by="chat",
           reason="priority 100, needed 81920 MiB on GPU 0",
           who={"user": "alice", "entry": "proxy"})  # fmt: skip
    assert words(e) == (
        "photos preempted by chat — priority 100, needed 81920 MiB on GPU 0 — alice via proxy"
    )


def test_the_read_token_reads_and_follows_the_journal_but_cannot_write(tmp_path: Path) -> None:
    import httpx

    from gpuctl.sim.host import SimHost

    token_file = tmp_path / "read.token"
    token_file.write_text("r" * 32 + "\n")
    token_file.chmod(0o600)
    with SimHost(gpu_memory="24GiB", root=tmp_path / "host") as h:
        h.start_agent(args=["--read-token-file", str(token_file)])
        write = {"Authorization": f"Bearer {h.token}"}
        read = {"Authorization": f"Bearer {'r' * 32}"}
        body = {"events": [{"at": time.time(), "kind": "admit", "service": "svc"}]}
        assert httpx.post(f"{h.agent_url}/events", json=body, headers=read).status_code == 403
        r = httpx.post(f"{h.agent_url}/events", json=body, headers=write)
        assert r.json() == {"written": 1}, r.text
        r = httpx.get(f"{h.agent_url}/events?since=1h", headers=read)
        assert r.status_code == 200 and [e["service"] for e in r.json()["events"]] == ["svc"]
        assert r.json()["events"][0]["who"] == {"peer": r.json()["events"][0]["who"]["peer"],
                                                "role": "write"}  # fmt: skip
        r = httpx.get(f"{h.agent_url}/usage?since=1d", headers=read)
        assert r.status_code == 200 and "rows" in r.json()
        # ?follow=1: server-sent events, the ones there and then the ones written after.
        with httpx.stream(
            "GET", f"{h.agent_url}/events?follow=1&since=1h", headers=read, timeout=30
        ) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = s.iter_lines()
            assert next(lines) == "id: 1"
            assert json.loads(next(lines).removeprefix("data: "))["service"] == "svc"
            later = {"events": [{"at": time.time(), "kind": "ready", "service": "later"}]}
            assert httpx.post(f"{h.agent_url}/events", json=later, headers=write).is_success
            got = [ln for ln in (next(lines) for _ in range(4)) if ln.startswith("data: ")]
            assert json.loads(got[0].removeprefix("data: "))["service"] == "later"


def test_locks_lists_a_set_aside_journal(cli_env: Path) -> None:
    """A corrupt journal set aside is listed by `gpuctl locks` like any other set-aside
    file, with why."""
    from tests.conftest import config_file, gpuctl_in_process

    state = cli_env / "state"
    state.mkdir()
    (state / "journal.db").write_bytes(b"not a database at all" * 300)
    j = Journal(state)
    assert j.write(ev(time.time(), Kind.ADMIT, "a"))
    j.close()
    kept = sorted(p.name for p in state.iterdir() if jmod.CORRUPT_SUFFIX in p.name)
    # The database, and whatever -wal and -shm were beside it (set aside with it).
    firsts = [n.split(".corrupt-")[0] for n in kept]
    assert "journal.db" in firsts and set(firsts) <= {"journal.db", "journal.db-wal",
                                                      "journal.db-shm"}  # fmt: skip
    listed = DirectStore(state).set_aside()
    assert sorted(a.file for a in listed) == kept
    assert {a.service for a in listed} == {"_journal"}
    assert all("new one was started" in a.why for a in listed)
    cfg = config_file(cli_env)
    cfg.write_text(f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{cli_env / "sim"}"\n')
    r = gpuctl_in_process(cfg, "locks", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    shown = json.loads(r.stdout)["set_aside"]
    assert sorted(a["file"] for a in shown) == kept, shown
    r = gpuctl_in_process(cfg, "locks")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kept unreadable journal {kept[0]}" in " ".join(r.stdout.split()), r.stdout


def test_reclaim_prunes_the_journal_on_a_host_without_an_agent(cli_env: Path) -> None:
    """No agent: `gpuctl reclaim` prunes. Events past 90 days go; their totals stay as
    daily rows; recent events stay."""
    from tests.conftest import config_file, gpuctl_in_process

    state = cli_env / "state"
    state.mkdir()
    now = time.time()
    old = now - 100 * DAY_S
    j = Journal(state)
    assert j.write(
        ev(old, Kind.LAUNCH, "chat", figures={"budget_mib": 1024.0}),
        ev(old + 3600, Kind.STOP, "chat", cause=Cause.IDLE, figures={"idle_s": 60.0}),
        ev(now - 60, Kind.ADMIT, "chat"),
    )
    before = group(j.usage(old - DAY_S), "service")["chat"]
    j.close()
    cfg = config_file(cli_env)
    cfg.write_text(f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{cli_env / "sim"}"\n')
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0, r.stdout + r.stderr
    j = Journal(state)
    try:
        assert [e.kind for _, e in j.read(0.0)] == [Kind.ADMIT]
        after = group(j.usage(old - DAY_S), "service")["chat"]
        assert after.gib_hours == pytest.approx(before.gib_hours) and after.gib_hours > 0
        assert after.stops == {"idle": 1}
    finally:
        j.close()


def test_a_stop_that_changes_nothing_writes_no_event(cli_env: Path) -> None:
    """`gpuctl stop` of a service already stopped, with nothing of it running, changed
    nothing: no event, so usage does not count stops that never happened."""
    from tests.conftest import config_file, gpuctl_in_process

    state = cli_env / "state"
    state.mkdir()
    cfg = config_file(cli_env)
    cfg.write_text(
        f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{cli_env / "sim"}"\n\n'
        '[services.chat]\nlauncher = "process"\ncommand = "true"\n'
        'health = "http://127.0.0.1:9/health"\nmatch = ["chat-nothing"]\n'
    )
    for _ in range(2):
        r = gpuctl_in_process(cfg, "stop", "chat")
        assert r.returncode == 0, r.stdout + r.stderr
    j = Journal(state)
    try:
        assert [e.kind for _, e in j.read(0.0) if e.service == "chat"] == []
    finally:
        j.close()


def mount_tmpfs(where: Path, size: str = "24m") -> None:
    """A real tmpfs of ``size`` at ``where`` (skips the test where mounting is refused)."""
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 24 MiB mounted at ``tmp_path/disk``, unmounted after."""
    where = tmp_path / "disk"
    where.mkdir()
    mount_tmpfs(where)
    try:
        yield where
    finally:
        umount(where)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all of ``disk``'s free space but ``leave`` bytes."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    with filler.open("ab") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_sqlite_run_to_the_end_of_a_real_disk_fails_only_its_write(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the reserve, the journal is written until SQLite itself gets ENOSPC on a
    real tmpfs: the write returns False (never raises), is counted and warned of once;
    what was written stays readable; with room again it writes."""
    monkeypatch.setattr(jmod, "RESERVE_BYTES", 0)
    monkeypatch.setattr(jmod, "_written", {})
    state = small_disk / "state"
    state.mkdir()
    j = Journal(state)
    assert j.write(ev(1.0, Kind.ADMIT, "before"))
    filler = fill(small_disk, 256 * 1024)
    written = 0
    with caplog.at_level("WARNING", logger="gpuctl.journal"):
        while j.write(*(ev(2.0, Kind.LAUNCH, "svc", reason="x" * 400) for _ in range(20))):
            written += 20
            assert written < 100_000, "the disk never filled"
    assert jmod.failures() == 1
    assert "database or disk is full" in caplog.text  # SQLite's own ENOSPC
    assert caplog.text.count("cannot be written") == 1  # warned once
    assert len(j.read(0.0)) == 1 + written  # the failed batch left nothing half-written
    filler.unlink()
    assert j.write(ev(4.0, Kind.ADMIT, "after"))
    assert [e.service for _, e in j.read(0.0)][-1] == "after"
    with sqlite3.connect(state / "journal.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    j.close()


@pytest.mark.slow  # four ensure/stop cycles through a real agent: some 15 s
def test_a_full_disk_under_the_agent_leaves_starts_and_stops_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's state folder on a real tmpfs, filled but the journal's reserve: every
    `gpuctl ensure` and `gpuctl stop` still works, the journal drops their events, the
    agent warns once and `/metrics` counts each dropped write; room again, it writes."""
    import httpx

    from gpuctl.sim.host import SimHost, free_port
    from tests.ensure_helpers import kill_servers, priced_service, run_ensure, unique_name

    root = tmp_path / "host"
    state = root / "state"
    state.mkdir(parents=True)
    mount_tmpfs(state)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(state))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(root / "sim"))
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "24GiB")
    name, port = unique_name("full"), free_port()
    try:
        with SimHost(gpu_memory="24GiB", root=root) as h:
            h.start_agent()
            log = f'log = "{tmp_path / "server.log"}"'  # the server's log is elsewhere
            cfg = h.write_config(priced_service(name, port, 4, 50, log))
            auth = {"Authorization": f"Bearer {h.token}"}

            def cycle() -> None:
                r = run_ensure(cfg, name)
                assert r.returncode == 0, r.stdout + r.stderr
                assert json.loads(r.stdout)["outcome"] == "ready"
                r = gpuctl_in_process(cfg, "stop", name)
                assert r.returncode == 0, r.stdout + r.stderr
                assert (
                    json.loads((state / "records" / f"{name}.json").read_text())["phase"]
                    == "stopped"
                )

            def kinds() -> list[str]:
                j = Journal(state)
                try:
                    return [e.kind.value for _, e in j.read(0.0) if e.service == name]
                finally:
                    j.close()

            def dropped() -> int:
                text = httpx.get(f"{h.agent_url}/metrics", headers=auth).text
                line = next(
                    ln for ln in text.splitlines()
                    if ln.startswith("gpuctl_journal_write_failures_total ")
                )  # fmt: skip
                return int(float(line.split()[1]))

            cycle()
            told = ["admit", "launch", "ready", "stop"]
            assert kinds() == told and dropped() == 0
            filler = fill(state, jmod.RESERVE_BYTES // 2)
            for _ in range(3):
                cycle()
            assert kinds() == told  # none of the three cycles' events was written
            assert dropped() == 3 * len(told)
            agent_log = (root / "agent.log").read_text()
            assert agent_log.count("the journal cannot be written") == 1, agent_log[-2000:]
            filler.unlink()
            cycle()
            assert kinds() == told * 2
            assert dropped() == 3 * len(told)
    finally:
        kill_servers(name)
        umount(state)


# Rows a member of the state folder's group can write straight into the file: each one
# breaks a reader that trusts the stored shape (NaN is not JSON; 1e300 and -1 are no
# time localtime can show; a number where words() joins text).
FORGED = [
    {"at": "nan", "kind": "stop", "service": "nan-time"},
    {"at": 1e300, "kind": "stop", "service": "far-future"},
    {"at": -1e15, "kind": "stop", "service": "far-past"},
    {"at": 100.0, "kind": "stop", "service": "who-number", "who": {"user": 5}},
    {"at": 100.0, "kind": "fail", "service": "text-figure", "figures": {"exit_code": "x"}},
    {"at": 100.0, "kind": "ready", "service": "list-reason", "reason": ["x"]},
    {"at": 100.0, "kind": "stop", "service": 7},
]


def test_a_forged_row_is_skipped_and_never_breaks_a_reader(tmp_path: Path, cli_env: Path) -> None:
    """The journal's reader skips a row that is not an event: the agent answers strict
    JSON, the page gets no NaN, and ``gpuctl events`` prints the true events."""
    from typer.testing import CliRunner

    from gpuctl.agent.app import AgentSettings, create_app
    from gpuctl.cli.app import create_app as create_cli
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    state = cli_env / "state"
    state.mkdir(exist_ok=True)
    assert Journal(state).write(ev(time.time(), Kind.ADMIT, "good"))
    db = sqlite3.connect(state / "journal.db")
    for row in FORGED:
        db.execute(
            "INSERT INTO events(at, service, kind, body) VALUES (?,?,?,?)",
            (time.time(), str(row["service"]), row["kind"], json.dumps(row)),
        )
    db.commit()
    db.close()
    assert [e.service for _, e in Journal(state).read(0.0)] == ["good"]

    def no_constant(name: str) -> object:
        raise AssertionError(f"{name} is not JSON")

    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        r = httpx.get(f"{url}/events?since=0", headers={"Authorization": "Bearer " + "t" * 32})
    body = json.loads(r.text, parse_constant=no_constant)
    assert r.status_code == 200 and [e["service"] for e in body["events"]] == ["good"]

    config = cli_env / "gpuctl.toml"
    config.write_text('[hosts.local]\nprobe = "sim"\n')
    got = CliRunner().invoke(create_cli(), ["events", "--since", "0", "--config", str(config)])
    assert got.exit_code == 0, got.output
    assert "good admitted" in got.output and "internal error" not in got.output


def test_an_event_at_no_time_a_clock_can_show_is_refused_naming_its_field() -> None:
    for at in (1e300, -1.0, 4_102_444_801.0):
        with pytest.raises(ValueError, match=r"event\.at"):
            event_from_dict({"at": at, "kind": "admit", "service": "svc"})


def test_a_fifo_in_place_of_the_journal_is_set_aside_never_opened(tmp_path: Path) -> None:
    """A FIFO at any of the three files: SQLite never opens it (it would fail every
    write for good); it is set aside, and the journal goes on in new files."""
    for name in ("journal.db", "journal.db-wal", "journal.db-shm"):
        os.mkfifo(tmp_path / name)
    j = Journal(tmp_path)
    assert j.write(ev(5.0, Kind.ADMIT, "a"))
    assert [e.service for _, e in j.read(0.0)] == ["a"]
    kept = sorted(p.name for p in tmp_path.iterdir() if ".special-" in p.name)
    assert sorted(k.split(".special-")[0] for k in kept) == [
        "journal.db",
        "journal.db-shm",
        "journal.db-wal",
    ]
    assert all((tmp_path / k).is_fifo() for k in kept)
    assert (tmp_path / "journal.db").is_file()


def test_a_journal_that_cannot_be_read_is_a_503_not_an_internal_error(tmp_path: Path) -> None:
    from gpuctl.agent.app import AgentSettings, create_app
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    state = tmp_path / "state"
    (state / "journal.db").mkdir(parents=True)  # cannot be opened, and is not moved
    auth = {"Authorization": "Bearer " + "t" * 32}
    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        for path in ("/events?since=1h", "/usage?since=1d", "/events?follow=1&since=1h"):
            r = httpx.get(f"{url}{path}", headers=auth, timeout=10)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"].startswith("the journal cannot be read"), r.text


def test_a_forged_daily_row_or_usage_answer_never_poisons_a_sum(tmp_path: Path) -> None:
    """A daily row written straight into the file with a total of the wrong kind is
    skipped; an agent that answers one is a broken agent (UNKNOWN), never a crash."""
    from gpuctl.adapters.store import AgentStore
    from gpuctl.errors import GpuctlError
    from tests.agent_helpers import canned, raw_server

    now = time.time()
    today = now - now % DAY_S
    j = Journal(tmp_path, clock=lambda: now)
    for d in (2, 1):
        start = today - d * DAY_S + 3600
        assert j.write(
            ev(start, Kind.LAUNCH, f"day{d}", figures={"budget_mib": 1024.0}),
            ev(start + 3600, Kind.STOP, f"day{d}", cause=Cause.MANUAL),
        )
    j.maintain()
    bad = {"held_s": "x", "add": 5, "stops": {"manual": float("nan")}}
    with j._db() as db:
        db.execute("UPDATE daily SET body = ? WHERE service = 'day2'", (json.dumps(bad),))
    rows = group(j.usage(today - 3 * DAY_S), "service")
    assert set(rows) == {"day1"} and rows["day1"].held_s == pytest.approx(3600)

    row = {"day": "2026-01-01", "service": "s", "user": "u", "held_s": "x"}
    body = json.dumps({"since": 0, "rows": [row]}).encode()
    with (
        raw_server(canned("200 OK", body, "application/json")) as url,
        pytest.raises(GpuctlError, match="broken usage row: held_s"),
    ):
        store = AgentStore(url, "t" * 32)
        try:
            store.usage(0.0)
        finally:
            store.close()


def test_a_follower_is_sent_the_newest_events_then_what_comes(tmp_path: Path) -> None:
    """``?follow=1`` from far back: the newest ``FOLLOW_CATCH_UP`` events, not all of
    them (a follower that never reads holds what it was sent in the agent's memory)."""
    from gpuctl.agent import events_api
    from gpuctl.agent.app import AgentSettings, create_app
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    state = tmp_path / "state"
    state.mkdir()
    total = events_api.FOLLOW_CATCH_UP + 5
    now = time.time()
    assert Journal(state).write(*(ev(now - total + i, Kind.ADMIT, f"s{i}") for i in range(total)))
    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    auth = {"Authorization": "Bearer " + "t" * 32}
    ids: list[int] = []
    with (
        serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url,
        httpx.stream("GET", f"{url}/events?follow=1&since=0", headers=auth, timeout=30) as s,
    ):
        for line in s.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line.removeprefix("id: ")))
            if ids and ids[-1] == total:
                break
    assert ids == list(range(6, total + 1))


def test_events_come_a_page_at_a_time_and_a_reader_reads_them_all(tmp_path: Path) -> None:
    """An answer holds at most ``PAGE_MAX`` events (the agent builds it whole, and a client
    that never reads it keeps it in the agent's memory); ``next`` says where the next
    page begins, and the store's reader follows it to the end. Without ``limit`` (a client
    that does not page) the answer is the window's newest ``PAGE_MAX``."""
    from gpuctl.adapters.store import AgentStore
    from gpuctl.agent.app import AgentSettings, create_app
    from gpuctl.agent.openapi_events import PAGE_MAX
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    state = tmp_path / "state"
    state.mkdir()
    total = 2 * PAGE_MAX + 7
    now = time.time()
    assert Journal(state).write(*(ev(now - total + i, Kind.ADMIT, f"s{i}") for i in range(total)))
    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    auth = {"Authorization": "Bearer " + "t" * 32}
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        first = httpx.get(f"{url}/events?since=0&limit={PAGE_MAX}", headers=auth, timeout=30)
        assert first.status_code == 200, first.text
        page = first.json()
        assert [e["id"] for e in page["events"]] == list(range(1, PAGE_MAX + 1))
        assert page["next"] == PAGE_MAX
        last = httpx.get(f"{url}/events?since=0&limit={PAGE_MAX}&after={2 * PAGE_MAX}",
                         headers=auth, timeout=30).json()  # fmt: skip
        assert len(last["events"]) == 7 and last["next"] is None
        whole = httpx.get(f"{url}/events?since=0", headers=auth, timeout=30).json()
        assert [e["id"] for e in whole["events"]] == list(range(total - PAGE_MAX + 1, total + 1))
        assert whole["next"] is None
        too_many = httpx.get(f"{url}/events?limit={PAGE_MAX + 1}", headers=auth, timeout=30)
        assert too_many.status_code == 400 and "limit" in too_many.json()["error"]

        store = AgentStore(url, "t" * 32)
        try:
            got = store.events(0.0)
            assert [i for i, _ in got] == list(range(1, total + 1))
            assert [e.service for _, e in got[:2]] == ["s0", "s1"]
            assert [i for i, _ in store.events(0.0, after_id=total - 3)] == [
                total - 2, total - 1, total,
            ]  # fmt: skip
        finally:
            store.close()


def test_a_reader_never_loops_on_a_next_that_does_not_move_on(tmp_path: Path) -> None:
    """A broken or hostile agent whose ``next`` points back: one page, then the end."""
    from gpuctl.adapters.store import AgentStore
    from tests.agent_helpers import canned, raw_server

    row = {"id": 5, **ev(time.time(), Kind.ADMIT, "s").to_dict()}
    body = json.dumps({"events": [row], "next": 5}).encode()
    with raw_server(canned("200 OK", body, "application/json")) as url:
        store = AgentStore(url, "t" * 32)
        try:
            assert [i for i, _ in store.events(0.0, after_id=5)] == [5]
        finally:
            store.close()


def test_a_row_that_is_not_an_event_never_ends_a_readers_paging(tmp_path: Path) -> None:
    """A page is full by its rows, not by the events decoded from them: one forged row
    skipped must not make the page look like the last one."""
    j = Journal(tmp_path)
    now = time.time()
    assert j.write(*(ev(now - 10 + i, Kind.ADMIT, f"s{i}") for i in range(6)))
    with j._db() as db:
        db.execute("UPDATE events SET body = ? WHERE id = 2", ('{"kind": "from-the-future"}',))
    try:
        rows, nxt = j.page(0.0, size=3)
        assert [i for i, _ in rows] == [1, 3] and nxt == 3
        rows, nxt = j.page(0.0, after_id=3, size=3)
        assert [i for i, _ in rows] == [4, 5, 6] and nxt == 6
        assert j.page(0.0, after_id=6, size=3) == ([], None)
    finally:
        j.close()


def test_a_reader_stops_following_a_next_that_creeps_on_for_ever() -> None:
    """A hostile agent whose every page is empty and whose next is one id further: the
    store's reader stops after EVENTS_PAGES_MAX pages, not at id 2**62."""
    from urllib.parse import parse_qs

    from gpuctl.adapters.store import AgentStore
    from gpuctl.adapters.store.agent import EVENTS_PAGES_MAX
    from tests.agent_helpers import serve_in_thread

    asked = []

    async def creeping(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        after = int(parse_qs(scope["query_string"].decode())["after"][0])
        asked.append(after)
        body = json.dumps({"events": [], "next": after + 1}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})  # fmt: skip

    with serve_in_thread(creeping) as url:
        store = AgentStore(url, "t" * 32)
        try:
            assert store.events(0.0) == []
        finally:
            store.close()
    assert len(asked) == EVENTS_PAGES_MAX


def test_a_follower_that_never_reads_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared tail keeps at most ``MAX_BEHIND`` batches for a follower; one that
    falls further behind is let go (its stream ends; it resumes with ``?after=``)."""
    import asyncio

    from gpuctl.agent import events_api

    monkeypatch.setattr(events_api, "FOLLOW_POLL_S", 0.01)
    monkeypatch.setattr(events_api, "MAX_BEHIND", 3)
    j = Journal(tmp_path)

    async def scenario() -> tuple[int, bool, bool]:
        tail = events_api._Tail(j)
        stalled, reading = tail.subscribe(), tail.subscribe()
        for i in range(500):
            await asyncio.to_thread(j.write, ev(time.time(), Kind.ADMIT, f"s{i}"))
            while not reading.empty():
                reading.get_nowait()
            await asyncio.sleep(0.02)
            if stalled not in tail.subscribers:
                break
        kept = stalled.qsize()
        dropped, still = stalled not in tail.subscribers, reading in tail.subscribers
        tail.subscribers.clear()
        assert tail.task is not None
        await tail.task
        return kept, dropped, still

    assert asyncio.run(scenario()) == (3, True, True)


def test_events_are_encoded_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /events`` answers up to 100,000 events (some 100 MB of JSON): encoded on the
    event loop, twenty at once kept every other request waiting seconds."""
    import asyncio
    import threading

    from gpuctl.agent import events_api
    from gpuctl.agent.app import AgentSettings, create_app
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    on_loop: list[bool] = []
    real = events_api.json_response

    def spy(*args: object, **kw: object) -> object:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(events_api, "json_response", spy)
    state = tmp_path / "state"
    state.mkdir()
    assert Journal(state).write(ev(time.time(), Kind.ADMIT, "a"))
    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        r = httpx.get(f"{url}/events?since=1h", headers={"Authorization": "Bearer " + "t" * 32})
    assert r.status_code == 200 and [e["service"] for e in r.json()["events"]] == ["a"]
    assert on_loop == [False]


def test_an_agents_error_text_never_reaches_the_terminal_raw(cli_env: Path) -> None:
    """``gpuctl events`` and ``usage`` print a host's error: an agent's words, escaped
    (``core.safe_text``), so a hostile one cannot clear the screen or retitle it."""
    from typer.testing import CliRunner

    from gpuctl.cli.app import create_app as create_cli
    from tests.agent_helpers import canned, raw_server

    body = json.dumps({"error": "\x1b]0;pwn\x07\x1b[2Jboom", "hint": ""}).encode()
    with raw_server(canned("503 Service Unavailable", body, "application/json")) as url:
        config = cli_env / "gpuctl.toml"
        config.write_text(f'[hosts.h]\nagent = "{url}"\n')
        for command in ("events", "usage"):
            got = CliRunner().invoke(
                create_cli(), [command, "--since", "1d", "--config", str(config)]
            )
            assert got.exit_code == 4, got.output
            assert "\x1b" not in got.output and "\\x1b]0;pwn\\x07" in got.output, got.output


def test_an_event_told_here_is_redacted_like_one_sent_to_the_agent(tmp_path: Path) -> None:
    """A flow on the GPU host (the CLI, the page's buttons, reclaim) writes its events
    straight to the journal, which the read-only token reads through ``/events``: a
    secret in a reason (a health URL's password, an API key quoted in an error) is
    masked there as the agent masks it in an event it is sent."""
    from gpuctl.flows import story

    e = story.ev(
        "fail",
        "chat",
        "cli",
        reason="engine is dead (POST http://u:pw-SECRET1@127.0.0.1:8000/sleep?token=SECRET2)",
        by="proxy --api-key SECRET3",
    )
    j = Journal(tmp_path)
    assert j.write(e)
    [(_, back)] = j.read(0.0)
    text = json.dumps(back.to_dict())
    assert "SECRET" not in text, text
    assert back.reason is not None and "127.0.0.1:8000/sleep" in back.reason


@pytest.mark.parametrize(
    ("text", "back"),
    [("1h30m", 5400.0), ("1d12h", 129600.0), ("2h", 7200.0), ("1w1d", 691200.0)],
)
def test_since_takes_a_sum_of_spans_as_durations_elsewhere_do(text: str, back: float) -> None:
    """``--since 1h30m``: config keys and ``--timeout`` take it, and so does ``since``."""
    from gpuctl.core.events import parse_since

    assert parse_since(text, 1e9) == 1e9 - back
    for bad in ("1h30", "h30m", "1h 30m", "1h-30m"):
        with pytest.raises(ValueError):
            parse_since(bad, 1e9)


def test_a_span_back_past_1970_reads_from_the_start(tmp_path: Path) -> None:
    """``--since 1e17d`` (or ``?since=999999999999d``, which the agent's pattern allows)
    named a day no clock can show: usage over rolled-up days died in ``gmtime``."""
    from gpuctl.agent.app import AgentSettings, create_app
    from gpuctl.core.events import parse_since
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    now = time.time()
    assert parse_since("1e17d", now) == parse_since("999999999999d", now) == 0.0
    state = tmp_path / "state"
    state.mkdir()
    j = Journal(state, clock=lambda: now)
    start = now - now % DAY_S - DAY_S + 3600
    assert j.write(ev(start, Kind.LAUNCH, "chat"), ev(start + 3600, Kind.STOP, "chat"))
    j.maintain()
    rows = group(j.usage(parse_since("1e17d", now)), "service")
    assert rows["chat"].held_s == pytest.approx(3600)
    settings = AgentSettings(token="t" * 32, state_dir=str(state))
    with serve_in_thread(create_app(settings, FakeProbe(reading_of()))) as url:
        r = httpx.get(
            f"{url}/usage?since=999999999999d", headers={"Authorization": "Bearer " + "t" * 32}
        )
    assert r.status_code == 200, r.text
    assert [row["service"] for row in r.json()["rows"]] == ["chat"]
