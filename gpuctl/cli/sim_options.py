"""The options the ``gpuctl sim`` commands share (kept apart: sim_cmd.py stays short)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gpuctl.cli.common import size_parser

SimDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--sim-dir",
        help="Simulated GPU directory. Default: $GPUCTL_SIM_DIR, else <user state dir>/sim.",
        envvar="GPUCTL_SIM_DIR",
        show_envvar=False,
        metavar="DIR",
    ),
]

# `sim ls` reads what `status` reads: a configured simulated host's folder comes first.
LsSimDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--sim-dir",
        help=(
            "Simulated GPU directory. Default: $GPUCTL_SIM_DIR, else the sim_dir of the "
            'config\'s host with probe = "sim", else <user state dir>/sim.'
        ),
        envvar="GPUCTL_SIM_DIR",
        show_envvar=False,
        metavar="DIR",
    ),
]


def _gpu_memory_opt(help_text: str) -> Any:
    return typer.Option(
        "--gpu-memory",
        parser=size_parser("--gpu-memory ($GPUCTL_SIM_GPU_MEMORY)"),
        help=help_text,
        envvar="GPUCTL_SIM_GPU_MEMORY",
        show_envvar=False,
        metavar="SIZE",
    )


GpuMemoryOpt = Annotated[
    int | None,
    _gpu_memory_opt(
        "Total memory of the simulated GPU, e.g. 128GiB; saved in the sim dir for every "
        "process that uses it. Default: $GPUCTL_SIM_GPU_MEMORY, else the saved value, "
        "else 128GiB."
    ),
]
# A reader's: used only where the sim dir has no gpu.json yet (never saved).
ReadGpuMemoryOpt = Annotated[
    int | None,
    _gpu_memory_opt(
        "Total of the simulated GPU while the sim dir has no gpu.json (a listing never "
        "saves it; where gpu.json differs, it is read, with a warning). Default: "
        "$GPUCTL_SIM_GPU_MEMORY, else 128GiB."
    ),
]
GpuIndexOpt = Annotated[
    int | None,
    typer.Option(
        "--gpu",
        help=(
            "The simulated GPU to claim on. Default: the first of $CUDA_VISIBLE_DEVICES, "
            "else 0. Several GPUs: GPUCTL_SIM_GPUS=80GiB,80GiB."
        ),
        min=0,
        metavar="INDEX",
    ),
]
NameOpt = Annotated[
    str,
    typer.Option(
        "--name",
        help="What the process is called (its command line carries it).",
        show_default=False,
        metavar="NAME",
    ),
]
