"""Benchmarks for sharing by priority, side by side in one run on a local sim agent:

1. `gpuctl run --memory 15GiB -- true` (a job that fits) against `gpuctl status --json`
   of the same host, alternating; medians and their ratio (target: at most 1.2x).
2. Preemption: from starting `gpuctl ensure chat --preempt --no-wait` to the chat
   server's launch (the start its record notes), less the victim's own stop (as the
   ensure measured it); the median overhead (target: at most 0.5 s). Beside it, in the
   same run: a plain `gpuctl ensure chat --no-wait` with room (no victim) to its launch,
   which is what any start costs (the CLI's own start and look included), so the
   difference is what preempting adds. Then the same for `gpuctl run --preempt` with a
   `--preemptible` job as the victim, to CMD's start (CMD prints its clock), beside a
   plain `gpuctl run` of the same CMD with room.
3. The wait queue (`gpuctl run --wait`): the read of an empty queue that every plain
   `gpuctl run` adds, beside a fresh look; then with 8 waiters queued through the agent, a
   waiter's renewal (`queue_join` of its own entry) and the queue's read under the
   admission lock (`waiters`), each beside a fresh look at the host (`GET /status?fresh=1`)
   of the same agent, interleaved; medians, their ratios to the look, and what one
   waiter's renewals every 0.5 s cost the agent's host (a share of one core, at most).

    python bench/priority_bench.py [--runs 20] [--cycles 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpuctl.sim.host import SimHost, free_port


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def service(name: str, port: int, gib: int, prio: int) -> str:
    cmd = (
        f"{sys.executable} -m gpuctl sim model-server --name {name} --memory {gib}GiB "
        f"--load-time 1s --port {port}"
    )
    return (
        f'[services.{name}]\nlauncher = "process"\ncommand = {json.dumps(cmd)}\n'
        f'health = "http://127.0.0.1:{port}/health"\nmemory = "{gib}GiB"\npriority = {prio}\n'
        f'health_timeout = "60s"\nstop_timeout = "10s"\n'
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpuctl"))
    with SimHost(gpu_memory="120GiB") as host:
        host.start_agent()
        host.hold("comfyui", "10GiB")
        chat, batch = "benchchat", "benchbatch"
        cfg = host.write_config(
            service(chat, free_port(), 80, 100) + "\n" + service(batch, free_port(), 40, 50)
        )
        env = {**os.environ, **host.env(), "GPUCTL_CONFIG": str(cfg)}
        run_t, status_t = [], []
        for _ in range(args.runs):
            run_t.append(timed([exe, "run", "--memory", "15GiB", "--", "true"], env))
            status_t.append(timed([exe, "status", "--json"], env))
        r, s = statistics.median(run_t), statistics.median(status_t)
        print(f"run -- true     median {r * 1000:7.1f} ms (n={args.runs})")
        print(f"status --json   median {s * 1000:7.1f} ms (n={args.runs})")
        print(f"ratio run/status: {r / s:.2f}x (target <= 1.2x)")

        overheads, stops = [], []
        for _ in range(args.cycles):
            ok = subprocess.run([exe, "ensure", batch], env=env, capture_output=True, check=False)
            assert ok.returncode == 0, ok.stderr
            t0 = time.time()
            p = subprocess.run(
                [exe, "ensure", chat, "--preempt", "--no-wait", "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            out = json.loads(p.stdout)
            assert p.returncode == 0, p.stdout
            launched_at = out["attempt"]["started"]
            note = next(n for n in out["notes"] if n.startswith("preempted"))
            m = re.search(r"stops took ([0-9.]+)s", note)
            assert m is not None, note
            stop_s = float(m.group(1))
            stops.append(stop_s)
            overheads.append(launched_at - t0 - stop_s)
            subprocess.run([exe, "stop", chat], env=env, capture_output=True, check=False)
        o = statistics.median(overheads)
        print(
            f"preemption: victims' stop median {statistics.median(stops):.3f} s; "
            f"ensure --preempt to launch beyond it: median {o:.3f} s, "
            f"max {max(overheads):.3f} s (n={args.cycles}, target <= 0.5 s)"
        )
        plain = []
        for _ in range(args.cycles):  # the same start with room: no victim to stop
            t0 = time.time()
            p = subprocess.run(
                [exe, "ensure", chat, "--no-wait", "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert p.returncode == 0, p.stdout
            plain.append(json.loads(p.stdout)["attempt"]["started"] - t0)
            subprocess.run([exe, "stop", chat], env=env, capture_output=True, check=False)
        b = statistics.median(plain)
        print(
            f"  a plain ensure --no-wait to launch, with room: median {b:.3f} s "
            f"(n={args.cycles}); preempting adds {o - b:.3f} s beyond it and the stops"
        )
        run_preempt_bench(exe, env, args.cycles)
        queue_bench(host, args.calls)


CLOCK = [sys.executable, "-c", "import time; print(time.time())"]


def run_preempt_bench(exe: str, env: dict[str, str], cycles: int) -> None:
    """`gpuctl run --preempt` (80 GiB, priority 100) with a `--preemptible` 40 GiB job
    as its victim, to CMD's start beyond the victim's stop; beside a plain `gpuctl run`
    of the same CMD with room."""
    over, plain, stops = [], [], []
    for _ in range(cycles):
        hold = [sys.executable, "-m", "gpuctl", "sim", "hold", "--name", "benchvictim"]
        victim = subprocess.Popen(
            [exe, "run", "--preemptible", "-p", "10", "-m", "40GiB", "--", *hold, "-m", "40GiB"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert victim.stdout is not None and "holding" in victim.stdout.readline()
        t0 = time.time()
        p = subprocess.run(
            [exe, "run", "--preempt", "-p", "100", "-m", "80GiB", "--", *CLOCK],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert p.returncode == 0, p.stderr
        m = re.search(r"stops took ([0-9.]+)s", p.stderr)
        assert m is not None, p.stderr
        stops.append(float(m.group(1)))
        over.append(float(p.stdout.split()[-1]) - t0 - stops[-1])
        victim.communicate(timeout=60)
        t0 = time.time()
        p = subprocess.run(
            [exe, "run", "-m", "80GiB", "--", *CLOCK],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert p.returncode == 0, p.stderr
        plain.append(float(p.stdout.split()[-1]) - t0)
    o, b = statistics.median(over), statistics.median(plain)
    print(
        f"run --preempt: the victim job's stop median {statistics.median(stops):.3f} s; "
        f"to CMD's start beyond it: median {o:.3f} s, max {max(over):.3f} s (n={cycles}); "
        f"a plain run to CMD's start, with room: median {b:.3f} s; preempting adds "
        f"{o - b:.3f} s"
    )


def queue_bench(host: SimHost, calls: int) -> None:
    from gpuctl.adapters.agent_client import AgentClient
    from gpuctl.adapters.store import AgentStore, holder_here

    store = AgentStore(host.agent_url, host.token)
    client = AgentClient(host.agent_url, host.token)
    waiters = [holder_here("run") for _ in range(8)]
    try:
        # What every plain `gpuctl run` adds: one read of an empty queue.
        empty, bare = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            store.waiters()
            t1 = time.perf_counter()
            client.status(fresh=True)
            empty.append(t1 - t0)
            bare.append(time.perf_counter() - t1)
        e, b = statistics.median(empty) * 1000, statistics.median(bare) * 1000
        print(f"empty queue read median {e:6.2f} ms, status fresh {b:6.2f} ms (n={calls})")
        for i, h in enumerate(waiters):
            store.queue_join(h, 60, name=f"run.bench{i}", priority=50, memory_mib=1024)
        me = waiters[3]
        renew, read, look = [], [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            store.queue_join(me, 60, name="run.bench3", priority=50, memory_mib=1024)
            t1 = time.perf_counter()
            store.waiters()
            t2 = time.perf_counter()
            client.status(fresh=True)
            t3 = time.perf_counter()
            renew.append(t1 - t0)
            read.append(t2 - t1)
            look.append(t3 - t2)
        r, q, s = (statistics.median(x) * 1000 for x in (renew, read, look))
        print(f"queue renew     median {r:7.2f} ms (n={calls}, 8 waiters)")
        print(f"queue read      median {q:7.2f} ms (n={calls})")
        print(f"status fresh    median {s:7.2f} ms (n={calls})")
        print(f"ratio renew/look: {r / s:.2f}x, read/look: {q / s:.2f}x")
        print(f"one waiter renewing every 0.5 s: at most {r / 500 * 100:.1f}% of a core")
    finally:
        for h in waiters:
            store.queue_leave(h.id)
        store.close()
        client.close()


if __name__ == "__main__":
    main()
