"""The journal's costs (``gpuctl.adapters.store.journal``), against issue 19's targets:

1. what writing an event adds to the state change it rides on: ``DirectStore.update``
   with and without ``event=``, median over N runs (target: at most 1 ms more);
2. a journal of 1,000,000 events over 90 days (about 11,000 in the last day), rolled
   up as the agent keeps it, then ``gpuctl events --since 1d`` and ``gpuctl usage
   --since 30d`` as a user runs them (new processes, the CLI's whole start-up), each
   under 1 s.

Usage::

    python bench/journal_bench.py [--events 1000000] [--runs 400] [--keep DIR]

A measurement, not a test: it exits 1 only when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.adapters.store.journal import Journal
from gpuctl.core.events import Cause, Event, Kind
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.usage import DAY_S

SERVICES = [f"svc{i}" for i in range(12)]
USERS = ["alice", "bob", "carol", "dave"]


def write_cost(state: Path, runs: int) -> tuple[float, float]:
    """(median ms of an update without an event, with one)."""
    store = DirectStore(state)
    holder = holder_here("bench")
    granted, _ = store.acquire("svc", holder, 600.0)
    assert granted
    plain: list[float] = []
    told: list[float] = []
    for i in range(runs):
        t = time.perf_counter()
        store.update("svc", holder.id, RecordUpdate(touch=True))
        plain.append(time.perf_counter() - t)
        e = Event(time.time(), Kind.READY, "svc", who={"entry": "bench", "user": "u"},
                  figures={"cold_start_s": float(i)})  # fmt: skip
        t = time.perf_counter()
        store.update("svc", holder.id, RecordUpdate(touch=True), event=e)
        told.append(time.perf_counter() - t)
    store.release("svc", holder.id)
    return statistics.median(plain) * 1000, statistics.median(told) * 1000


def journal_write_cost(state: Path, runs: int) -> float:
    """Median ms of one ``Journal.write`` of one event (the part an event adds)."""
    state.mkdir(parents=True, exist_ok=True)
    j = Journal(state)
    took = []
    for i in range(runs):
        e = Event(time.time(), Kind.READY, "svc", who={"entry": "bench"}, figures={"n": i})
        t = time.perf_counter()
        assert j.write(e)
        took.append(time.perf_counter() - t)
    j.close()
    return statistics.median(took) * 1000


def fill(state: Path, total: int, now: float) -> None:
    """``total`` events over 90 days, 11,000 of them in the last day; launch and stop
    pairs with budgets, so usage has spans to add up."""
    rng = random.Random(19)
    last_day = min(11_000, total)
    older = total - last_day
    times = sorted(
        [now - DAY_S - rng.random() * 89 * DAY_S for _ in range(older)]
        + [now - rng.random() * DAY_S for _ in range(last_day)]
    )
    j = Journal(state, clock=lambda: now)
    batch: list[Event] = []
    loaded: set[str] = set()
    for t in times:
        svc = rng.choice(SERVICES)
        who = {"entry": rng.choice(["ensure", "proxy", "reclaim"]), "user": rng.choice(USERS)}
        if svc in loaded:
            e = Event(t, Kind.STOP, svc, cause=rng.choice(list(Cause)), who=who,
                      figures={"idle_s": 60.0})  # fmt: skip
            loaded.discard(svc)
        else:
            e = Event(t, Kind.LAUNCH, svc, who=who, figures={"budget_mib": 20480.0},
                      command="vllm serve model --api-key ***")  # fmt: skip
            loaded.add(svc)
        batch.append(e)
        if len(batch) == 5000:
            assert j.write(*batch)
            batch.clear()
    if batch:
        assert j.write(*batch)
    # As the agent keeps it: closed days rolled up (nothing is old enough to prune).
    j.maintain(days=91)
    j.close()


def cli(state: Path, *args: str) -> float:
    """Seconds for one ``gpuctl …`` run on a host without an agent (the files here)."""
    cfg = state.parent / "bench.toml"
    cfg.write_text('[hosts.local]\nprobe = "sim"\n')
    env = {**os.environ, "GPUCTL_STATE_DIR": str(state), "GPUCTL_CONFIG": str(cfg)}
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "gpuctl", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"gpuctl {' '.join(args)} failed: {r.stderr}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--keep", type=Path, help="Build the journal here (and keep it).")
    a = ap.parse_args()
    base = a.keep or Path(tempfile.mkdtemp(prefix="gpuctl-journal-bench-"))
    ok = True

    plain, told = write_cost(base / "write", a.runs)
    added = told - plain
    print(f"update: {plain:.3f} ms median; with an event: {told:.3f} ms (+{added:.3f} ms; "
          "target +1 ms)")  # fmt: skip
    alone = journal_write_cost(base / "alone", a.runs)
    print(f"one event written alone: {alone:.3f} ms median")
    ok &= added <= 1.0 and alone <= 1.0

    state = base / "big" / "state"
    state.mkdir(parents=True, exist_ok=True)
    now = time.time()
    if not (state / "journal.db").exists():
        t = time.perf_counter()
        fill(state, a.events, now)
        size = (state / "journal.db").stat().st_size / 2**20
        print(f"filled {a.events} events in {time.perf_counter() - t:.1f}s ({size:.0f} MiB)")
    for args in (
        ("events", "--since", "1d"),
        ("events", "--since", "1d", "--json"),
        ("usage", "--since", "30d"),
        ("usage", "--since", "30d", "--json"),
    ):
        runs = [cli(state, *args) for _ in range(3)]
        best = min(runs)
        print(f"gpuctl {' '.join(args)}: {best:.3f}s best of 3 "
              f"({', '.join(f'{r:.3f}' for r in runs)}; target < 1 s)")  # fmt: skip
        ok &= best < 1.0
    print(json.dumps({"ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
