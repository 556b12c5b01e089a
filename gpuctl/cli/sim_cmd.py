"""``gpuctl sim ...``: the simulated GPU host (docs/reference/commands.md), built of real processes.

The simulator's modules are imported inside the commands: ``gpuctl --help`` must not
pay for them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from gpuctl.cli.common import (
    JsonOpt,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    print_json,
    say,
    size_parser,
)
from gpuctl.cli.sim_options import (
    GpuIndexOpt,
    GpuMemoryOpt,
    LsSimDirOpt,
    NameOpt,
    ReadGpuMemoryOpt,
    SimDirOpt,
)
from gpuctl.errors import GpuctlError, UsageError

sim_app = typer.Typer(
    help=(
        "A simulated GPU host made of real processes: memory claims held by live processes, "
        "a fake vLLM that loads, serves and runs out of memory like the real one. "
        "`gpuctl status --probe sim` and `gpuctl agent --probe sim` read it."
    ),
    no_args_is_help=True,
)


@contextmanager
def _sim_errors() -> Iterator[None]:
    """The sim raises its own errors (it imports no gpuctl module outside ``core``)."""
    from gpuctl.sim.errors import SimError

    try:
        yield
    except SimError as err:
        raise GpuctlError(err.message, err.hint) from err


def register(app: typer.Typer) -> None:
    """Add ``gpuctl sim`` to ``app``."""
    app.add_typer(sim_app, name="sim", short_help="A simulated GPU host made of real processes.")


@sim_app.command("hold", short_help="Hold simulated GPU memory until stopped.")
def hold(
    memory: Annotated[
        int,
        typer.Option(
            "--memory",
            "-m",
            parser=size_parser("--memory"),
            help="Memory to hold, e.g. 20GiB.",
            show_default=False,
            metavar="SIZE",
        ),
    ],
    name: NameOpt,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            parser=duration_parser("--duration"),
            help="Release and exit after this long, e.g. 10m. Default: until stopped.",
            metavar="DURATION",
        ),
    ] = None,
    sim_dir: SimDirOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    gpu: GpuIndexOpt = None,
) -> None:
    """Hold simulated GPU memory until SIGTERM/Ctrl-C, like ComfyUI or a notebook would.

    Exit 0 after a clean stop; 1 with a CUDA-style out-of-memory line when it does not fit.
    """
    with errors_to_exit(), _sim_errors():
        mib, secs, total = memory, duration, gpu_memory
        from gpuctl.sim.gpu import SimGpu, default_gpu
        from gpuctl.sim.hold import run_hold

        index = default_gpu() if gpu is None else gpu
        raise typer.Exit(run_hold(SimGpu(sim_dir, total), name, mib, secs, index))


@sim_app.command("model-server", short_help="A fake vLLM that loads slowly, then serves.")
def model_server(
    *,
    name: NameOpt,
    memory: Annotated[
        int,
        typer.Option(
            "--memory",
            "-m",
            parser=size_parser("--memory"),
            help="Memory once loaded, e.g. 80GiB.",
            show_default=False,
            metavar="SIZE",
        ),
    ],
    load_time: Annotated[
        float,
        typer.Option(
            "--load-time",
            parser=duration_parser("--load-time", allow_zero=True),
            help="How long loading takes; the port refuses meanwhile.  [default: 30s]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = 30.0,
    port: Annotated[
        int, typer.Option("--port", "-p", help="TCP port.", min=1, max=65535, metavar="PORT")
    ] = 8000,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            envvar="GPUCTL_SIM_HOST",
            help="Address to bind (a simulated pool host's launcher sets GPUCTL_SIM_HOST).",
            metavar="ADDR",
        ),
    ] = "127.0.0.1",
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model id for /v1/models. Default: --name.", metavar="MODEL"),
    ] = None,
    steps: Annotated[
        int,
        typer.Option("--steps", help="The memory grows in this many steps.", min=1, metavar="N"),
    ] = 10,
    enable_sleep_mode: Annotated[
        bool,
        typer.Option("--enable-sleep-mode", help="Serve /sleep, /wake_up and /is_sleeping."),
    ] = False,
    token_delay: Annotated[
        float,
        typer.Option(
            "--token-delay",
            parser=duration_parser("--token-delay", allow_zero=True),
            help="Time per generated token.  [default: 20ms]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = 0.02,
    engine_dies_after: Annotated[
        float | None,
        typer.Option(
            "--engine-dies-after",
            parser=duration_parser("--engine-dies-after", allow_zero=True),
            help="Once loaded, /health answers 503 after this long (a dead engine).",
            metavar="DURATION",
        ),
    ] = None,
    sim_dir: SimDirOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    gpu: GpuIndexOpt = None,
) -> None:
    """A fake vLLM: binds its port at once, loads (refusing connections), then serves.

    Serves /health, /v1/models (and /v1/models/ID), /v1/chat/completions (also
    streaming), /v1/completions, /v1/embeddings, /v1/audio/transcriptions and /metrics.
    Exit 0 after SIGTERM/Ctrl-C; 1 when the port is taken or the memory does not fit.
    """
    with errors_to_exit(), _sim_errors():
        mib, load_s, delay_s, total = memory, load_time, token_delay, gpu_memory
        dies_s = engine_dies_after
        from gpuctl.sim.gpu import SimGpu, default_gpu
        from gpuctl.sim.model_server import run_model_server

        code = run_model_server(
            SimGpu(sim_dir, total),
            name,
            mib,
            load_s,
            port,
            host=host,
            steps=steps,
            model=model,
            enable_sleep_mode=enable_sleep_mode,
            token_delay_s=delay_s,
            engine_dies_after_s=dies_s,
            gpu=default_gpu() if gpu is None else gpu,
        )
        raise typer.Exit(code)


@sim_app.command("ollama", short_help="A fake Ollama that loads models on demand.")
def ollama(
    *,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="A model it can load, NAME=SIZE, e.g. qwen3:32b=20GiB (repeatable). "
            "Default: qwen3:32b=20GiB.",
            show_default=False,
            metavar="NAME=SIZE",
        ),
    ] = None,
    port: Annotated[
        int, typer.Option("--port", "-p", help="TCP port.", min=1, max=65535, metavar="PORT")
    ] = 11434,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind.", metavar="ADDR")
    ] = "127.0.0.1",
    load_time: Annotated[
        float,
        typer.Option(
            "--load-time",
            parser=duration_parser("--load-time", allow_zero=True),
            help="How long loading a model takes.  [default: 2s]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = 2.0,
    keep_alive: Annotated[
        str,
        typer.Option(
            "--keep-alive",
            help="Default keep_alive, as OLLAMA_KEEP_ALIVE: 5m, 0 (unload at once), -1 (forever).",
            metavar="DURATION",
        ),
    ] = "5m",
    token_delay: Annotated[
        float,
        typer.Option(
            "--token-delay",
            parser=duration_parser("--token-delay", allow_zero=True),
            help="Time per generated token.  [default: 20ms]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = 0.02,
    sim_dir: SimDirOpt = None,
    gpu_memory: GpuMemoryOpt = None,
) -> None:
    """A fake Ollama: loads models on demand as claims on the simulated GPU.

    Serves /api/ps, /api/generate, /api/chat, /api/embed, /api/tags, /api/show,
    /api/pull and the OpenAI-compatible /v1/chat/completions; keep_alive 0 unloads. Exit 0 after SIGTERM/Ctrl-C; 1 when
    the port is taken.
    """
    with errors_to_exit(), _sim_errors():
        from gpuctl.sim.ollama import run_ollama
        from gpuctl.sim.ollama_models import parse_keep_alive, parse_model_spec

        try:
            models = [parse_model_spec(m) for m in model or ["qwen3:32b=20GiB"]]
            keep_s = parse_keep_alive(keep_alive)
        except ValueError as err:
            fail(UsageError(str(err)))
        load_s, delay_s, total = load_time, token_delay, gpu_memory
        from gpuctl.sim.gpu import SimGpu

        code = run_ollama(
            SimGpu(sim_dir, total),
            models,
            port,
            host=host,
            load_time_s=load_s,
            keep_alive_s=keep_s,
            token_delay_s=delay_s,
        )
        raise typer.Exit(code)


@sim_app.command("ls")
def ls(
    json_out: JsonOpt = False,
    sim_dir: LsSimDirOpt = None,
    gpu_memory: ReadGpuMemoryOpt = None,
) -> None:
    """List the simulated GPU's claims: pid, name, memory, command."""
    with errors_to_exit(), _sim_errors():
        from gpuctl.flows.sim_ops import configured_sim_dir, list_claims
        from gpuctl.render.sim_view import sim_ls_text, sim_ls_to_json
        from gpuctl.wiring.build import this_machine

        if sim_dir is not None:
            from_env = os.environ.get("GPUCTL_SIM_DIR") == str(sim_dir)
            source = "$GPUCTL_SIM_DIR" if from_env else "--sim-dir"
        else:
            sim_dir, source = configured_sim_dir(open_config(None))
        listing = list_claims(sim_dir, gpu_memory, source, command_of=this_machine().command_of)
        if listing.warning:
            say(f"warning: {listing.warning}")
        if json_out:
            print_json(sim_ls_to_json(listing))
            return
        from gpuctl.core.safe_text import visible

        for line in sim_ls_text(listing):
            print(visible(line))  # a claimant's command line, escaped


