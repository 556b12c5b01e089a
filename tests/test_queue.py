"""The host's wait queue (``gpuctl run --wait``): the pure order (a table), and the store's
queue on real files, real processes and a real agent on loopback.

The end-to-end order of separate ``gpuctl run --wait`` processes is in ``test_run_queue.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuctl.adapters.store import AgentStore, holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.app import AgentApp, AgentSettings, create_app
from gpuctl.core.queue import (
    PRIORITY_MAX,
    QUEUE_TTL_MAX_S,
    Waiter,
    ahead,
    held_back,
    in_order,
    overlived,
    queued_reason,
)
from gpuctl.core.record import Lease
from gpuctl.errors import UsageError
from tests.agent_helpers import FakeProbe, serve_in_thread

TOKEN = "queue-test-token"


# --------------------------------------------------------------------------- the pure order


def w(name: str, priority: int, seq: int, memory_gib: int = 10) -> Waiter:
    lease = Lease(f"id{name}", "h", "b", 100 + seq, None, "run", 0.0, 1e9)
    return Waiter(f"run.{name}", priority, memory_gib * 1024, seq, float(seq), lease)


# (queue as (name, priority, seq), the order it is served in)
ORDER = [
    ([], []),
    ([("a", 50, 1)], ["a"]),
    ([("a", 50, 1), ("b", 50, 2), ("c", 50, 3)], ["a", "b", "c"]),  # equal: arrival
    ([("c", 50, 3), ("a", 50, 1), ("b", 50, 2)], ["a", "b", "c"]),  # whatever the listing
    ([("low", 10, 1), ("high", 90, 2)], ["high", "low"]),  # priority beats arrival
    ([("a", 50, 1), ("b", 60, 2), ("c", 50, 3), ("d", 60, 4)], ["b", "d", "a", "c"]),
    ([("neg", -5, 1), ("zero", 0, 2)], ["zero", "neg"]),
]


@pytest.mark.parametrize(("queue", "served"), ORDER)
def test_the_queue_is_served_by_priority_then_arrival(
    queue: list[tuple[str, int, int]], served: list[str]
) -> None:
    assert [x.name for x in in_order(w(*q) for q in queue)] == [f"run.{s}" for s in served]


QUEUE = [w("a", 50, 1), w("big", 90, 2, 80), w("b", 50, 3), w("c", 10, 4)]
# (who asks: a queued name or a newcomer's priority, the names ahead of it). Only a caller
# with nobody ahead may be admitted: strict head of line, whatever the sizes.
AHEAD = [
    ("big", ["big"][:0]),  # the head: nobody ahead, it may go once it fits
    ("a", ["big"]),  # arrived first, but a higher priority came since
    ("b", ["big", "a"]),  # equal priority to a: a arrived first
    ("c", ["big", "a", "b"]),  # small, low: it waits even where it would fit now
    (95, []),  # a newcomer above everyone would be the head
    (90, ["big"]),  # a newcomer of equal priority comes after those already queued
    (50, ["big", "a", "b"]),
    (5, ["big", "a", "b", "c"]),
]


@pytest.mark.parametrize(("who", "expected"), AHEAD)
def test_only_the_head_goes_and_a_newcomer_queues_behind_its_equals(
    who: str | int, expected: list[str]
) -> None:
    if isinstance(who, str):
        me = next(x for x in QUEUE if x.name == f"run.{who}")
        got = ahead(QUEUE, priority=me.priority, me=me.id)
    else:
        got = ahead(QUEUE, priority=who)
    assert [x.name for x in got] == [f"run.{n}" for n in expected]


def test_a_caller_whose_entry_lapsed_counts_as_a_newcomer() -> None:
    assert [x.name for x in ahead(QUEUE, priority=50, me="idgone")] == [
        "run.big",
        "run.a",
        "run.b",
    ]


def test_the_reason_names_the_head_and_how_many_more() -> None:
    assert queued_reason([QUEUE[1]]).startswith("queued behind run.big (priority 90, 80.0 GiB):")
    assert "run.big (priority 90, 80.0 GiB) and 2 more" in queued_reason(QUEUE[1:])


# --------------------------------------------------------------------------- the store's queue


@pytest.fixture(params=["direct", "agent"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DirectStore | AgentStore]:
    state = tmp_path / "state"
    if request.param == "direct":
        yield DirectStore(state)
        return
    app = create_app(AgentSettings(token=TOKEN, state_dir=str(state)), FakeProbe())
    assert isinstance(app, AgentApp)
    with serve_in_thread(app) as url:
        s = AgentStore(url, TOKEN, host_name="testhost")
        try:
            yield s
        finally:
            s.close()


def test_join_renew_and_leave(store: DirectStore | AgentStore) -> None:
    a, b, c = holder_here("run"), holder_here("run"), holder_here("run")
    me, q = store.queue_join(a, 30, name="run.a", priority=50, memory_mib=1024)
    assert (me.seq, [x.id for x in q]) == (1, [a.id])
    _, q = store.queue_join(b, 30, name="run.b", priority=50, memory_mib=2048)
    _, q = store.queue_join(c, 30, name="run.c", priority=70, memory_mib=4096)
    assert [x.name for x in q] == ["run.c", "run.a", "run.b"]
    # A renewal keeps the entry's place and arrival, and moves its expiry.
    again, q = store.queue_join(a, 60, name="run.a", priority=50, memory_mib=1024)
    assert (again.seq, again.since) == (me.seq, me.since)
    assert again.holder.expires > me.holder.expires
    assert [x.name for x in q] == ["run.c", "run.a", "run.b"]
    assert [x.name for x in store.waiters()] == ["run.c", "run.a", "run.b"]
    assert store.queue_leave(c.id) is True
    assert store.queue_leave(c.id) is False  # idempotent
    assert [x.name for x in store.waiters()] == ["run.a", "run.b"]
    # A newcomer gets an arrival after everyone there.
    d, q = store.queue_join(c, 30, name="run.d", priority=50, memory_mib=1)
    assert d.seq > max(x.seq for x in q if x.id != c.id)
    assert [x.name for x in q] == ["run.a", "run.b", "run.d"]


def test_bad_ids_are_refused(store: DirectStore | AgentStore) -> None:
    with pytest.raises(UsageError):
        store.queue_leave("../../records/x")


def test_a_waiter_killed_with_kill_9_leaves_nothing_behind(
    store: DirectStore | AgentStore, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    script = textwrap.dedent(
        f"""
        import os, signal
        from gpuctl.adapters.store import holder_here
        from gpuctl.adapters.store.direct import DirectStore
        s = DirectStore({str(state)!r})
        s.queue_join(holder_here("run"), 300, name="run.dead", priority=99, memory_mib=1)
        print("in", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "in" and r.returncode == -9
    assert len(list((state / "queue").glob("*.json"))) == 1  # it is there, void
    live = holder_here("run")
    store.queue_join(live, 30, name="run.live", priority=1, memory_mib=1)
    assert [x.name for x in store.waiters()] == ["run.live"]
    assert [p.stem for p in (state / "queue").glob("*.json")] == [live.id]  # deleted


def test_a_lapsed_entry_is_skipped_and_a_remote_one_is_honoured_until_then(
    tmp_path: Path,
) -> None:
    now = [1_700_000_000.0]
    store = DirectStore(tmp_path / "state", clock=lambda: now[0])
    remote = holder_here("run")
    from msgspec.structs import replace

    remote = replace(remote, host="elsewhere", pid=4_000_000)  # nobody here can tell it died
    store.queue_join(remote, 10, name="run.remote", priority=50, memory_mib=1)
    assert [x.name for x in store.waiters()] == ["run.remote"]
    now[0] += 11
    assert store.waiters() == []
    assert list((tmp_path / "state" / "queue").glob("*.json")) == []


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[]", b'{"name": "run.x"}', b"{" * 5000],
    ids=["garbage", "array", "partial", "deep"],
)
def test_a_hostile_entry_counts_for_nothing(tmp_path: Path, content: bytes) -> None:
    store = DirectStore(tmp_path / "state")
    h = holder_here("run")
    store.queue_join(h, 30, name="run.ok", priority=1, memory_mib=1)
    bad = tmp_path / "state" / "queue" / "abc123.json"
    bad.write_bytes(content)
    assert [x.name for x in store.waiters()] == ["run.ok"]
    # Set aside once, beside it, for a person to look at; never read again.
    kept = [p.name for p in bad.parent.iterdir() if p.name.startswith("abc123.json.corrupt-")]
    assert len(kept) == 1 and not bad.exists()
    assert (bad.parent / kept[0]).read_bytes() == content
    assert [x.name for x in store.waiters()] == ["run.ok"]
    assert [a.file for a in store.set_aside()] == [f"queue/{kept[0]}"]


def test_an_entry_filed_under_another_holders_name_counts_for_nothing(tmp_path: Path) -> None:
    store = DirectStore(tmp_path / "state")
    h = holder_here("run")
    me, _ = store.queue_join(h, 30, name="run.ok", priority=1, memory_mib=1)
    (tmp_path / "state" / "queue" / "other1.json").write_text(json.dumps(me.to_dict()))
    assert [x.id for x in store.waiters()] == [h.id]


BAD_JOINS = [
    ({"ttl_s": 30, "name": "run.x", "priority": 1, "memory_mib": 1}, "holder"),
    ({"ttl_s": 301, "name": "run.x", "priority": 1, "memory_mib": 1}, "ttl_s"),
    ({"ttl_s": 30, "name": "../x", "priority": 1, "memory_mib": 1}, "name"),
    ({"ttl_s": 30, "name": "run.x", "priority": 2_000_000, "memory_mib": 1}, "priority"),
    ({"ttl_s": 30, "name": "run.x", "priority": 1, "memory_mib": 0}, "memory_mib"),
    ({"ttl_s": 30, "name": "run.x", "priority": True, "memory_mib": 1}, "priority"),
    ({"ttl_s": 30, "name": "run.x", "priority": 1, "memory_mib": 1, "x": 1}, "x"),
]


@pytest.mark.parametrize(("body", "field"), BAD_JOINS)
def test_the_agent_refuses_a_bad_join_naming_the_field(
    tmp_path: Path, body: dict[str, object], field: str
) -> None:
    app = create_app(AgentSettings(token=TOKEN, state_dir=str(tmp_path / "state")), FakeProbe())
    h = holder_here("run").to_dict()
    if field != "holder":
        body = {"holder": h, **body}
    with serve_in_thread(app) as url:
        r = httpx.post(
            f"{url}/records/_queue", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]
        bad_id = httpx.post(
            f"{url}/records/_queue/leave",
            json={"holder": "a/b"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert bad_id.status_code == 400 and "holder" in bad_id.json()["error"]
        assert (
            httpx.delete(
                f"{url}/records/_queue", headers={"Authorization": f"Bearer {TOKEN}"}
            ).status_code
            == 405
        )
        assert httpx.get(f"{url}/records/_queue").status_code == 401
    assert not (tmp_path / "state" / "queue").exists() or not list(
        (tmp_path / "state" / "queue").glob("*.json")
    )


@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_queue_folder_that_is_a_link_or_a_file_is_a_clear_error(
    tmp_path: Path, kind: str
) -> None:
    """Nothing is written, read or deleted through it: a store error naming the folder."""
    from gpuctl.errors import StoreError

    state = tmp_path / "state"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "abc.json").write_text("{}")
    store = DirectStore(state)
    store.records()  # the state folder, as any first use makes it
    state.mkdir(exist_ok=True)
    if kind == "link":
        (state / "queue").symlink_to(elsewhere)
    else:
        (state / "queue").write_text("")
    join = lambda: store.queue_join(  # noqa: E731
        holder_here("run"), 30, name="run.x", priority=1, memory_mib=1
    )
    if kind == "link":
        # Never followed: set aside beside it (kept, and listed), and a real folder made.
        join()
        assert [x.name for x in store.waiters()] == ["run.x"]
        assert not (state / "queue").is_symlink()
        assert [a.service for a in store.set_aside()] == ["_state"]
        assert [p.name for p in state.glob("queue.link-*")] != []
    else:
        for call in (join, store.waiters):
            with pytest.raises(StoreError) as e:
                call()
            assert "queue" in e.value.message and "not a link" in e.value.hint
    assert sorted(p.name for p in elsewhere.iterdir()) == ["abc.json"]


# ----------------------------------------------------------- forged entries (attacker review)


def forged(
    holder_id: str,
    *,
    granted: float,
    expires: float,
    priority: int = 1_000_000,
    memory_mib: int = 1 << 30,
    pid: int = 1,
) -> dict[str, object]:
    """An entry as an attacker writes it: held by ``pid`` (1 unless told) of this host and
    boot, at its real start time, far beyond any GPU unless told otherwise."""
    from gpuctl.adapters import procinfo

    here = procinfo.host_identity()
    lease = Lease(
        holder_id,
        here.hostname,
        here.boot_id,
        pid,
        procinfo.start_time(pid),
        "run",
        granted,
        expires,
    )
    return Waiter("run.forged", priority, memory_mib, 1, granted, lease).to_dict()


def test_overlived_entries_lapse_whatever_their_expiry() -> None:
    now = 1_700_000_000.0
    from msgspec.structs import replace

    base = w("a", 50, 1)

    def at(granted: float, expires: float) -> Waiter:
        return replace(base, holder=replace(base.holder, granted=granted, expires=expires))

    assert not overlived(at(now, now + 15), now)  # what a waiter writes
    assert not overlived(at(now, now + QUEUE_TTL_MAX_S), now)  # the longest it may ask
    assert overlived(at(1.0, 4_000_000_000.0), now)  # the attacker's
    assert overlived(at(now, now + QUEUE_TTL_MAX_S + 5), now)  # a term over the cap
    # A term within the cap but granted in the future: it would outlive the cap from now.
    assert overlived(at(now + 3600, now + 3600 + 10), now)


def test_a_head_that_can_never_fit_is_skipped_not_waited_on() -> None:
    huge = w("huge", 1_000_000, 1, memory_gib=1 << 20)
    small = w("small", 50, 2)
    # Unknown size: nobody can say it never fits, so it is waited on.
    assert [x.name for x in ahead([huge, small], priority=10)] == ["run.huge", "run.small"]
    got = ahead([huge, small], priority=10, largest_mib=120 * 1024)
    assert [x.name for x in got] == ["run.small"]
    assert ahead([huge, small], priority=10, me=small.id, largest_mib=120 * 1024) == []
    # Exactly the largest device: it can fit, it is waited on.
    fits = w("fits", 90, 3, memory_gib=120)
    got = ahead([fits], priority=10, largest_mib=120 * 1024)
    assert [x.name for x in got] == ["run.fits"]


def test_the_forged_stuck_queue_entry_lapses(
    store: DirectStore | AgentStore, tmp_path: Path
) -> None:
    """The attacker's file (priority 1,000,000, larger than any GPU, pid 1 of this host
    and boot, granted 1.0, expiring in 2096) is lapsed and deleted by the first reader,
    directly and through the agent; a term within the cap but granted an hour ahead too."""
    import time

    base = tmp_path / "state" / "queue"
    me = holder_here("run")
    store.queue_join(me, 30, name="run.mine", priority=1, memory_mib=1)
    (base / "forged1.json").write_text(
        json.dumps(forged("forged1", granted=1.0, expires=4_000_000_000.0))
    )
    now = time.time()
    (base / "forged2.json").write_text(
        json.dumps(forged("forged2", granted=now + 3600, expires=now + 3610))
    )
    assert [x.name for x in store.waiters()] == ["run.mine"]
    assert sorted(p.stem for p in base.glob("*.json")) == [me.id]  # both deleted
    # One within the cap, but held by pid 1 of this host: pid 1 is never a holder (it
    # would be alive for ever), so it counts for nothing either.
    (base / "forged3.json").write_text(
        json.dumps(forged("forged3", granted=now, expires=now + 250))
    )
    assert [x.name for x in store.waiters()] == ["run.mine"]


def test_a_forged_priority_beyond_the_services_range_counts_for_nothing(
    store: DirectStore | AgentStore, tmp_path: Path
) -> None:
    import time

    from gpuctl.config.parse import MAX_PRIORITY

    assert PRIORITY_MAX == MAX_PRIORITY  # one range: the config's for services
    base = tmp_path / "state" / "queue"
    base.mkdir(parents=True)
    now = time.time()
    entry = forged("forged4", granted=now, expires=now + 30, priority=PRIORITY_MAX + 1)
    (base / "forged4.json").write_text(json.dumps(entry))
    assert store.waiters() == []
    with pytest.raises(UsageError):
        store.queue_join(
            holder_here("run"), 30, name="run.x", priority=PRIORITY_MAX + 1, memory_mib=1
        )


# (the head's priority and memory GiB, the service's priority, its need and the free GiB
# on its GPU (None: unknown), whether it is held back)
HELD = [
    (90, 30, 10, 100, 120, True),  # the inversion: 20 left, the head needs 30
    (90, 30, 10, 50, 80, False),  # 30 left: both fit, it goes
    (90, 30, 90, 100, 120, False),  # equal priority: services are not queued, it goes
    (90, 30, 95, 100, 120, False),  # higher: it goes
    (90, 30, 10, None, 120, True),  # unknown need: under doubt it takes the room
    (90, 30, 10, 10, None, True),  # unknown free: the same
    (90, 1 << 20, 10, 100, 120, False),  # a head that can never fit is skipped
]


@pytest.mark.parametrize(("hp", "hgib", "prio", "need", "free", "held"), HELD)
def test_a_service_is_held_back_only_by_a_higher_head_whose_room_it_takes(
    hp: int, hgib: int, prio: int, need: int | None, free: int | None, held: bool
) -> None:
    head = w("head", hp, 1, memory_gib=hgib)
    got = held_back(
        [head, w("other", 5, 2)],
        priority=prio,
        need_mib=need * 1024 if need is not None else None,
        free_mib=free * 1024 if free is not None else None,
        largest_mib=120 * 1024,
    )
    assert got == (head if held else None)
    assert held_back([], priority=0, need_mib=None, free_mib=None, largest_mib=None) is None
