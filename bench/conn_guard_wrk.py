"""What the connection guard (``gpuctl.agent.connections``) costs the agent's hot path:
``GET /status`` under ``wrk`` keep-alive load, the same agent code with the guard and
without it, side by side in one run.

Each round starts two ``gpuctl agent --probe sim`` on free loopback ports (each with its
own sim and state directories, a token as on a real host, and a few simulated GPU
processes): fresh processes every round, since one process can run a few per cent
faster or slower than its twin for its whole life (``--control`` shows it). The
unguarded one is this checkout's agent with ``guarded_protocol`` patched to hand back
uvicorn's protocol unchanged, in this harness's launcher only (no option or variable of
the agent turns the guard off). After a second's warm-up of each, in turn (the order
swapped every round, so a drift in the machine's load favours neither)::

    wrk -t2 -c32 -d5s -H 'Authorization: Bearer …' http://127.0.0.1:PORT/status

and prints each run, the medians of requests/s and p50, and the guarded/unguarded ratio
of the medians (and the median of the per-round ratios). Beside it, the agent's own CPU
time per request (its process's user + system time over wrk's request count): on a
shared machine requests/s moves with whatever else runs, the CPU a request takes much
less. Usage::

    python bench/conn_guard_wrk.py [--rounds 7] [--duration 5s] [--connections 32]
        [--threads 2] [--path /status] [--control]

Needs ``wrk`` on PATH. A measurement, not a test: it exits 1 only when an agent or wrk
fails, or when some response was not a 200.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_status_wrk import free_port, parse_wrk, wait_healthy

_TICKS = os.sysconf("SC_CLK_TCK")

# The unguarded agent: the same CLI, the guard's protocol factory a no-op. server.py
# imports ``guarded_protocol`` when the server starts, so the patch is what it finds.
_UNGUARDED = (
    "import gpuctl.agent.connections as c\n"
    "c.guarded_protocol = lambda base, guard: base\n"
    "from gpuctl.cli.app import main\n"
    "main()\n"
)


class Agent:
    """One sim agent with ``holds`` simulated GPU processes, stopped on exit."""

    def __init__(
        self, stack: ExitStack, name: str, *, guarded: bool, token: str, holds: int
    ) -> None:
        self.name = name
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpuctl-bench-"))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        sim = Path(tmp, "sim")
        sim.mkdir()
        env = {
            **os.environ,
            "GPUCTL_AGENT_TOKEN": token,
            "GPUCTL_SIM_DIR": str(sim),
            "GPUCTL_STATE_DIR": str(Path(tmp, "state")),
        }
        launch = ["-m", "gpuctl"] if guarded else ["-c", _UNGUARDED]
        self.procs: list[subprocess.Popen[bytes]] = []
        stack.callback(self.stop)
        agent = subprocess.Popen(
            [sys.executable, *launch, "agent", "--probe", "sim",
             "--listen", f"127.0.0.1:{port}", "--sim-dir", str(sim)],
            env=env,
        )  # fmt: skip
        self.procs.append(agent)
        wait_healthy(self.url, agent)
        for i in range(holds):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gpuctl.sim.hold", "--name", f"bench-{i}",
                     "--memory", "4GiB"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
        self.holds = holds

    def wait_processes(self, path: str, headers: dict[str, str]) -> int:
        """The status body's size once every simulated process shows in it."""
        deadline = time.monotonic() + 10
        while True:
            r = httpx.get(self.url + "/status", headers=headers)
            r.raise_for_status()
            if len(r.json()["processes"]) >= self.holds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return len(httpx.get(self.url + path, headers=headers).content)

    def cpu_s(self) -> float:
        """The agent process's user + system CPU time so far."""
        fields = Path(f"/proc/{self.procs[0].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--duration", default="5s")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--holds", type=int, default=3)
    ap.add_argument("--path", default="/status")
    ap.add_argument(
        "--control",
        action="store_true",
        help="start both agents without the guard: the ratios then show the noise",
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not on PATH")
    token = secrets.token_urlsafe(16)
    headers = {"Authorization": f"Bearer {token}"}
    rps: dict[str, list[float]] = {"guard": [], "no guard": []}
    p50: dict[str, list[float]] = {"guard": [], "no guard": []}
    cpu_us: dict[str, list[float]] = {"guard": [], "no guard": []}
    bad = 0
    if args.control:
        print("control: neither agent has the guard; the ratio is the harness's noise")

    def wrk(a: Agent, duration: str) -> str:
        return subprocess.run(
            ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{duration}",
             "--latency", "-H", f"Authorization: Bearer {token}", a.url + args.path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    for r in range(args.rounds):
        # Fresh processes every round: one process runs a few per cent faster or slower
        # than its twin for the whole of its life (hash seeds, memory layout), which a
        # single pair would pass off as the guard's cost.
        with ExitStack() as stack:
            sides = (("guard", not args.control), ("no guard", False))
            agents = [
                Agent(stack, name, guarded=g, token=token, holds=args.holds)
                for name, g in (sides if r % 2 == 0 else sides[::-1])
            ]
            for a in agents:
                size = a.wait_processes(args.path, headers)
                if r == 0:
                    print(f"{a.name}: {a.url}{args.path}, {size} bytes")
                wrk(a, "1s")  # warm
            for a in agents:
                cpu0 = a.cpu_s()
                out = wrk(a, args.duration)
                cpu = a.cpu_s() - cpu0
                got, lat50, _, nbad = parse_wrk(out)
                bad += nbad
                n = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
                cpu_us[a.name].append(cpu / n * 1e6)
                rps[a.name].append(got)
                p50[a.name].append(lat50)
                print(
                    f"round {r + 1} {a.name:>8}: {got:>9,.0f} req/s, p50 {lat50:.2f} ms, "
                    f"{cpu_us[a.name][-1]:.1f} us CPU a request"
                )
    med = {k: statistics.median(v) for k, v in rps.items()}
    per_round = [g / n for g, n in zip(rps["guard"], rps["no guard"], strict=True)]
    print(
        f"wrk -t{args.threads} -c{args.connections} -d{args.duration} {args.path}, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}:"
    )
    for k, runs in rps.items():
        print(
            f"  {k:>8}: median {med[k]:,.0f} req/s, p50 {statistics.median(p50[k]):.2f} ms "
            f"(min {min(runs):,.0f}, max {max(runs):,.0f}), "
            f"{statistics.median(cpu_us[k]):.1f} us CPU a request"
        )
    print(
        f"  guard / no guard: {med['guard'] / med['no guard']:.3f}x of the medians, "
        f"per-round ratios' median {statistics.median(per_round):.3f}x "
        f"({', '.join(f'{x:.2f}' for x in per_round)})"
    )
    cpu_ratio = statistics.median(cpu_us["guard"]) / statistics.median(cpu_us["no guard"])
    print(f"  CPU a request, guard / no guard: {cpu_ratio:.3f}x (throughput {1 / cpu_ratio:.3f}x)")
    if bad:
        print(f"error: {bad} responses were not 2xx/3xx", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