@sim_app.command("reset", short_help="Remove dead claims (--all: stop every claimant).")
def reset(
    all_claims: Annotated[
        bool,
        typer.Option("--all", help="Also stop the live claimants (SIGTERM, then wait)."),
    ] = False,
    wait: Annotated[
        float,
        typer.Option(
            "--wait",
            parser=duration_parser("--wait", allow_zero=True),
            help="With --all: how long to wait for them to exit.  [default: 10s]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = 10.0,
    sim_dir: SimDirOpt = None,
) -> None:
    """Remove dead claims; with --all, stop every live claimant too.

    Exit 0 when the simulated GPU ends up as asked; 1 when a claimant outlived --wait.
    """
    with errors_to_exit(), _sim_errors():
        wait_s = wait
        from gpuctl.sim.gpu import SimGpu

        sim = SimGpu(sim_dir)
        removed = sim.prune()
        say(f"removed {removed} dead claim{'s' if removed != 1 else ''} from {sim.sim_dir}")
        if not all_claims:
            return
        live = sim.claims()
        pids = sorted({c.pid for c in live})
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            except PermissionError:
                say(f"cannot stop pid {pid}: permission denied")
        if pids:
            say(
                f"sent SIGTERM to {len(pids)} process{'es' if len(pids) != 1 else ''}: "
                + ", ".join(map(str, pids))
            )
        deadline = time.monotonic() + wait_s
        left = sim.claims()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = sim.claims()
        if left:
            names = ", ".join(f"{c.pid} ({c.name})" for c in left)
            say(f"still holding memory after {wait}: {names}")
            sys.stderr.flush()
            raise typer.Exit(1)
