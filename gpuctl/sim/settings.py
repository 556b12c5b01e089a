"""Where a simulated host lives and what GPUs it has: its directory, each GPU's total
(from the arguments, ``$GPUCTL_SIM_GPUS``, ``$GPUCTL_SIM_GPU_MEMORY``), and the GPU a
workload takes unless told (``$CUDA_VISIBLE_DEVICES``). Standard library and
``gpuctl.core`` only, like all of ``gpuctl.sim``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuctl.core.units import parse_size_mib
from gpuctl.sim.errors import SimError
from gpuctl.sim.fs import read_json, write_json_atomic

DEFAULT_TOTAL_MIB = 128 * 1024
ENV_SIM_DIR = "GPUCTL_SIM_DIR"
# The address a simulated host's servers listen on (``gpuctl sim model-server``'s default
# ``--host``): the process launcher sets it for a host with a ``sim_dir``, so two
# simulated hosts on one machine answer on loopback addresses of their own.
ENV_SIM_HOST = "GPUCTL_SIM_HOST"
ENV_GPU_MEMORY = "GPUCTL_SIM_GPU_MEMORY"
# Several simulated GPUs, each with its own total: "80GiB,80GiB" (a comma list of sizes).
ENV_GPUS = "GPUCTL_SIM_GPUS"
MAX_DEVICES = 64
# The simulated host's GPUs, as the sim commands that make it wrote them.
GPU_FILE = "gpu.json"


def default_sim_dir() -> Path:
    """``<user state dir>/gpuctl/sim``: what ``platformdirs.user_state_dir`` answers, from the
    standard library (the sim must run where platformdirs is not installed)."""
    if sys.platform == "darwin":
        base = Path("~/Library/Application Support").expanduser()
    else:
        # XDG: an empty or relative $XDG_STATE_HOME is ignored, as platformdirs does.
        xdg = os.environ.get("XDG_STATE_HOME", "").strip()
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path("~/.local/state").expanduser()
    return base / "gpuctl" / "sim"


def resolve_sim_dir(sim_dir: Path | str | None = None) -> Path:
    """The explicit directory, else ``$GPUCTL_SIM_DIR``, else the user state dir."""
    if sim_dir is not None and str(sim_dir) != "":
        return Path(sim_dir).expanduser()
    env = os.environ.get(ENV_SIM_DIR, "").strip()
    if env:
        return Path(env).expanduser()
    return default_sim_dir()


def default_gpu() -> int:
    """The simulated GPU a workload takes unless told: the first of
    ``$CUDA_VISIBLE_DEVICES`` (an index, or the sim's ``GPU-sim-N`` uuid), as a CUDA
    program would; else GPU 0. So a launcher that pins a server with
    ``CUDA_VISIBLE_DEVICES`` pins the simulated one the same way."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith("GPU-sim-"):
        first = first[len("GPU-sim-") :]
    return int(first) if first.isdigit() else 0


def parse_totals(text: str) -> tuple[int, ...]:
    """``"80GiB,40GiB"`` -> the totals of two simulated GPUs, in MiB.

    Raises:
        ValueError: an empty list, a size that is not one, or more than 64 GPUs.
    """
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not p for p in parts):
        raise ValueError(f"expected sizes separated by commas, e.g. 80GiB,80GiB: {text!r}")
    if len(parts) > MAX_DEVICES:
        raise ValueError(f"at most {MAX_DEVICES} simulated GPUs, got {len(parts)}")
    return tuple(parse_size_mib(p) for p in parts)


def positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def explicit_totals(
    total_mib: int | None, totals_mib: Sequence[int] | None
) -> tuple[int, ...] | None:
    """The totals asked for, else None (``gpu.json`` decides).

    ``totals_mib`` first; then ``$GPUCTL_SIM_GPUS``, which defines the GPUs of a host
    (so it wins over a single total, which the CLI also takes from the environment); then
    ``total_mib`` and ``$GPUCTL_SIM_GPU_MEMORY``, one GPU.
    """
    explicit: tuple[int, ...]
    if totals_mib is not None:
        explicit = tuple(totals_mib)
    elif os.environ.get(ENV_GPUS, "").strip():
        try:
            explicit = parse_totals(os.environ[ENV_GPUS])
        except ValueError as err:
            raise SimError(f"{ENV_GPUS}: {err}") from None
    elif total_mib is not None:
        explicit = (total_mib,)
    elif os.environ.get(ENV_GPU_MEMORY, "").strip():
        try:
            explicit = (parse_size_mib(os.environ[ENV_GPU_MEMORY].strip()),)
        except ValueError as err:
            raise SimError(f"{ENV_GPU_MEMORY}: {err}") from None
    else:
        return None
    if not explicit or len(explicit) > MAX_DEVICES:
        raise SimError(f"a simulated host has 1 to {MAX_DEVICES} GPUs, not {len(explicit)}")
    bad = [t for t in explicit if t <= 0]
    if bad:
        raise SimError(f"the simulated GPU's total memory must be positive, got {bad[0]} MiB")
    return explicit


def read_gpu_file(sim_dir: Path) -> tuple[int, ...] | None:
    """The GPUs' totals that ``gpu.json`` in ``sim_dir`` names; None without a sound one."""
    data = read_json(sim_dir / GPU_FILE)
    if data is None:
        return None
    devices = data.get("devices")
    if isinstance(devices, list) and 0 < len(devices) <= MAX_DEVICES:
        totals = [d.get("total_mib") if isinstance(d, dict) else None for d in devices]
        if all(positive(t) for t in totals):
            return tuple(totals)  # type: ignore[arg-type]
        return None
    value = data.get("total_mib")
    return (value,) if isinstance(value, int) and positive(value) else None


def write_gpu_file(sim_dir: Path, totals_mib: tuple[int, ...]) -> None:
    data: dict[str, Any] = {"total_mib": sum(totals_mib)}
    if len(totals_mib) > 1:
        data["devices"] = [{"total_mib": t} for t in totals_mib]
    write_json_atomic(sim_dir / GPU_FILE, data)
