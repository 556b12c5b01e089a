"""Benchmark: `gpuctl status --json` against a local sim agent, side by side with a
minimal one-command Typer app that imports httpx and rich.table and fetches the same
/status. Prints the medians and their ratio (target: at most 1.15x).

Both sides run from bytecode, as installed copies do (pip byte-compiles a wheel's
modules; the baseline's typer, httpx and rich were): PYTHONDONTWRITEBYTECODE is
dropped for the measured processes, so the warm-up runs leave gpuctl's ``.pyc`` files
behind. With it set (some shells and CI images set it) an editable checkout recompiles
every gpuctl module on every run, about 60 ms here, which measures the compiler, not
the command.

    python bench/status_cli.py [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuctl.sim.host import SimHost

BASELINE = """
import typer
import httpx
from rich.table import Table

app = typer.Typer()


@app.command()
def main(url: str, token: str) -> None:
    r = httpx.get(url, headers={"Authorization": f"Bearer {token}"})
    print(r.text)


app()
"""


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpuctl"))
    with SimHost() as host, tempfile.TemporaryDirectory() as td:
        host.start_agent()
        host.hold("comfyui", "20GiB")
        cfg = host.write_config(
            '[services.vllm]\nmatch = ["vllm"]\nmemory = "80GiB"\n'
            '[services.photos]\nmatch = ["photo-batch"]\nmemory = "30GiB"\n'
        )
        base = Path(td) / "baseline.py"
        base.write_text(BASELINE)
        env = {**os.environ, "GPUCTL_CONFIG": str(cfg)}
        if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
            print("PYTHONDONTWRITEBYTECODE dropped for the measured runs (see the docstring)")
        ours = [exe, "status", "--json"]
        theirs = [
            sys.executable,
            str(base),
            f"{host.agent_url}/status?match=vllm,photo-batch",
            host.token,
        ]
        time.sleep(0.5)
        for _ in range(3):  # warm the page cache for both
            timed(ours, env)
            timed(theirs, env)
        a: list[float] = []
        b: list[float] = []
        for _ in range(args.runs):  # interleaved, so noise hits both alike
            a.append(timed(ours, env))
            b.append(timed(theirs, env))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"gpuctl status --json        median {ma * 1000:7.1f} ms  (n={len(a)})")
    print(f"minimal typer+httpx+rich    median {mb * 1000:7.1f} ms  (n={len(b)})")
    print(f"ratio                       {ma / mb:.2f}x  (target <= 1.15x)")


if __name__ == "__main__":
    main()
