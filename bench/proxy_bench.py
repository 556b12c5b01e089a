"""What ``gpuctl proxy`` adds in front of a warm model server, beside LiteLLM's proxy.

One simulated host (its agent, the in-flight counts through it), two simulated vLLM
servers already loaded (``fast``: no delay per token, for latency; ``stream``: a delay
per token, for streams), ``gpuctl proxy`` fronting both (a client key, the access log
on, as deployed) and, when its venv is there, LiteLLM's proxy pointed at the same two
servers (its master key; ``pip install 'litellm[proxy]'`` into ``--litellm-venv``, never
into gpuctl's own). Then ``wrk`` (keep-alive, ``--latency``) drives each target in
turn, interleaved over ``--rounds`` rounds so that the machine's noise falls on all of
them alike:

- non-streaming, ``--connections`` (64) clients, in two scenarios: *saturated* (the
  ``fast`` server, ``max_tokens`` 1, no delay: 64 closed-loop clients then keep every
  process busy, so latency is mostly queueing behind the CPU, and the path with the
  least CPU per request wins) and *paced* (the ``stream`` server, ``--paced-tokens``
  tokens at ``--token-delay`` each: a request takes tens of ms, as a real model
  server's does, the CPU is not saturated, and the added latency is the path's own
  cost). p50 and p99 per target; *added* = path minus direct, medians over the rounds;
- where the added mean latency goes: the server's answer as the proxy timed it (its
  ``gpuctl_proxy_upstream_latency_seconds`` sum and count, request written to answer
  head read) against the same server called directly, and the rest, the proxy's own
  path (its work, two more loopback hops). On a machine whose few cores the load
  generator, the server and the proxy share, a fronted server answers more slowly
  although the proxy does none of its work: that part is the machine's, not the path's;
- the CPU each path spends per request (the proxy's process, LiteLLM's, the server's
  for direct), from ``/proc``: steadier than latency on a loaded machine;
- streaming, ``--stream-tokens`` tokens per answer at 64 and 256 concurrent streams:
  tokens/s = completed answers/s x tokens per answer (each answer is the same size on
  every path), as a ratio to direct.

Usage::

    python bench/proxy_bench.py [--rounds 3] [--duration 10s] [--connections 64]
        [--paced-tokens 5] [--litellm-venv /tmp/litellm-venv] [--baseline DIR]

``--baseline DIR``: also run the ``gpuctl proxy`` of another checkout (``git worktree
add DIR <commit>``), as target ``baseline``, to measure a change before and after in
one run; with ``--baseline-client aiohttp`` (and DIR this checkout) the baseline is the
same proxy on aiohttp's client, beside the default (the lean one).

Targets of the issue (10): added p50 <= 1 ms and p99 <= 5 ms; streaming >= 95 % of
direct at 64 streams; added latency <= half of LiteLLM's. This is a measurement, not a
test: it exits 1 only when a server or wrk fails, or a response was not a 200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuctl.sim.host import SimHost, free_port

_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
MSG = [{"role": "user", "content": "hello"}]


def parse_wrk(text: str) -> dict[str, float]:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    lat: dict[str, float] = {}
    for pct, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M):
        lat[pct] = float(value) * _UNIT_MS[unit]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    n_err = sum(int(x) for x in errs.groups()) if errs else 0
    n = re.search(r"(\d+) requests in", text)
    avg = re.search(r"Latency\s+([\d.]+)(us|ms|s)\s", text)
    return {
        "avg": float(avg.group(1)) * _UNIT_MS[avg.group(2)] if avg else float("nan"),
        "n": float(n.group(1)) if n else 0.0,
        "rps": rps,
        "p50": lat.get("50", float("nan")),
        "p99": lat.get("99", float("nan")),
        "bad": float(int(bad.group(1)) if bad else 0) + n_err,
    }


def wrk(
    url: str, body: dict[str, object], key: str | None, conns: int, duration: str
) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\n')
        f.write(f"wrk.body = {json.dumps(json.dumps(body))}\n")
        f.write('wrk.headers["Content-Type"] = "application/json"\n')
        if key:
            f.write(f'wrk.headers["Authorization"] = "Bearer {key}"\n')
        script = f.name
    try:
        out = subprocess.run(
            ["wrk", "-t2", f"-c{conns}", f"-d{duration}", "--timeout", "30s", "--latency",
             "-s", script, url],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(script)
    return parse_wrk(out)


def upstream_s(base: str, key: str | None, service: str) -> tuple[float, float]:
    """The proxy's own timing of ``service``'s server: (seconds, answers) so far, from
    its ``gpuctl_proxy_upstream_latency_seconds`` sum and count in ``/metrics``."""
    h = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{base}/metrics", headers=h, timeout=10).text
    got = {}
    for what in ("sum", "count"):
        m = re.search(
            rf'^gpuctl_proxy_upstream_latency_seconds_{what}{{service="{service}"}} ([\d.e+-]+)$',
            text,
            re.M,
        )
        got[what] = float(m.group(1)) if m else float("nan")
    return got["sum"], got["count"]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (LiteLLM's workers)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def wait_ok(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"{what} did not answer {url} in time")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=50)
    ap.add_argument("--token-delay", default="10ms")
    ap.add_argument("--paced-tokens", type=int, default=5)
    ap.add_argument("--litellm-venv", default="/tmp/litellm-venv")
    ap.add_argument("--baseline", help="a gpuctl checkout whose proxy runs beside this one")
    ap.add_argument(
        "--baseline-client",
        help="GPUCTL_PROXY_CLIENT for the baseline (aiohttp, beside the default lean client)",
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not on PATH")

    key = "sk-bench-" + secrets.token_hex(16)
    with SimHost(gpu_memory="100GiB") as host:
        host.start_agent()
        fast_port, stream_port = free_port(), free_port()
        servers = [
            host.model_server("fast", "1GiB", "0", fast_port, "--token-delay", "0"),
            host.model_server(
                "stream", "1GiB", "0", stream_port, "--token-delay", args.token_delay
            ),
        ]
        for port, proc in zip((fast_port, stream_port), servers, strict=True):
            wait_ok(f"http://127.0.0.1:{port}/health", proc, "a sim model server")
        services = ""
        for name, port in (("fast", fast_port), ("stream", stream_port)):
            services += (
                f'[services.{name}]\nlauncher = "process"\n'
                f'command = "{sys.executable} -m gpuctl sim model-server --name {name}"\n'
                f'health = "http://127.0.0.1:{port}/health"\nmodels = ["{name}"]\n'
                f'memory = "1GiB"\n\n'
            )
        keys = host.base / "proxy.keys"
        keys.write_text(key + "\n")
        conf = host.write_config(services + f'[proxy]\napi_keys_file = "{keys}"\n')
        pport = free_port()
        proxy = host.spawn(
            ["proxy", "--listen", f"127.0.0.1:{pport}"], "proxy", {"GPUCTL_CONFIG": str(conf)}
        )
        wait_ok(f"http://127.0.0.1:{pport}/healthz", proxy, "gpuctl proxy")
        targets: dict[str, tuple[str, str | None]] = {
            "direct": ("http://127.0.0.1:{port}", None),
            "gpuctl": (f"http://127.0.0.1:{pport}", key),
        }
        pids = {"direct": servers[0].pid, "gpuctl": proxy.pid}
        base_proc = None
        if args.baseline:
            bport = free_port()
            src = str(Path(args.baseline).resolve())
            env = {**host.env(), "GPUCTL_CONFIG": str(conf), "PYTHONPATH": src}
            if args.baseline_client:
                env["GPUCTL_PROXY_CLIENT"] = args.baseline_client
            with open(host.base / "baseline.log", "ab") as log:
                base_proc = subprocess.Popen(
                    [sys.executable, "-m", "gpuctl", "proxy", "--listen", f"127.0.0.1:{bport}"],
                    cwd=src, env=env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            wait_ok(f"http://127.0.0.1:{bport}/healthz", base_proc, "the baseline proxy")
            targets["baseline"] = (f"http://127.0.0.1:{bport}", key)
            pids["baseline"] = base_proc.pid
        litellm = Path(args.litellm_venv) / "bin" / "litellm"
        ll_proc = None
        if litellm.exists():
            lport = free_port()
            (host.base / "litellm.yaml").write_text(
                "model_list:\n"
                + "".join(
                    f"  - model_name: {n}\n    litellm_params:\n      model: openai/{n}\n"
                    f"      api_base: http://127.0.0.1:{p}/v1\n      api_key: none\n"
                    for n, p in (("fast", fast_port), ("stream", stream_port))
                )
                + "litellm_settings:\n  telemetry: false\n"
            )
            env = {
                **os.environ,
                "LITELLM_MASTER_KEY": key,
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch off this machine
                "LITELLM_TELEMETRY": "False",
            }
            with open(host.base / "litellm.log", "wb") as log:
                ll_proc = subprocess.Popen(
                    [str(litellm), "--config", str(host.base / "litellm.yaml"), "--port",
                     str(lport), "--host", "127.0.0.1", "--num_workers", "1"],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            wait_ok(f"http://127.0.0.1:{lport}/health/liveliness", ll_proc, "LiteLLM", 300)
            targets["litellm"] = (f"http://127.0.0.1:{lport}", key)
            pids["litellm"] = ll_proc.pid
        else:
            print(f"LiteLLM: not run ({litellm} is missing; pip install 'litellm[proxy]' there)")
        try:
            return run(args, targets, pids, fast_port, stream_port, servers[1].pid)
        finally:
            if base_proc is not None:
                host.stop(base_proc)
            if ll_proc is not None:
                ll_proc.terminate()
                ll_proc.wait(30)
            host.stop(proxy)
            for s in servers:
                host.stop(s)


def run(
    args: argparse.Namespace,
    targets: dict[str, tuple[str, str | None]],
    pids: dict[str, int],
    fast_port: int,
    stream_port: int,
    stream_pid: int,
) -> int:
    def url(name: str, port: int) -> str:
        base, _ = targets[name]
        return base.format(port=port) + "/v1/chat/completions"

    # Warm every path once (connections, LiteLLM's first-request set-up).
    for name, (_, k) in targets.items():
        for model, port in (("fast", fast_port), ("stream", stream_port)):
            h = {"Authorization": f"Bearer {k}"} if k else {}
            r = httpx.post(url(name, port), json={"model": model, "messages": MSG, "max_tokens": 1},
                           headers=h, timeout=60)  # fmt: skip
            if r.status_code != 200:
                sys.exit(f"{name} answered {r.status_code}: {r.text[:200]}")

    fast_body = {"model": "fast", "messages": MSG, "max_tokens": 1}
    stream_body = {"model": "stream", "messages": MSG, "stream": True,
                   "max_tokens": args.stream_tokens}  # fmt: skip

    def settle(name: str) -> None:
        """Wait until ``name`` answers one request within a second and its process is
        nearly idle (under 10 % of a CPU over half a second): a path that queued more
        than it served (LiteLLM does not abort what its clients left) must drain before
        the next measurement, or that one measures the backlog."""
        _, k = targets[name]
        h = {"Authorization": f"Bearer {k}"} if k else {}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(url(name, fast_port), json={"model": "fast", "messages": MSG,
                           "max_tokens": 1}, headers=h, timeout=60)  # fmt: skip
            if time.monotonic() - t0 < 1.0:
                if name == "direct":
                    return
                c0 = cpu_s(pids[name])
                time.sleep(0.5)
                if cpu_s(pids[name]) - c0 < 0.05:
                    return
        print(f"{name} did not settle in 180 s", file=sys.stderr)

    def settle_all() -> None:
        # Every path, not only the next: a backlog left on one (LiteLLM after 256
        # streams) takes CPU from whichever is measured next.
        for name in targets:
            settle(name)

    paced_body = {"model": "stream", "messages": MSG, "max_tokens": args.paced_tokens}
    # (scenario, port, body, the server's pid: direct's CPU is that server's)
    scenarios = [
        ("saturated", fast_port, fast_body, pids["direct"]),
        ("paced", stream_port, paced_body, stream_pid),
    ]
    lat: dict[tuple[str, str], list[dict[str, float]]] = {}
    streams: dict[tuple[str, int], list[float]] = {}
    stream_cpu: dict[tuple[str, int], list[float]] = {}  # CPU us per token
    bad = 0
    load0 = os.getloadavg()
    for rnd in range(args.rounds):
        for scenario, port, body, server_pid in scenarios:
            for name, (_, k) in targets.items():
                settle_all()
                pid = server_pid if name == "direct" else pids[name]
                ours = name in ("gpuctl", "baseline")
                base = targets[name][0]
                u0 = upstream_s(base, k, str(body["model"])) if ours else (0.0, 0.0)
                c0 = cpu_s(pid)
                m = wrk(url(name, port), body, k, args.connections, args.duration)
                m["cpu_ms"] = (cpu_s(pid) - c0) * 1000 / max(1.0, m["n"])
                if ours:
                    u1 = upstream_s(base, k, str(body["model"]))
                    m["up_avg"] = (u1[0] - u0[0]) * 1000 / max(1.0, u1[1] - u0[1])
                lat.setdefault((scenario, name), []).append(m)
                bad += int(m["bad"])
        for conns in (64, 256):
            for name, (_, k) in targets.items():
                settle_all()
                pid = stream_pid if name == "direct" else pids[name]
                c0 = cpu_s(pid)
                m = wrk(url(name, stream_port), stream_body, k, conns, args.duration)
                tokens = m["n"] * args.stream_tokens
                streams.setdefault((name, conns), []).append(m["rps"] * args.stream_tokens)
                # No answer completed (LiteLLM at 256 streams): no figure per token.
                stream_cpu.setdefault((name, conns), []).append(
                    (cpu_s(pid) - c0) * 1e6 / tokens if tokens else float("nan")
                )
                bad += int(m["bad"])
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    def med(scenario: str, name: str, key: str) -> float:
        # A run in which no answer completed has no latency figure (wrk prints none).
        got = [m[key] for m in lat[(scenario, name)] if m["n"] > 0 or key == "rps"]
        return statistics.median(got) if got else float("nan")

    for scenario, _, _, _ in scenarios:
        what = (
            "saturated: the fast server (no delay), max_tokens 1"
            if scenario == "saturated"
            else f"paced: the stream server, max_tokens {args.paced_tokens} x {args.token_delay}"
        )
        print(f"\nnon-streaming, {what}, {args.connections} clients, "
              f"{args.rounds} rounds x {args.duration} (medians):")  # fmt: skip
        print(f"  {'target':8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10}"
              f" {'added p99':>10} {'CPU ms/req':>11}")  # fmt: skip
        d50, d99 = med(scenario, "direct", "p50"), med(scenario, "direct", "p99")
        added: dict[str, tuple[float, float]] = {}
        for name in targets:
            a50, a99 = med(scenario, name, "p50") - d50, med(scenario, name, "p99") - d99
            added[name] = (a50, a99)
            print(f"  {name:8} {med(scenario, name, 'rps'):8.0f} {med(scenario, name, 'p50'):8.2f}"
                  f" {med(scenario, name, 'p99'):8.2f} {a50:10.2f} {a99:10.2f}"
                  f" {med(scenario, name, 'cpu_ms'):11.3f}")  # fmt: skip
        print("  target: gpuctl added p50 <= 1 ms, p99 <= 5 ms")
        d_avg = med(scenario, "direct", "avg")
        for name in ("gpuctl", "baseline"):
            if name not in targets:
                continue
            g_avg, up = med(scenario, name, "avg"), med(scenario, name, "up_avg")
            # The server's answer as the proxy timed it (request written -> its head
            # read) against the same server called directly: on a machine whose cores
            # the load generator, the server and the proxy share, a server fronted by
            # a proxy answers more slowly although the proxy does none of that work.
            print(f"  where {name}'s added mean {g_avg - d_avg:.2f} ms goes: the server answered"
                  f" {up - d_avg:+.2f} ms slower than direct (mean {up:.2f} ms, timed by the"
                  f" proxy), the proxy's own path {g_avg - up:.2f} ms")  # fmt: skip
        if "litellm" in added:
            g, ll = added["gpuctl"], added["litellm"]
            print(f"  gpuctl / LiteLLM added latency: p50 {g[0] / ll[0]:.2f}x, p99 {g[1] / ll[1]:.2f}x"
                  " (target <= 0.5x)")  # fmt: skip
            cpu = med(scenario, "gpuctl", "cpu_ms") / med(scenario, "litellm", "cpu_ms")
            print(f"  gpuctl / LiteLLM CPU per request: {cpu:.2f}x")
    print(f"\nstreaming, {args.stream_tokens} tokens per answer, {args.token_delay} per token"
          f" (tokens/s, medians):")  # fmt: skip
    for conns in (64, 256):
        direct = statistics.median(streams[("direct", conns)])
        for name in targets:
            v = statistics.median(streams[(name, conns)])
            us = statistics.median(stream_cpu[(name, conns)])
            print(f"  {conns:3} streams  {name:8} {v:9.0f} tokens/s  {v / direct:6.1%} of direct"
                  f"  CPU {us:6.1f} us/token")  # fmt: skip
    print("  target: gpuctl >= 95 % of direct at 64 streams")
    print(f"\nerrors (non-2xx, socket): {bad}")
    # Before the run: during it, the sim servers' threads count in it too.
    print(f"load average before the run (1, 5, 15 min): {load0[0]:.1f} {load0[1]:.1f}"
          f" {load0[2]:.1f}, on {os.cpu_count()} CPUs")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
