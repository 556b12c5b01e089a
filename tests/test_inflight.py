"""In-flight counts in the store and ``gpuctl.api.in_use``: real files, real processes,
and a real agent for the path through it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from gpuctl import api
from gpuctl.adapters.store import AgentStore, holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import UsageError
from gpuctl.sim.host import SimHost


@pytest.fixture
def store(tmp_path: Path) -> DirectStore:
    return DirectStore(tmp_path / "state")


def test_begin_counts_and_end_uncounts_and_both_mark_it_used(store: DirectStore) -> None:
    h = holder_here("in_use")
    assert store.inflight() == {}
    granted, rec = store.inflight_begin("llm", h, 30)
    assert granted and rec.last_used is not None
    assert store.inflight() == {"llm": 1}
    other = holder_here("proxy")
    store.inflight_begin("llm", other, 30)
    assert store.inflight() == {"llm": 2}
    before = store.get("llm").last_used
    time.sleep(0.01)
    store.inflight_end("llm", h.id)
    assert store.inflight() == {"llm": 1}
    last = store.get("llm").last_used
    assert last is not None and before is not None and last > before  # the idle clock restarts
    store.inflight_end("llm", other.id)
    store.inflight_end("llm", other.id)  # idempotent
    assert store.inflight() == {}


def test_a_holder_killed_with_kill_9_leaves_nothing_behind(store: DirectStore) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal
        from gpuctl.adapters.store import holder_here
        from gpuctl.adapters.store.direct import DirectStore
        s = DirectStore({str(store.state_dir)!r})
        s.inflight_begin("llm", holder_here("in_use"), 30)
        print("in", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert r.stdout == "in\n" and r.returncode == -9
    assert len(list((store.state_dir / "inflight" / "llm").glob("*.json"))) == 1
    assert store.inflight() == {}
    # ... and the reader cleared the dead holder's entry away.
    assert list((store.state_dir / "inflight" / "llm").glob("*.json")) == []


def test_an_entry_from_another_host_counts_until_it_expires(store: DirectStore) -> None:
    clock = [1000.0]
    s = DirectStore(store.state_dir, clock=lambda: clock[0])
    far = replace(holder_here("proxy"), host="laptop", boot_id="elsewhere", pid=1)
    s.inflight_begin("llm", far, 30)
    assert s.inflight() == {"llm": 1}  # its pid means nothing here: the expiry decides
    clock[0] += 31
    assert s.inflight() == {}


@pytest.mark.parametrize("entry", ["reclaim", "stop", "preempt"])
def test_a_stop_under_way_refuses_new_uses_and_touches(store: DirectStore, entry: str) -> None:
    """A preemptor's lease on its victim counts as a stop: the hour of trials caught a
    request begun under it, after the preemptor's in-flight check, cut by its stop."""
    stopper = holder_here(entry)
    assert store.acquire("llm", stopper, 60)[0]
    granted, rec = store.inflight_begin("llm", holder_here("in_use"), 30)
    assert not granted and rec.lease is not None and rec.lease.entry == entry
    assert store.inflight() == {}
    before = store.get("llm").last_used
    touched = store.touch("llm")
    assert touched.last_used == before  # the touch lost to the stop: it changed nothing
    store.release("llm", stopper.id, RecordUpdate.from_wire({"phase": "stopped"}))
    assert store.inflight_begin("llm", holder_here("in_use"), 30)[0]
    # A start's lease (ensure) does not refuse a use: the app waits for it to be ready.
    starter = holder_here("ensure")
    assert store.acquire("other", starter, 60)[0]
    assert store.inflight_begin("other", holder_here("in_use"), 30)[0]


