"""Benchmarks of issue 3, measured side by side in one run (this machine is noisy):

1. warm path: ``ensure_ready_sync`` / ``ensure_ready`` on a healthy service, against one
   bare health GET on a keep-alive client (target: median overhead <= 1 ms);
2. readiness detection: from the fake server's first 200 to each of 32 concurrent
   ``gpuctl ensure`` processes returning (target: median <= 300 ms);
3. lease take + release on the direct store (target: median <= 2 ms).

    python bench/ensure_bench.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from gpuctl import api
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.sim.host import SimHost, free_port


def ms(x: float) -> str:
    return f"{x * 1000:7.3f} ms"


def warm_path(host: SimHost, n: int = 2000) -> None:
    port = free_port()
    server = host.model_server("warm", "1GiB", "0.5s", port)
    url = f"http://127.0.0.1:{port}/health"
    cfg = host.write_config(f'[services.warm]\nhealth = "{url}"\nmemory = "1GiB"\n')
    client = httpx.Client()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if client.get(url).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    api.ensure_ready_sync("warm", config=cfg)  # load config, open the client, first touch
    bare: list[float] = []
    ours: list[float] = []
    for _ in range(n):  # interleaved
        t = time.perf_counter()
        client.get(url)
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        r = api.ensure_ready_sync("warm", config=cfg)
        ours.append(time.perf_counter() - t)
        assert r.ready
    mb, mo = statistics.median(bare), statistics.median(ours)
    print(
        f"warm path (sync, n={n}): bare GET {ms(mb)}   ensure_ready_sync {ms(mo)}   overhead {ms(mo - mb)}"
    )

    async def run_async() -> tuple[float, float]:
        ac = httpx.AsyncClient()
        await api.ensure_ready("warm", config=cfg)
        b: list[float] = []
        o: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            await ac.get(url)
            b.append(time.perf_counter() - t)
            t = time.perf_counter()
            await api.ensure_ready("warm", config=cfg)
            o.append(time.perf_counter() - t)
        await ac.aclose()
        await api.aclose()
        return statistics.median(b), statistics.median(o)

    mb, mo = asyncio.run(run_async())
    print(
        f"warm path (async, n={n}): bare GET {ms(mb)}   ensure_ready     {ms(mo)}   overhead {ms(mo - mb)}"
    )
    client.close()
    host.stop(server)


def readiness(host: SimHost, waiters: int = 32) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    cmd = f"{sys.executable} -m gpuctl sim model-server --name ready{port} --memory 10GiB --load-time 8s --port {port} --sim-dir {host.sim_dir}"
    cfg = host.write_config(
        f'[services.ready{port}]\nlauncher = "process"\ncommand = "{cmd}"\nhealth = "{url}"\n'
        f'memory = "10GiB"\nmatch = ["ready{port}"]\n'
    )
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg)}
    exe = str(Path(sys.executable).with_name("gpuctl"))
    first_200: list[float] = []

    def watch() -> None:
        with httpx.Client(timeout=1) as c:
            while True:
                try:
                    if c.get(url).status_code == 200:
                        first_200.append(time.time())
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.005)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    procs = [
        subprocess.Popen(
            [exe, "ensure", f"ready{port}", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(waiters)
    ]
    returned: list[float] = [0.0] * waiters

    def reap(i: int) -> None:
        procs[i].wait()
        returned[i] = time.time()

    threads = [threading.Thread(target=reap, args=(i,)) for i in range(waiters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    w.join(60)
    outs = [json.loads(p.stdout.read() or "{}") for p in procs if p.stdout]
    launched = sum(1 for o in outs if o.get("launched"))
    lat = sorted(r - first_200[0] for r in returned)
    print(
        f"readiness ({waiters} concurrent ensure processes, {launched} launch): first 200 -> return "
        f"median {ms(statistics.median(lat))}  p90 {ms(lat[int(len(lat) * 0.9)])}  max {ms(lat[-1])}"
    )
    subprocess.run([exe, "stop", f"ready{port}"], env=env, capture_output=True, check=False)


def lease(n: int = 500) -> None:
    with tempfile.TemporaryDirectory() as d:
        store = DirectStore(Path(d))
        holder = holder_here("bench")
        store.acquire("svc", holder, 60)
        store.release("svc", holder.id)
        times: list[float] = []
        for _ in range(n):
            h = holder_here("bench")
            t = time.perf_counter()
            granted, _ = store.acquire("svc", h, 60)
            store.release("svc", h.id)
            times.append(time.perf_counter() - t)
            assert granted
        times.sort()
        print(
            f"lease take + release, direct (n={n}): median {ms(statistics.median(times))}  p99 {ms(times[int(n * 0.99)])}"
        )


def main() -> None:
    with SimHost() as host:
        os.environ["GPUCTL_STATE_DIR"] = str(host.state_dir)
        host.start_agent()
        warm_path(host)
        readiness(host)
    lease()


if __name__ == "__main__":
    main()
