"""Benchmark ``gpuctl reclaim``, side by side in one run (interleaved):

1. ``gpuctl reclaim`` with nothing to do against ``gpuctl status --json`` of the same host
   (a sim agent on loopback, the same config): target at most 1.2x;
2. ``gpuctl reclaim`` over 100 configured services on one host (each with a running
   record, used recently: judged, nothing to do) against the same over one: target at
   most 2x (one snapshot, one record list, not one per service);
3. ``gpuctl.api.in_use()`` around a request when this process's count is already
   positive: the median per call, target at most 0.05 ms.

    python bench/reclaim_bench.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpuctl.sim.host import SimHost


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    if cmd[1] == "reclaim" and r.stdout:
        sys.exit(f"reclaim had something to do: {r.stdout.decode()[:300]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def services(n: int) -> str:
    return "".join(
        f'[services.svc{i}]\nhost = "sim"\nlauncher = "process"\ncommand = "sleep 1"\n'
        f'health = "http://127.0.0.1:9/health"\nmatch = ["svc{i}-server"]\n'
        f'memory = "1GiB"\nidle_timeout = "30m"\n\n'
        for i in range(n)
    )


def running_records(state_dir: Path, n: int) -> None:
    """A running record per service, used a minute ago: reclaim judges each, keeps all."""
    from gpuctl.adapters.store import holder_here
    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.core.record_shapes import RecordUpdate

    store = DirectStore(state_dir)
    for i in range(n):
        h = holder_here("ensure")
        store.acquire(f"svc{i}", h, 60)
        store.release(
            f"svc{i}",
            h.id,
            RecordUpdate.from_wire(
                {"phase": "running", "touch": True, "handle": {"kind": "process", "pid": 1}}
            ),
        )


def medians(xs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs)


def interleave(
    runs: int, a: tuple[list[str], dict[str, str]], b: tuple[list[str], dict[str, str]]
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    for _ in range(3):  # warm the page cache and the agent
        timed(*a)
        timed(*b)
    ra, rb = [], []
    for _ in range(runs):
        ra.append(timed(*a))
        rb.append(timed(*b))
    return ra, rb


def bench_in_use(config: Path, n: int = 20000) -> float:
    """Median seconds of one ``with in_use(...)`` while an outer one is open."""
    from gpuctl.api import in_use

    samples = []
    with in_use("svc0", config=config):
        for _ in range(n):
            t0 = time.perf_counter_ns()
            with in_use("svc0", config=config):
                pass
            samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpuctl"))
    with SimHost() as host:
        host.start_agent()
        env = {**os.environ, "GPUCTL_BENCH_TOKEN": host.token}
        head = f'[hosts.sim]\nagent = "{host.agent_url}"\ntoken_env = "GPUCTL_BENCH_TOKEN"\n\n'
        one = host.base / "one.toml"
        one.write_text(head + services(1))
        many = host.base / "many.toml"
        many.write_text(head + services(100))
        running_records(host.state_dir, 100)
        env_one = {**env, "GPUCTL_CONFIG": str(one)}
        env_many = {**env, "GPUCTL_CONFIG": str(many)}

        rec, st = interleave(
            args.runs, ([exe, "reclaim"], env_one), ([exe, "status", "--json"], env_one)
        )
        (rw, rc), (sw, sc) = medians(rec), medians(st)
        print(
            f"reclaim (nothing to do)   wall {rw * 1000:7.1f} ms  cpu {rc * 1000:7.1f} ms  (n={len(rec)})"
        )
        print(
            f"status --json             wall {sw * 1000:7.1f} ms  cpu {sc * 1000:7.1f} ms  (n={len(st)})"
        )
        print(f"ratio wall {rw / sw:.2f}x  cpu {rc / sc:.2f}x  (target <= 1.2x)\n")

        r100, r1 = interleave(args.runs, ([exe, "reclaim"], env_many), ([exe, "reclaim"], env_one))
        (aw, ac), (bw, bc) = medians(r100), medians(r1)
        print(
            f"reclaim, 100 services     wall {aw * 1000:7.1f} ms  cpu {ac * 1000:7.1f} ms  (n={len(r100)})"
        )
        print(
            f"reclaim, 1 service        wall {bw * 1000:7.1f} ms  cpu {bc * 1000:7.1f} ms  (n={len(r1)})"
        )
        print(f"ratio wall {aw / bw:.2f}x  cpu {ac / bc:.2f}x  (target <= 2x)\n")

        os.environ["GPUCTL_BENCH_TOKEN"] = host.token
        per_call = bench_in_use(one)
        print(f"in_use() with the count already positive: median {per_call * 1e3:.4f} ms "
              f"(n=20000, target <= 0.05 ms)")  # fmt: skip


if __name__ == "__main__":
    main()
