"""Redaction throughput, this tree against main's, measured side by side in one run.

``/status`` redacts every process's command line on every scan, so a slower redaction
is a slower status. The lines: this machine's own processes (``/proc/*/cmdline``) and
typical GPU-host command lines, some carrying secrets.

    python bench/redact_bench.py [--ref main] [--rounds 5]

Prints lines per second for each and the ratio (this tree / the ref; above 1 is slower).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

TYPICAL = [
    "python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct --port 8000"
    " --gpu-memory-utilization 0.9 --max-model-len 32768 --api-key sk-live-abcdef123456",
    "vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 2 --max-num-seqs 256",
    "jupyter server --ServerApp.token=abc123def456 --port 8888 --no-browser",
    "/usr/bin/python3 /opt/conda/bin/jupyter-lab --ip=0.0.0.0 --allow-root",
    "sh -c curl -H 'Authorization: Bearer tok_zzzz' https://h/v1/models?api_key=k1&a=1",
    "ollama serve",
    "torchrun --nproc_per_node 8 train.py --config cfg.yaml --output_dir /data/run1",
    "HF_TOKEN=hf_abcdefgh python train.py --model_name_or_path gpt2 --per_device_batch 8",
    "/usr/lib/systemd/systemd-journald",
    "docker run -p 8000:8000 --gpus all -e HF_TOKEN=x vllm/vllm-openai:latest",
]


def own_processes() -> list[list[str]]:
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if raw:
            out.append([a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")])
    return out


def load_ref(ref: str) -> ModuleType:
    src = subprocess.run(
        ["git", "show", f"{ref}:gpuctl/core/redact.py"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "redact_ref.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("redact_ref", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rate(mod: ModuleType, lines: list[list[str]], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for argv in lines:
            mod.redact_argv(argv)
        best = min(best, time.perf_counter() - t0)
    return len(lines) / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import gpuctl.core.redact as here

    lines = own_processes() + [t.split() for t in TYPICAL] * 20
    ref = load_ref(args.ref)
    # Interleaved, best of each: the machine is shared.
    r_ref, r_here = 0.0, 0.0
    for _ in range(3):
        r_ref = max(r_ref, rate(ref, lines, args.rounds))
        r_here = max(r_here, rate(here, lines, args.rounds))
    print(f"{len(lines)} command lines")
    print(f"{args.ref}: {r_ref:,.0f} lines/s")
    print(f"this tree: {r_here:,.0f} lines/s")
    print(f"time ratio (this tree / {args.ref}): {r_ref / r_here:.2f}x")


if __name__ == "__main__":
    main()
