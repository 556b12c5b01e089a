"""Where gpuctl keeps its files: state (records, locks, logs), the simulated GPU, the config.

Each path can be overridden by an environment variable; the defaults come from
``platformdirs``. Nothing here creates a directory: callers that write do that.
This is the one place that reads ``GPUCTL_CONFIG`` and ``GPUCTL_STATE_DIR``. The sim,
which runs on the standard library alone, reads ``GPUCTL_SIM_DIR`` itself
(``gpuctl.sim.gpu.default_sim_dir``; a test keeps the two defaults equal).
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_STATE_DIR = Path("/var/lib/gpuctl")


def _user_state_dir() -> Path:
    import platformdirs  # about 6 ms: only when no variable or system dir decides

    return Path(platformdirs.user_state_dir("gpuctl"))


def default_state_dir() -> Path:
    """``$GPUCTL_STATE_DIR``, else ``/var/lib/gpuctl`` when writable, else the user state dir.

    The system directory wins when an administrator made it for us, so that every user's
    agent and cron job on the GPU host meet in one store.
    """
    env = os.environ.get("GPUCTL_STATE_DIR")
    if env:
        return Path(env).expanduser()
    if SYSTEM_STATE_DIR.is_dir() and os.access(SYSTEM_STATE_DIR, os.W_OK | os.X_OK):
        return SYSTEM_STATE_DIR
    return _user_state_dir()


def default_sim_dir() -> Path:
    """``$GPUCTL_SIM_DIR``, else ``<user state dir>/sim``: the simulated GPU's directory."""
    env = os.environ.get("GPUCTL_SIM_DIR")
    if env:
        return Path(env).expanduser()
    return _user_state_dir() / "sim"


def default_config_path() -> Path:
    """``<user config dir>/gpuctl/config.toml`` (``~/.config/gpuctl/config.toml`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_config_dir("gpuctl")) / "config.toml"


def config_path(explicit: Path | None = None) -> tuple[Path, bool]:
    """Where the config is read from, and whether the user named it.

    ``--config`` (``explicit``), else ``$GPUCTL_CONFIG``, else the default path. A named
    file must exist; a missing default file is an empty config.
    """
    if explicit is not None:
        return explicit.expanduser(), True
    env = os.environ.get("GPUCTL_CONFIG", "").strip()
    if env:
        return Path(env).expanduser(), True
    return default_config_path(), False