def test_a_lingering_entry_counts_for_nothing_but_its_holder_may_count_again_under_a_stop(
    store: DirectStore,
) -> None:
    """An end with ``linger_s`` leaves the entry lingering: no request in flight, said
    by ``lingering`` until it lapses. Under a stop's lease only its holder may count
    itself again (what it sent on the entry's strength); anyone else waits."""
    clock = [1000.0]
    s = DirectStore(store.state_dir, clock=lambda: clock[0])
    h = holder_here("in_use")
    assert s.inflight_begin("llm", h, 30)[0]
    s.inflight_end("llm", h.id, 12.0)
    assert s.inflight() == {} and s.lingering() == {"llm": 12.0}
    clock[0] += 5
    assert s.lingering() == {"llm": 7.0}

    stopper = holder_here("preempt")
    assert s.acquire("llm", stopper, 60)[0]
    assert s.inflight_begin("llm", holder_here("in_use"), 30)[0] is False
    # Under the stop a lingering entry keeps its term: asked to start it again, the
    # store leaves it as it stands (the answer is the stop's record).
    rec = s.inflight_end("llm", h.id, 12.0)
    assert rec.lease is not None and rec.lease.entry == "preempt"
    assert s.lingering() == {"llm": 7.0}
    granted, rec = s.inflight_begin("llm", h, 30)  # the lingering holder: counted again
    assert granted and rec.lease is not None and rec.lease.entry == "preempt"
    assert s.inflight() == {"llm": 1} and s.lingering() == {}
    # Its request ends under the stop: the entry ends, it never lingers again there (a
    # stop that read no lingering entry and then no count must not find one after).
    rec = s.inflight_end("llm", h.id, 12.0)
    assert rec.lease is not None and rec.lease.entry == "preempt"
    assert s.inflight() == {} and s.lingering() == {}
    assert s.inflight_begin("llm", h, 30)[0] is False  # it waits for the stop now
    s.release("llm", stopper.id)
    assert s.inflight_begin("llm", h, 30)[0]
    s.inflight_end("llm", h.id, 12.0)
    assert s.inflight() == {} and s.lingering() == {"llm": 12.0}

    assert s.acquire("llm", stopper, 60)[0]
    clock[0] += 13  # lapsed: its holder waits for the stop like anyone else
    assert s.lingering() == {}
    assert s.inflight_begin("llm", h, 30)[0] is False
    s.release("llm", stopper.id)
    assert s.inflight_begin("llm", h, 30)[0]
    s.inflight_end("llm", h.id)  # no linger: gone at once
    assert s.inflight() == {} and s.lingering() == {}
    s.inflight_end("llm", h.id, 12.0)  # nothing to linger: nothing written
    assert s.lingering() == {}
    with pytest.raises(UsageError, match="at most 30s"):
        s.inflight_end("llm", h.id, 31.0)


@pytest.mark.parametrize(
    "content",
    [b"", b"[", b"[1]", b"{}", b'{"holder": "x", "expires": "soon"}',
     b'{"holder": "x", "pid": 4294967296, "expires": 1e300}', b"x" * 10000],
)  # fmt: skip
def test_hostile_entry_files_count_for_nothing(store: DirectStore, content: bytes) -> None:
    d = store.state_dir / "inflight" / "llm"
    d.mkdir(parents=True)
    (d / "abc.json").write_bytes(content)
    assert store.inflight() == {}


def test_bad_holder_ids_are_refused(store: DirectStore) -> None:
    for bad in ("../../records/llm", "", "a" * 65, "ünïcode"):
        with pytest.raises(UsageError, match="holder id"):
            store.inflight_end("llm", bad)


# ---------------------------------------------------------------------------- via the agent


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SimHost]:
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def test_the_same_through_the_agent(host: SimHost) -> None:
    s = AgentStore(host.agent_url, host.token, host_name="sim")
    try:
        h = holder_here("proxy")
        granted, rec = s.inflight_begin("llm", h, 30)
        assert granted and rec.last_used is not None
        assert s.inflight() == {"llm": 1}
        s.inflight_renew("llm", h, 30)
        assert DirectStore(host.state_dir).inflight() == {"llm": 1}  # the same files
        s.inflight_end("llm", h.id)
        assert s.inflight() == {}
        stopper = holder_here("stop")
        assert s.acquire("llm", stopper, 60)[0]
        assert s.inflight_begin("llm", h, 30)[0] is False
        s.release("llm", stopper.id)

        # A lingering entry, through the wire: told apart, and bounded.
        assert s.inflight_begin("llm", h, 30)[0]
        s.inflight_end("llm", h.id, 12.0)
        assert s.inflight() == {}
        assert 11 < s.lingering()["llm"] <= 12.0
        with pytest.raises(UsageError):
            s.inflight_end("llm", h.id, 31.0)
    finally:
        s.close()


