"""``gpuctl sim hold``: a process that holds simulated GPU memory until it is stopped.

It stands for the workloads gpuctl does not manage (ComfyUI, a video encode, someone's
notebook): it claims its memory at once, like a process that creates its CUDA context
first thing, and holds it until SIGTERM/SIGINT or the end of ``duration_s``.

Standard library and ``gpuctl.sim`` only, so it also runs as
``python -m gpuctl.sim.hold --name comfyui --memory 20GiB`` where nothing else is installed.
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuctl.core.units import format_duration, format_mib, parse_duration_s, parse_size_mib
from gpuctl.sim.errors import SimError, SimOutOfMemory
from gpuctl.sim.gpu import SimGpu, default_gpu, parse_totals
from gpuctl.sim.signals import stop_on_signals


def run_hold(
    sim: SimGpu, name: str, memory_mib: int, duration_s: float | None = None, gpu: int = 0
) -> int:
    """Claim ``memory_mib`` on ``sim`` as ``name`` and hold it; returns the exit code.

    Args:
        sim: the simulated GPU.
        name: what the claim is called (``gpuctl sim ls`` shows it).
        memory_mib: the memory to hold.
        duration_s: release and exit after this long; None holds until a signal.
        gpu: the simulated GPU to hold it on.

    Returns:
        0 after a clean stop, 1 when the memory does not fit (a CUDA-style line on stderr).
    """
    with stop_on_signals() as stop, sim.claim(name, gpu) as claim:
        try:
            claim.set(memory_mib)
        except SimOutOfMemory as err:
            print(f"torch.OutOfMemoryError: {err.message}", file=sys.stderr, flush=True)
            return 1
        until = f" for {format_duration(duration_s)}" if duration_s is not None else ""
        print(
            f"INFO holding {format_mib(memory_mib)} of simulated GPU {gpu} as {name!r} "
            f"(pid {os.getpid()}){until}; stop with SIGTERM or Ctrl-C",
            flush=True,
        )
        stop.sleep(duration_s if duration_s is not None else float("inf"), step=0.1)
        print(f"INFO released {format_mib(memory_mib)} ({name!r})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuctl.sim.hold``: the same as ``gpuctl sim hold``, without Typer."""
    parser = argparse.ArgumentParser(prog="python -m gpuctl.sim.hold", description=__doc__)
    parser.add_argument("--name", required=True, help="what the claim is called")
    parser.add_argument("--memory", required=True, help="memory to hold, e.g. 20GiB")
    parser.add_argument("--duration", help="release and exit after this long, e.g. 10m")
    parser.add_argument("--sim-dir", help="simulated GPU directory (default $GPUCTL_SIM_DIR)")
    parser.add_argument("--gpu-memory", help="total memory of the simulated GPU, e.g. 128GiB")
    parser.add_argument(
        "--gpus", help="several simulated GPUs, one total each: 80GiB,80GiB ($GPUCTL_SIM_GPUS)"
    )
    parser.add_argument(
        "--gpu",
        type=int,
        help="the GPU to claim on (default: first of $CUDA_VISIBLE_DEVICES, else 0)",
    )
    args = parser.parse_args(argv)
    try:
        memory = parse_size_mib(args.memory)
        duration = parse_duration_s(args.duration) if args.duration else None
        total = parse_size_mib(args.gpu_memory) if args.gpu_memory else None
        totals = parse_totals(args.gpus) if args.gpus else None
        gpu = default_gpu() if args.gpu is None else args.gpu
        if gpu < 0:
            raise ValueError("--gpu must be 0 or more")
    except ValueError as err:
        parser.error(str(err))
    try:
        return run_hold(
            SimGpu(args.sim_dir, total, totals_mib=totals), args.name, memory, duration, gpu
        )
    except SimError as err:
        print(f"error: {err.message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
