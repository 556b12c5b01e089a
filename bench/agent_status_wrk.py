"""Throughput of the agent's hot path: ``GET /status`` with keep-alive pollers.

Starts ``gpuctl agent --probe sim`` on a free loopback port (with a token, as on a real
host), optionally puts a few simulated GPU processes on it, then runs::

    wrk -t2 -c32 -d10s --latency -H 'Authorization: Bearer …' http://127.0.0.1:PORT/status

and prints requests/s, p50 and p99, and the ratio to the target (2000 req/s on a
2-core machine). In the same run it measures ``GET /healthz`` (a fixed answer, the
server stack's floor) the same way and prints ``/status`` as a share of it, so what the
status path itself costs (auth, the cached reading, query parsing) shows side by side.
Usage::

    python bench/agent_status_wrk.py [--duration 10s] [--connections 32] [--threads 2]
        [--holds 3] [--match vllm]

Needs ``wrk`` on PATH. This is a measurement, not a test: it exits 1 only when the
agent or wrk fails, or when some response was not a 200.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TARGET_RPS = 2000.0
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the agent exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    sys.exit("the agent did not answer /healthz in time")


def start_holds(n: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """``n`` simulated GPU processes of 4 GiB each (``gpuctl.sim.hold``)."""
    return [
        subprocess.Popen(
            [sys.executable, "-m", "gpuctl.sim.hold", "--name", f"bench-{i}", "--memory", "4GiB"],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for i in range(n)
    ]


def run_wrk(where: str, token: str, threads: int, connections: int, duration: str) -> str:
    """``wrk --latency`` against ``where`` with the Bearer ``token``; its report."""
    return subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}", "--latency",
         "-H", f"Authorization: Bearer {token}", where],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def parse_wrk(text: str) -> tuple[float, float, float, int]:
    """Requests/s, p50 ms, p99 ms and the count of non-2xx/3xx responses from wrk's output."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    lat: dict[str, float] = {}
    for pct, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M):
        lat[pct] = float(value) * _UNIT_MS[unit]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    return rps, lat["50"], lat["99"], int(bad.group(1)) if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--holds", type=int, default=3, help="simulated GPU processes to put on the GPU"
    )
    ap.add_argument("--match", default="", help="poll /status?match=... instead of /status")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not on PATH")

    token = secrets.token_urlsafe(16)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="gpuctl-bench-") as tmp:
        env = {
            **os.environ,
            "GPUCTL_AGENT_TOKEN": token,
            "GPUCTL_SIM_DIR": str(Path(tmp, "sim")),
            "GPUCTL_STATE_DIR": str(Path(tmp, "state")),
        }
        gpuctl = [sys.executable, "-m", "gpuctl"]
        Path(tmp, "sim").mkdir()  # named with --sim-dir, it must exist
        agent = subprocess.Popen(
            [*gpuctl, "agent", "--probe", "sim", "--listen", f"127.0.0.1:{port}",
             "--sim-dir", str(Path(tmp, "sim"))],
            env=env,
        )  # fmt: skip
        procs.append(agent)
        try:
            wait_healthy(url, agent)
            procs += start_holds(args.holds, env)
            headers = {"Authorization": f"Bearer {token}"}
            target = f"{url}/status" + (f"?match={args.match}" if args.match else "")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                r = httpx.get(target, headers=headers)
                r.raise_for_status()
                if len(r.json()["processes"]) >= args.holds:
                    break
                time.sleep(0.2)
            body = r.content
            print(f"status body: {len(body)} bytes, {len(r.json()['processes'])} GPU processes")

            out = run_wrk(target, token, args.threads, args.connections, args.duration)
            floor = run_wrk(f"{url}/healthz", token, args.threads, args.connections, args.duration)
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(10)
    rps, p50, p99, bad = parse_wrk(out)
    floor_rps, floor_p50, _, _ = parse_wrk(floor)
    print(
        f"wrk -t{args.threads} -c{args.connections} -d{args.duration}: "
        f"{rps:,.0f} req/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms "
        f"({rps / TARGET_RPS:.1f}x the {TARGET_RPS:,.0f} req/s target, {os.cpu_count()} CPUs)"
    )
    print(
        f"/healthz in the same run: {floor_rps:,.0f} req/s, p50 {floor_p50:.2f} ms; "
        f"/status runs at {rps / floor_rps:.2f}x of it"
    )
    if bad:
        print(f"error: {bad} responses were not 2xx/3xx", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