def test_an_entry_within_the_terms_slack_does_not_break_the_agents_answer(
    host: SimHost,
) -> None:
    """A lingering entry whose term is a little over 30 s (the clock stepped back, or a
    file written so: within the slack a term is not forged) lingers, and the agent's
    list says at most 30 s of it: the client refuses an answer past that bound, which
    made every preemption and reclaim on the host fail for as long as it stood."""
    h = holder_here("in_use")
    now = time.time()
    entry = replace(h.lease(now, 30.5), entry="linger")
    d = host.state_dir / "inflight" / "llm"
    d.mkdir(parents=True)
    (d / f"{h.id}.json").write_text(json.dumps(entry.to_dict()))
    s = AgentStore(host.agent_url, host.token, host_name="sim")
    try:
        assert 29 < s.lingering()["llm"] <= 30.0
        assert s.inflight() == {}
    finally:
        s.close()


# ---------------------------------------------------------------------------- in_use


@pytest.fixture
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    path = tmp_path / "config.toml"
    path.write_text(
        '[hosts.box]\nprobe = "sim"\n\n[services.llm]\nhost = "box"\n'
        'health = "http://127.0.0.1:9/health"\n'
    )
    api._reset_for_tests()
    yield path
    api._reset_for_tests()


def counts(tmp_path: Path) -> dict[str, int]:
    return DirectStore(tmp_path / "state").inflight()


def test_in_use_counts_while_the_block_runs(conf: Path, tmp_path: Path) -> None:
    assert counts(tmp_path) == {}
    with api.in_use("llm", config=conf):
        assert counts(tmp_path) == {"llm": 1}
        with api.in_use("llm", config=conf):  # nested: no second entry, no write
            assert counts(tmp_path) == {"llm": 1}
        assert counts(tmp_path) == {"llm": 1}
    assert counts(tmp_path) == {}
    # An exception in the block still ends the use.
    with pytest.raises(RuntimeError), api.in_use("llm", config=conf):
        raise RuntimeError("boom")
    assert counts(tmp_path) == {}


def test_in_use_async_and_from_many_threads(conf: Path, tmp_path: Path) -> None:
    seen: list[dict[str, int]] = []

    async def request(i: int) -> None:
        async with api.in_use("llm", config=conf):
            await asyncio.sleep(0.05)
            seen.append(counts(tmp_path))

    async def main() -> None:
        await asyncio.gather(*(request(i) for i in range(20)))

    asyncio.run(main())
    assert seen == [{"llm": 1}] * 20  # one entry for the process, however many requests
    assert counts(tmp_path) == {}

    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(50):
            with api.in_use("llm", config=conf):
                pass

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert counts(tmp_path) == {}


def test_in_use_waits_for_a_stop_under_way(conf: Path, tmp_path: Path) -> None:
    store = DirectStore(tmp_path / "state")
    stopper = holder_here("reclaim")
    assert store.acquire("llm", stopper, 60)[0]
    released = threading.Event()

    def finish_stop() -> None:
        time.sleep(0.5)
        store.release("llm", stopper.id, RecordUpdate.from_wire({"phase": "stopped"}))
        released.set()

    threading.Thread(target=finish_stop).start()
    with api.in_use("llm", config=conf):
        assert released.is_set(), "the use began before the stop ended"
        assert counts(tmp_path) == {"llm": 1}


def test_in_use_unknown_service_is_a_usage_error(conf: Path) -> None:
    from gpuctl.errors import UsageError

    with pytest.raises(UsageError):
        api.in_use("nope", config=conf)


def test_in_use_without_a_store_runs_uncounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state-file"
    state.write_text("not a directory")
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(state))
    path = tmp_path / "c.toml"
    path.write_text('[hosts.box]\nprobe = "sim"\n\n[services.llm]\nhost = "box"\n')
    api._reset_for_tests()
    with api.in_use("llm", config=path):
        pass
    assert "not counted as in use" in caplog.text
    assert os.path.isfile(state)
