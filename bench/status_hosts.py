"""Benchmark: `gpuctl status --all --json` over 16 hosts against the same over one host,
side by side in one run (interleaved). Prints the medians of wall time and of CPU time
(user + system of the gpuctl process), and their ratios (target: at most 1.5x).

Each host is its own `gpuctl agent` on loopback (all on one simulated GPU), with two
services, so every host costs what a real one costs the CLI: an agent call, a records
call, and the decisions.

    python bench/status_hosts.py [--runs 15] [--hosts 16]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpuctl.sim.host import SimHost, free_port


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def start_agents(host: SimHost, n: int) -> list[str]:
    """``n`` agents on the simulated GPU (the host's own, then n-1 more)."""
    host.start_agent()
    urls = [host.agent_url]
    for _ in range(n - 1):
        port = free_port()
        host.spawn(
            [
                "agent",
                "--probe",
                "sim",
                "--listen",
                f"127.0.0.1:{port}",
                "--sim-dir",
                str(host.sim_dir),
                "--state-dir",
                str(host.state_dir),
            ],
            f"agent-{port}",
            {"GPUCTL_AGENT_TOKEN": host.token},
        )
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"agent {url} did not start")
                time.sleep(0.1)
    return urls


def config(urls: list[str], path: Path) -> Path:
    parts = []
    for i, url in enumerate(urls):
        parts.append(
            f'[hosts.h{i}]\nagent = "{url}"\ntoken_env = "GPUCTL_BENCH_TOKEN"\n\n'
            f'[services.vllm{i}]\nhost = "h{i}"\nmatch = ["vllm{i}"]\nmemory = "40GiB"\n\n'
            f'[services.photos{i}]\nhost = "h{i}"\nmatch = ["photo-batch{i}"]\nmemory = "10GiB"\n'
        )
    path.write_text("\n".join(parts))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--hosts", type=int, default=16)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpuctl"))
    with SimHost() as host:
        urls = start_agents(host, args.hosts)
        host.hold("comfyui", "20GiB")
        one = config(urls[:1], host.base / "one.toml")
        many = config(urls, host.base / "many.toml")
        env = {**os.environ, "GPUCTL_BENCH_TOKEN": host.token}
        cmd = [exe, "status", "--all", "--json"]
        env_one = {**env, "GPUCTL_CONFIG": str(one)}
        env_many = {**env, "GPUCTL_CONFIG": str(many)}
        for _ in range(3):  # warm the page cache and the agents' caches
            timed(cmd, env_one)
            timed(cmd, env_many)
        a: list[tuple[float, float]] = []
        b: list[tuple[float, float]] = []
        for _ in range(args.runs):  # interleaved, so noise hits both alike
            a.append(timed(cmd, env_many))
            b.append(timed(cmd, env_one))
    wall_a, wall_b = statistics.median(w for w, _ in a), statistics.median(w for w, _ in b)
    cpu_a, cpu_b = statistics.median(c for _, c in a), statistics.median(c for _, c in b)
    n = args.hosts
    print(
        f"status --all --json, {n} hosts   wall {wall_a * 1000:7.1f} ms  cpu {cpu_a * 1000:7.1f} ms  (n={len(a)})"
    )
    print(
        f"status --all --json, 1 host     wall {wall_b * 1000:7.1f} ms  cpu {cpu_b * 1000:7.1f} ms  (n={len(b)})"
    )
    print(f"ratio wall {wall_a / wall_b:.2f}x  cpu {cpu_a / cpu_b:.2f}x  (target <= 1.5x)")


if __name__ == "__main__":
    main()
