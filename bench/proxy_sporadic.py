"""What a sporadic request costs through ``gpuctl proxy``: one every ``--gap`` (3 s), as a
chat UI sends them, against the same server called directly.

One simulated host (its agent, the in-flight counts through it), ``gpuctl proxy``, and
one simulated vLLM server (no load time, no delay per token) that the proxy's first
request starts, so that gpuctl's record of it is as deployed. Each round
sends one request straight to the server and, ``--gap`` later, one through the proxy,
each on a keep-alive connection of its own, as a browser's would be; then, for
reference, ``--burst`` requests back to back through the proxy. Prints the medians and
the slowest of each, and the added cost (proxy minus direct, medians).

For a floor, each round also sends one request through a bare TCP relay (``RELAY``: one
more process that copies bytes and does nothing else): what any proxy in its own process
costs on this machine after an idle gap. On a virtual machine whose idle CPUs sleep deeply,
waking one more process costs far more than its work.

Usage::

    python bench/proxy_sporadic.py [--rounds 12] [--gap 3s] [--burst 20]

Target of the issue (20): a sporadic request costs under 2 ms more through the proxy.
A measurement, not a test: it exits 1 only when a server fails or a response is not a
200.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import httpx

from gpuctl.core.units import parse_duration_s
from gpuctl.sim.host import SimHost, free_port

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "chat", "messages": MSG, "max_tokens": 1}


def wait_ok(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"{what} did not answer {url} in {timeout_s:g} s")


def timed(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    r = client.post(url, json=BODY)
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != 200:
        sys.exit(f"{url} answered {r.status_code}: {r.text[:200]}")
    return ms


# One more process between client and server, doing nothing but copying bytes.
RELAY = """
import asyncio, sys

async def pump(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()

async def serve(r, w):
    ur, uw = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pump(r, uw), pump(ur, w), return_exceptions=True)

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--gap", default="3s", help="the pause before each request")
    ap.add_argument("--burst", type=int, default=20, help="back-to-back requests, for reference")
    args = ap.parse_args()
    gap = parse_duration_s(args.gap)

    with SimHost(gpu_memory="100GiB") as host:
        host.start_agent()
        port = free_port()
        command = (
            f"{sys.executable} -m gpuctl sim model-server --name chat --memory 1GiB "
            f"--load-time 0 --token-delay 0 --port {port}"
        )
        conf = host.write_config(
            '[services.chat]\nlauncher = "process"\n'
            f'command = "{command}"\nmatch = ["chat"]\n'
            f'health = "http://127.0.0.1:{port}/health"\nmodels = ["chat"]\n'
            'memory = "1GiB"\nhealth_timeout = "60s"\n'
        )
        pport = free_port()
        proxy = host.spawn(
            ["proxy", "--listen", f"127.0.0.1:{pport}"], "proxy", {"GPUCTL_CONFIG": str(conf)}
        )
        rport = free_port()
        relay = subprocess.Popen(
            [sys.executable, "-c", RELAY, str(rport), str(port)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
            wait_ok(f"http://127.0.0.1:{pport}/healthz", proxy, "gpuctl proxy")
            direct_url = f"http://127.0.0.1:{port}/v1/chat/completions"
            proxy_url = f"http://127.0.0.1:{pport}/v1/chat/completions"
            relay_url = f"http://127.0.0.1:{rport}/v1/chat/completions"
            with (
                httpx.Client(timeout=60) as d,
                httpx.Client(timeout=60) as p,
                httpx.Client(timeout=60) as r,
            ):
                # The first request starts the server through the proxy (gpuctl's record
                # of it, as deployed); then both connections are open.
                timed(p, proxy_url)
                timed(d, direct_url)
                timed(r, relay_url)
                direct, relayed, proxied = [], [], []
                for _ in range(args.rounds):
                    time.sleep(gap)
                    direct.append(timed(d, direct_url))
                    time.sleep(gap)
                    relayed.append(timed(r, relay_url))
                    time.sleep(gap)
                    proxied.append(timed(p, proxy_url))
                burst = [timed(p, proxy_url) for _ in range(args.burst)]
                burst_direct = [timed(d, direct_url) for _ in range(args.burst)]
            # The proxy's own time for each request, from its access log (its first is
            # the cold start): the client's noise left out.
            time.sleep(0.5)
            log = (host.base / "proxy.log").read_text(errors="replace")
            own = [
                float(m) for m in re.findall(r'"POST /v1/chat/completions" 200 .* (\S+)ms ', log)
            ]
        finally:
            relay.kill()
            relay.wait()
            host.stop(proxy)
            subprocess.run(
                [sys.executable, "-m", "gpuctl", "stop", "chat"],
                env={**host.env(), "GPUCTL_CONFIG": str(conf)},
                capture_output=True,
                timeout=60,
                check=False,
            )

    def line(what: str, ms: list[float]) -> str:
        return f"{what:<28} median {statistics.median(ms):7.2f} ms   max {max(ms):7.2f} ms"

    print(f"one request every {args.gap}, {args.rounds} rounds")
    print(line("direct, sporadic", direct))
    print(line("bare TCP relay, sporadic", relayed))
    print(line("through the proxy, sporadic", proxied))
    print(line("direct, back to back", burst_direct))
    print(line("through the proxy, b2b", burst))
    added = statistics.median(proxied) - statistics.median(direct)
    added_b2b = statistics.median(burst) - statistics.median(burst_direct)
    print(f"added by the proxy: sporadic {added:.2f} ms, back to back {added_b2b:.2f} ms")
    floor = statistics.median(relayed) - statistics.median(direct)
    print(f"added by a bare relay (the floor of any proxy here): sporadic {floor:.2f} ms")
    print(f"added by the proxy beyond that floor: sporadic {added - floor:.2f} ms")
    if len(own) == 1 + args.rounds + args.burst:
        print(line("proxy's own time, sporadic", own[1 : 1 + args.rounds]))
        print(line("proxy's own time, b2b", own[1 + args.rounds :]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
