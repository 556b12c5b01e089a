"""``gpuctl sim model-server``: a fake vLLM that behaves like the real one where gpuctl looks.

What it copies from vLLM (its readiness as a client sees it):

- It binds its port at once but listens only when the model is loaded, so a health
  check during the load gets *connection refused*, and a second server on the same
  port fails at once with "address already in use".
- It claims its GPU memory step by step while loading, after a first step with none
  (the window in which NVML does not see a model server yet: it is only "starting"),
  and dies with
  a CUDA-style out-of-memory error when a step does not fit.
- Then it serves ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``
  (JSON or SSE stream), ``GET /metrics`` (``vllm:num_requests_running``), and with
  ``--enable-sleep-mode`` ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``.
- SIGTERM/SIGINT shut it down cleanly: the memory is released and it exits 0.

Standard library, ``gpuctl.core`` and ``gpuctl.sim`` only: it also runs in a minimal container that
mounts nothing but Python and the gpuctl package, as
``python -m gpuctl.sim.model_server --name vllm --memory 80GiB --port 8000``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import threading
import time

from gpuctl.core.units import format_mib, parse_duration_s, parse_size_mib
from gpuctl.sim.console import info, log
from gpuctl.sim.engine import Engine
from gpuctl.sim.errors import SimError, SimOutOfMemory
from gpuctl.sim.gpu import Claim, SimGpu, default_gpu, parse_totals
from gpuctl.sim.http_api import Server
from gpuctl.sim.settings import ENV_SIM_HOST
from gpuctl.sim.signals import StopFlag, stop_on_signals


def _port_guard(port: int) -> socket.socket | None:
    """Hold an abstract unix socket named after the port while this server lives.

    Binding with SO_REUSEADDR (needed so a restart right after a stop is not refused
    by the old connections' TIME_WAIT) lets some kernels accept a second bind of a port
    that is bound but not listening. This name makes a second simulated server on the
    port fail at once, on every Linux kernel; the kernel drops it when we die.

    Raises:
        OSError: EADDRINUSE when another simulated server holds the port.
    """
    if not sys.platform.startswith("linux"):
        return None
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        guard.bind(f"\0gpuctl-sim-model-server-port-{port}")
    except OSError as err:
        guard.close()
        if err.errno == errno.EADDRINUSE:
            raise
        return None
    return guard


def _bind(host: str, port: int) -> socket.socket:
    """Bind (without listening) the way vLLM does before it loads its model."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        # Off while we load, so that (where the kernel checks it) another bind fails at
        # once; back on just before listen(), which checks TIME_WAIT again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except BaseException:
        sock.close()
        raise
    return sock


def _load(
    claim: Claim, memory_mib: int, load_time_s: float, *, steps: int, log_every: int, stop: StopFlag
) -> bool:
    """Claim the memory in ``steps`` equal steps over ``load_time_s``; False when stopped.

    Each step waits first: the first ``load_time_s / steps`` seconds hold no memory, like
    a server that is still importing and reading weights before its CUDA context exists.

    Raises:
        SimOutOfMemory: a step did not fit.
    """
    t0 = time.monotonic()
    for i in range(1, steps + 1):
        if not stop.sleep(t0 + load_time_s * i / steps - time.monotonic()):
            return False
        target = memory_mib * i // steps
        claim.set(target)
        if i % log_every == 0 or i == steps:
            info(f"Loading weights step {i}/{steps} ({format_mib(target)})")
    info(f"Model loading took {format_mib(memory_mib)} and {time.monotonic() - t0:.1f} seconds")
    return True


def run_model_server(
    sim: SimGpu,
    name: str,
    memory_mib: int,
    load_time_s: float,
    port: int,
    *,
    host: str = "127.0.0.1",
    steps: int = 10,
    model: str | None = None,
    log_every: int = 1,
    enable_sleep_mode: bool = False,
    token_delay_s: float = 0.02,
    engine_dies_after_s: float | None = None,
    gpu: int = 0,
) -> int:
    """Run a fake vLLM on the simulated GPU until SIGTERM/SIGINT; returns the exit code.

    Args:
        sim: the simulated GPU.
        name: the claim's name (and the model id unless ``model`` is given).
        memory_mib: the memory it holds once loaded.
        load_time_s: how long loading takes (connections are refused meanwhile).
        port: the TCP port; bound at once, listened on once loaded.
        host: the address to bind.
        steps: how many steps the memory grows in.
        model: the model id ``/v1/models`` reports; default ``name``.
        log_every: log a loading line every this many steps (the last step always logs).
        enable_sleep_mode: serve ``/sleep``, ``/wake_up`` and ``/is_sleeping``.
        token_delay_s: the time each generated token takes.
        engine_dies_after_s: once loaded, /health answers 503 after this long (the
            engine died, the server lives on), for testing how callers handle it.
        gpu: the simulated GPU it loads onto.

    Returns:
        0 after a clean stop; 1 when the port is taken, or the memory does not fit
        (a CUDA-style line on stderr).

    Raises:
        ValueError: a bad argument (steps < 1, negative times).
        SimError: the sim directory cannot be written.
    """
    if steps < 1 or log_every < 1:
        raise ValueError("steps and log_every must be at least 1")
    if load_time_s < 0 or token_delay_s < 0 or memory_mib < 0:
        raise ValueError("memory, load time and token delay cannot be negative")
    model_id = model or name
    with stop_on_signals() as stop, contextlib.ExitStack() as stack:
        try:
            guard = _port_guard(port)
            if guard is not None:
                stack.callback(guard.close)
            sock = _bind(host, port)
        except OSError as err:
            in_use = err.errno == errno.EADDRINUSE
            reason = "address already in use" if in_use else err.strerror or str(err)
            hint = (
                "another process (another model server?) holds that port; stop it or pick "
                "another --port"
                if in_use
                else "pick another --host or --port"
            )
            # An error and a hint, like every gpuctl command (not a socket's raw words).
            log(f"gpuctl: error: cannot listen on {host}:{port}: {reason}", err=True)
            log(f"  hint: {hint}", err=True)
            return 1
        stack.callback(sock.close)
        info(f"vLLM API server version 0.0.0+gpuctl.sim (pid {os.getpid()})")
        info(
            f"non-default args: model={model_id!r}, name={name!r}, host={host!r}, port={port}, "
            f"memory={format_mib(memory_mib)}, load_time={load_time_s:g}s, steps={steps}, "
            f"enable_sleep_mode={enable_sleep_mode}"
        )
        claim = stack.enter_context(sim.claim(name, gpu))
        try:
            if not _load(
                claim, memory_mib, load_time_s, steps=steps, log_every=log_every, stop=stop
            ):
                info("Shutting down before the model was loaded")
                return 0
        except SimOutOfMemory as err:
            log(f"torch.OutOfMemoryError: {err.message}", err=True)
            return 1
        dies_at = None
        if engine_dies_after_s is not None:
            dies_at = time.monotonic() + engine_dies_after_s
        engine = Engine(
            claim, memory_mib, model_id, enable_sleep_mode, token_delay_s, dies_at=dies_at
        )
        server = Server(sock, engine)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.server_activate()  # listen(): from now on connections are accepted
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        thread.start()
        shown = f"[{host}]" if ":" in host else host
        info(f"Starting vLLM API server on http://{shown}:{port}")
        info("Application startup complete.")
        while not stop.is_set and thread.is_alive():
            time.sleep(0.05)
        info("Shutting down")
        server.shutdown()
        server.server_close()
        if not stop.is_set:
            log("ERROR the HTTP server stopped on its own", err=True)
            return 1
        info(f"Finished server process [{os.getpid()}]")
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuctl.sim.model_server``: ``gpuctl sim model-server`` without Typer."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuctl.sim.model_server", description="A fake vLLM on the simulated GPU."
    )
    parser.add_argument("--name", required=True, help="claim name (and model id by default)")
    parser.add_argument("--memory", required=True, help="memory once loaded, e.g. 80GiB")
    parser.add_argument("--load-time", default="30s", help="loading time, e.g. 30s (default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--host",
        default=os.environ.get(ENV_SIM_HOST) or "127.0.0.1",
        help="the address to listen on (default: $GPUCTL_SIM_HOST, else 127.0.0.1)",
    )
    parser.add_argument("--model", help="model id for /v1/models (default: --name)")
    parser.add_argument("--steps", type=int, default=10, help="memory grows in this many steps")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--token-delay", default="20ms", help="time per generated token")
    parser.add_argument("--engine-dies-after", help="/health answers 503 this long after loading")
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
        # Zero means something here: loaded at once, no delay per token, dies at once.
        load_time = parse_duration_s(args.load_time, allow_zero=True)
        token_delay = parse_duration_s(args.token_delay, allow_zero=True)
        dies = (
            parse_duration_s(args.engine_dies_after, allow_zero=True)
            if args.engine_dies_after
            else None
        )
        total = parse_size_mib(args.gpu_memory) if args.gpu_memory else None
        totals = parse_totals(args.gpus) if args.gpus else None
        gpu = default_gpu() if args.gpu is None else args.gpu
        if gpu < 0:
            raise ValueError("--gpu must be 0 or more")
        if args.steps < 1:
            raise ValueError("--steps must be at least 1")
    except ValueError as err:
        parser.error(str(err))
    try:
        return run_model_server(
            SimGpu(args.sim_dir, total, totals_mib=totals),
            args.name,
            memory,
            load_time,
            args.port,
            host=args.host,
            steps=args.steps,
            model=args.model,
            enable_sleep_mode=args.enable_sleep_mode,
            token_delay_s=token_delay,
            engine_dies_after_s=dies,
            gpu=gpu,
        )
    except SimError as err:
        log(f"error: {err.message}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
