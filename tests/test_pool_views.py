"""A pooled service in ``locks``, ``reclaim``, ``events``, ``usage`` and ``touch``: every
host of its pool is asked, its rows go together in its pool's order with ``pool`` in the
JSON, ``--host`` keeps to one host, and ``touch`` without ``--host`` marks the copy where
it runs. Three simulated hosts on loopback, each with its own agent (``sim_pool``).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import config_env, gpuctl_exe, gpuctl_in_process
from tests.test_pool import ensure, hold, pool, service, write_config

__all__ = ["pool", "service"]  # the fixtures, used by name

# The config lists its hosts a, b, c; the pool lists them c, a, b: rows follow the pool.
POOL = ["c", "a", "b"]


def gpuctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [gpuctl_exe(), *args],
        env={**config_env(config), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def as_json(config: Path, *args: str) -> tuple[int, Any]:
    p = gpuctl(config, *args, "--json")
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON: {p.stdout!r} {p.stderr!r}") from None


def services(rows: list[dict[str, Any]], key: str = "service") -> list[str]:
    return [r[key] for r in rows]


def test_views_group_a_pool_and_touch_finds_its_copy(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    config = write_config(
        tmp_path / "c.toml",
        pool,
        ["a", "b", "c"],
        service,
        free_port(),
        order=[2, 0, 1],
        more=[
            'idle_timeout = "1s"',
            "",
            "[services.solo]",  # on a alone, listed after the pool on a
            'host = "a"',
            'match = ["solo-keyword"]',
            'memory = "1GiB"',
        ],
    )
    hold(pool[0], "holdera", "60GiB")  # a is the tightest fit: the copy runs there
    code, out = ensure(config, service)
    assert (code, out["host"], out["pool"]) == (0, "a", POOL), out

    # locks: one row per host, together, in the pool's order; `pool` set, null for solo.
    code, locks = as_json(config, "locks")
    rows = [(r["host"], r["service"], r["phase"], r["pool"]) for r in locks["records"]]
    assert code == 0 and rows == [
        ("c", service, "stopped", POOL),
        ("a", service, "running", POOL),
        ("b", service, "stopped", POOL),
        ("a", "solo", "stopped", None),
    ], rows
    code, one = as_json(config, "locks", "--host", "b")
    assert [(r["host"], r["service"]) for r in one["records"]] == [("b", service)], one
    text = gpuctl_in_process(config, "locks", env={"COLUMNS": "200"}).stdout
    hosts = [line.split()[0] for line in text.splitlines() if service in line]
    assert hosts == POOL, text

    # touch without --host: marked on a, where the copy runs, not on c (its first host).
    p = gpuctl_in_process(config, "touch", service, env={"COLUMNS": "200"})
    assert (p.returncode, p.stderr.strip()) == (0, f"{service}: marked as used on a"), p.stderr
    records = as_json(config, "locks")[1]["records"]
    used = {r["host"]: r["last_used"] for r in records if r["service"] == service}
    assert used["c"] is None and used["b"] is None and used["a"] is not None, used

    # reclaim: each host's copy judged, together in the pool's order; says which host.
    deadline = time.monotonic() + 30
    while True:
        code, plan = as_json(config, "reclaim", "--dry-run")
        mine = [c for c in plan["candidates"] if c["service"] == service]
        if any(c["action"] == "stop" for c in mine) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(c["host"], c["action"], c["pool"]) for c in mine] == [
        ("c", "keep", POOL),
        ("a", "stop", POOL),
        ("b", "keep", POOL),
    ], plan
    assert next(c for c in plan["candidates"] if c["service"] == "solo")["pool"] is None
    assert services(plan["candidates"]) == [service] * 3 + ["solo"], plan
    p = gpuctl_in_process(config, "reclaim", "--dry-run", env={"COLUMNS": "200"})
    assert p.stdout.startswith(f"would stop {service} on a: idle "), p.stdout
    code, only_b = as_json(config, "reclaim", "--dry-run", "--host", "b")
    assert [c["host"] for c in only_b["candidates"]] == ["b"], only_b
    p = gpuctl_in_process(config, "reclaim", env={"COLUMNS": "200"})
    assert p.returncode == 0 and p.stdout.startswith(f"stopped {service} on a: idle"), p.stdout

    # touch of a copy that runs nowhere: said, exit 1, with the fix.
    p = gpuctl_in_process(config, "touch", service, env={"COLUMNS": "200"})
    assert p.returncode == 1, p.stderr
    assert f"{service} runs on no host of its pool (c, a, b)" in p.stderr, p.stderr
    assert f"hint: `gpuctl ensure {service}` starts it" in p.stderr, p.stderr

    # events: the journal of every host, each event of the pool with its host and pool.
    code, events = as_json(config, "events", "--service", service)
    kinds = [(e["host"], e["kind"], e["pool"]) for e in events["events"]]
    assert code == 0 and ("a", "ready", POOL) in kinds and ("a", "stop", POOL) in kinds, kinds
    assert {h for h, _, _ in kinds} == {"a"}, kinds
    code, on_b = as_json(config, "events", "--host", "b", "--service", service)
    assert (code, on_b["events"]) == (0, []), on_b

    # usage: one row for the pool, summing its hosts, with its pool.
    code, usage = as_json(config, "usage")
    row = next(r for r in usage["rows"] if r["key"] == service)
    assert (code, row["cold_starts"], row["pool"]) == (0, 1, POOL), usage
    code, by_user = as_json(config, "usage", "--by", "user")
    assert all(r["pool"] is None for r in by_user["rows"]), by_user

    # touch with a host of the pool that cannot be asked: UNKNOWN, the line naming it.
    pool[1].close()
    p = gpuctl_in_process(config, "touch", service, env={"COLUMNS": "200"})
    assert p.returncode == 4, p.stderr
    assert f"{service}: host b could not be asked, and it may run there" in p.stderr, p.stderr
    assert "hint: " in p.stderr, p.stderr
    # events and usage say it as locks does: the host, the error, the fix; exit 4.
    for args in (("events",), ("usage",), ("locks",)):
        p = gpuctl(config, *args)
        assert p.returncode == 4, (args, p.stderr)
        assert "gpuctl: error: b: connection refused" in p.stderr, (args, p.stderr)
        assert "  hint: is `gpuctl agent` running" in p.stderr, (args, p.stderr)


def test_locks_shows_a_pools_start_lock_while_it_is_held(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    from gpuctl.adapters.machine import ThisMachine
    from gpuctl.adapters.store import store_for
    from gpuctl.config import load_config
    from gpuctl.core.pool import pool_record

    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, free_port())
    code, locks = as_json(config, "locks")
    assert [r["service"] for r in locks["records"]] == [service] * 3, locks  # none held
    store = store_for(load_config(config).host("b"))
    try:
        granted, _ = store.acquire(pool_record(service), ThisMachine().holder("ensure"), 60)
        assert granted
        code, locks = as_json(config, "locks")
        assert code == 0, locks
        rows = [(r["host"], r["service"], r["pool"]) for r in locks["records"]]
        assert rows == [
            ("a", service, ["a", "b", "c"]),
            ("b", service, ["a", "b", "c"]),
            ("b", f"_pool.{service}", ["a", "b", "c"]),
            ("c", service, ["a", "b", "c"]),
        ], rows
        assert locks["records"][2]["lease"]["entry"] == "ensure", locks
        text = gpuctl_in_process(config, "locks", env={"COLUMNS": "200"}).stdout
        assert f"{service} (pool's start lock)" in text, text
    finally:
        store.close()


def test_config_check_asks_for_no_one_state_dir_for_agents_of_their_own(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    """Three agents on this machine, each with its state dir: no GPUCTL_STATE_DIR could
    match them all, so config check does not ask for one. One such agent: it does."""
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, free_port())
    p = gpuctl_in_process(config, "config", "check", env={"COLUMNS": "200"})
    assert p.returncode == 0 and "ok (3 hosts, 1 service)" in p.stdout, p
    assert "GPUCTL_STATE_DIR" not in p.stderr, p.stderr
    one = write_config(tmp_path / "one.toml", pool[:1], ["a"], service, free_port())
    p = gpuctl_in_process(one, "config", "check", env={"COLUMNS": "200"})
    assert p.returncode == 0, p
    assert f"set GPUCTL_STATE_DIR={pool[0].state_dir}" in p.stderr, p.stderr
