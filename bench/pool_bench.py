"""Benchmarks of issue 21's pool, measured side by side in one run (interleaved, since
this machine is noisy):

1. ``gpuctl ensure`` of a READY pooled service over 4 hosts (``hosts = [...]``), against
   the same service on one host (``host = "h0"``): the CPU of the gpuctl process and its
   wall time (target: at most 1.3x). The pool's copy runs on the host listed last, the
   worst place for it: the others are asked first.
2. ``gpuctl status --all --json`` over 16 hosts, where each service is pooled over all
   of them, against one host (target: at most 1.5x in the client's CPU).

Each host is its own ``gpuctl agent`` on a loopback address of its own (127.0.0.N) with
its own simulated GPU, as a pool of real hosts would be.

    python bench/pool_bench.py [--runs 15] [--hosts 4] [--status-hosts 16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

from status_hosts import timed

from gpuctl.sim.host import SimHost, free_port, sim_hosts

TOKEN_ENV = "GPUCTL_BENCH_TOKEN_"


def hosts_on_loopback(root: Path, n: int) -> contextlib.AbstractContextManager[list[SimHost]]:
    """``n`` simulated hosts, each with its agent on 127.0.0.(i+1)."""
    return sim_hosts(SimHost(root=root / f"h{i}", address=f"127.0.0.{i + 1}") for i in range(n))


def host_tables(hosts: list[SimHost]) -> tuple[list[str], dict[str, str]]:
    """The ``[hosts.hI]`` tables, and the tokens' environment."""
    lines: list[str] = []
    env: dict[str, str] = {}
    for i, h in enumerate(hosts):
        env[f"{TOKEN_ENV}{i}"] = h.token
        lines += [
            f"[hosts.h{i}]",
            f'agent = "{h.agent_url}"',
            f'token_env = "{TOKEN_ENV}{i}"',
            f'sim_dir = "{h.sim_dir}"',
            "",
        ]
    return lines, env


def service_table(name: str, placement: str, port: int, memory: str = "20GiB") -> list[str]:
    command = (
        f"{sys.executable} -m gpuctl sim model-server --name {name} --memory {memory} "
        f"--load-time 0s --port {port}"
    )
    return [
        f"[services.{name}]",
        placement,
        'launcher = "process"',
        f'command = "{command}"',
        f'health = "http://{{host}}:{port}/health"',
        f'match = ["{name}"]',
        f'memory = "{memory}"',
        'health_timeout = "60s"',
        "",
    ]


def compare(label: str, cmd: list[str], env_a: dict[str, str], env_b: dict[str, str],
            runs: int, target: float) -> None:  # fmt: skip
    """Interleaved runs of ``cmd`` under ``env_a`` (the pool) and ``env_b`` (one host)."""
    for _ in range(3):  # warm the page cache and the agents
        timed(cmd, env_a)
        timed(cmd, env_b)
    a: list[tuple[float, float]] = []
    b: list[tuple[float, float]] = []
    for _ in range(runs):
        a.append(timed(cmd, env_a))
        b.append(timed(cmd, env_b))
    wall_a, wall_b = statistics.median(w for w, _ in a), statistics.median(w for w, _ in b)
    cpu_a, cpu_b = statistics.median(c for _, c in a), statistics.median(c for _, c in b)
    print(f"{label}")
    print(f"  pool      wall {wall_a * 1000:7.1f} ms  cpu {cpu_a * 1000:7.1f} ms  (n={len(a)})")
    print(f"  one host  wall {wall_b * 1000:7.1f} ms  cpu {cpu_b * 1000:7.1f} ms  (n={len(b)})")
    print(f"  ratio wall {wall_a / wall_b:.2f}x  cpu {cpu_a / cpu_b:.2f}x  (target <= {target}x)")


def ensure_bench(root: Path, n: int, runs: int, exe: str) -> None:
    with hosts_on_loopback(root, n) as hosts:
        tables, tokens = host_tables(hosts)
        port = free_port()
        names = [f"h{i}" for i in range(n)]
        last = names[-1]
        pool = root / "pool.toml"
        pool.write_text("\n".join([*tables, *service_table("chat", f"hosts = {names}", port)]))
        one = root / "one.toml"
        one.write_text("\n".join([*tables, *service_table("chat", f'host = "{last}"', port)]))
        env = {**os.environ, **tokens}
        env_pool = {**env, "GPUCTL_CONFIG": str(pool)}
        env_one = {**env, "GPUCTL_CONFIG": str(one)}
        timed([exe, "ensure", "chat", "--json"], env_one)  # the copy, on the host listed last
        compare(
            f"ensure of a READY service: pooled over {n} hosts (its copy on the last) "
            "against one host",
            [exe, "ensure", "chat", "--json"],
            env_pool,
            env_one,
            runs,
            1.3,
        )
        timed([exe, "stop", "chat", "--json"], env_pool)


def status_bench(root: Path, n: int, runs: int, exe: str) -> None:
    with hosts_on_loopback(root, n) as hosts:
        tables, tokens = host_tables(hosts)
        names = [f"h{i}" for i in range(n)]
        hosts[0].hold("comfyui", "20GiB")
        pool = root / "pool.toml"
        pool.write_text(
            "\n".join(
                [
                    *tables,
                    *service_table("vllm", f"hosts = {names}", free_port(), "40GiB"),
                    *service_table("photos", f"hosts = {names}", free_port(), "10GiB"),
                ]
            )
        )
        one = root / "one.toml"
        one.write_text(
            "\n".join(
                [
                    *tables[:5],
                    *service_table("vllm", 'host = "h0"', free_port(), "40GiB"),
                    *service_table("photos", 'host = "h0"', free_port(), "10GiB"),
                ]
            )
        )
        env = {**os.environ, **tokens}
        compare(
            f"status --all --json: two services pooled over {n} hosts against one host",
            [exe, "status", "--all", "--json"],
            {**env, "GPUCTL_CONFIG": str(pool)},
            {**env, "GPUCTL_CONFIG": str(one)},
            runs,
            1.5,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--status-hosts", type=int, default=16)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpuctl"))
    with tempfile.TemporaryDirectory(prefix="gpuctl-pool-bench-") as tmp:
        ensure_bench(Path(tmp) / "ensure", args.hosts, args.runs, exe)
        status_bench(Path(tmp) / "status", args.status_hosts, args.runs, exe)


if __name__ == "__main__":
    main()
