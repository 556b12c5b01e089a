"""The web view's speed: page weight, first render, and what 50 open pages cost /status.

Starts ``gpuctl agent --probe sim --config F`` (one service, write and read-only tokens)
on a free loopback port with three simulated GPU processes, then measures:

- **page weight**: every file the page loads (``/ui``, its script, style and icon), in
  bytes, uncompressed; target at most 150 KB;
- **first render**: in Debian's headless chromium (Selenium), from the navigation's start
  (Navigation Timing) to the page's ``gpuctl:first-render`` mark, the first drawing with
  data, with the token already in ``sessionStorage``; the median of ``--loads`` loads;
  target at most 300 ms;
- **/status p99 with 50 pages open**: ``wrk -c32`` on ``/status`` with no page open, then
  with ``--pages`` pages' traffic (each: the event stream read with a streaming GET, and
  ``/ui/state`` every 5 s, as the page does when nothing loads), then with none again;
  target: the p99 with pages at most 1.2x the p99 without (the mean of the two runs).
  The pages are emulated in one asyncio process with the same requests at the same
  cadence: 50 real browser tabs would measure the browser's CPU on a small machine.

Usage::

    python bench/ui_bench.py [--duration 10s] [--pages 50] [--loads 7]

Needs ``wrk``, ``chromium`` and ``chromedriver`` on PATH. A measurement, not a test: it
exits 1 only when something fails to run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_status_wrk import free_port, parse_wrk, run_wrk, start_holds, wait_healthy

FILES = ("/ui", "/ui/app.js", "/ui/app.css", "/ui/icon.svg")
WEIGHT_KB = 150
FIRST_RENDER_MS = 300
P99_RATIO = 1.2


def page_weight(url: str) -> int:
    return sum(len(httpx.get(url + f).content) for f in FILES)


def first_render_ms(url: str, token: str, loads: int) -> list[float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.browser_helpers import chromium

    out: list[float] = []
    with chromium() as driver:
        driver.get(f"{url}/ui")
        driver.execute_script("sessionStorage.setItem('gpuctl.token', arguments[0])", token)
        for _ in range(loads + 1):  # the first load warms the browser's caches: dropped
            driver.get(f"{url}/ui")
            deadline = time.monotonic() + 10
            ms = None
            while ms is None and time.monotonic() < deadline:
                ms = driver.execute_script(
                    "const m = performance.getEntriesByName('gpuctl:first-render');"
                    "return m.length ? m[0].startTime : null;"
                )
                time.sleep(0.01)
            if ms is None:
                sys.exit("the page did not render in 10 s")
            out.append(float(ms))
    return out[1:]


def open_pages(url: str, token: str, pages: int, stop: threading.Event) -> threading.Thread:
    headers = {"Authorization": f"Bearer {token}"}

    async def page(client: httpx.AsyncClient, i: int) -> None:
        async def stream() -> None:
            async with client.stream(
                "GET", f"{url}/events", params={"follow": "1", "since": "1h"}, headers=headers
            ) as r:
                async for _ in r.aiter_bytes():
                    if stop.is_set():
                        return

        async def poll() -> None:
            await asyncio.sleep(5.0 * i / pages)  # pages opened over 5 s, not in step
            while not stop.is_set():
                (await client.get(f"{url}/ui/state", headers=headers)).raise_for_status()
                await asyncio.sleep(5.0)

        tasks = [asyncio.create_task(stream()), asyncio.create_task(poll())]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()

    async def main() -> None:
        limits = httpx.Limits(max_connections=pages * 2 + 4)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            await asyncio.gather(*(page(client, i) for i in range(pages)), return_exceptions=True)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--pages", type=int, default=50)
    ap.add_argument("--loads", type=int, default=7)
    args = ap.parse_args()
    for tool in ("wrk", "chromium", "chromedriver"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH")

    token, read_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="gpuctl-ui-bench-") as tmp:
        sim, state = Path(tmp, "sim"), Path(tmp, "state")
        sim.mkdir()
        state.mkdir()  # the journal behind the event stream lives there
        read_file = Path(tmp, "read.token")
        read_file.write_text(read_token)
        read_file.chmod(0o600)
        config = Path(tmp, "agent.toml")
        config.write_text(
            '[hosts.sim]\n\n[services.chat]\nlauncher = "process"\n'
            'command = "true"\nhealth = "http://127.0.0.1:9/health"\nmatch = ["chat"]\n'
            'memory = "20GiB"\n'
        )
        env = {**os.environ, "GPUCTL_AGENT_TOKEN": token, "GPUCTL_SIM_DIR": str(sim),
               "GPUCTL_STATE_DIR": str(state)}  # fmt: skip
        gpuctl = [sys.executable, "-m", "gpuctl"]
        agent = subprocess.Popen(
            [*gpuctl, "agent", "--probe", "sim", "--listen", f"127.0.0.1:{port}",
             "--sim-dir", str(sim), "--state-dir", str(state), "--config", str(config),
             "--read-token-file", str(read_file)],
            env=env,
        )  # fmt: skip
        procs.append(agent)
        try:
            wait_healthy(url, agent)
            procs += start_holds(3, env)
            time.sleep(1.0)
            weight = page_weight(url)
            renders = first_render_ms(url, read_token, args.loads)

            def wrk() -> float:
                out = run_wrk(f"{url}/status", token, 2, args.connections, args.duration)
                rps, _, p99, bad = parse_wrk(out)
                if bad:
                    sys.exit(f"{bad} /status answers were not 2xx")
                print(f"  wrk /status: {rps:,.0f} req/s, p99 {p99:.2f} ms")
                return p99

            print("no page open:")
            before = wrk()
            stop = threading.Event()
            pages = open_pages(url, read_token, args.pages, stop)
            time.sleep(6.0)  # every page has connected and polled once
            print(f"{args.pages} pages open:")
            loaded = wrk()
            stop.set()
            pages.join(10)
            time.sleep(2.0)
            print("no page open, again:")
            after = wrk()
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(10)
    base = (before + after) / 2
    ratio = loaded / base
    median = statistics.median(renders)
    print(f"page weight: {weight / 1000:.1f} KB in {len(FILES)} files (target <= {WEIGHT_KB} KB)")
    print(
        f"first render: median {median:.0f} ms, max {max(renders):.0f} ms over {len(renders)} "
        f"loads (target <= {FIRST_RENDER_MS} ms)"
    )
    print(
        f"/status p99: {base:.2f} ms with no page, {loaded:.2f} ms with {args.pages} pages: "
        f"{ratio:.2f}x (target <= {P99_RATIO}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
