"""Where gpuctl keeps its files: state, the simulated GPU, the config (DESIGN §3, §6).

Each path can be overridden by an environment variable; the defaults come from
``platformdirs``. Nothing here creates a directory: callers that write do that.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

SYSTEM_STATE_DIR = Path("/var/lib/gpuctl")


def _user_state_dir() -> Path:
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
    """``$GPUCTL_CONFIG``, else ``<user config dir>/config.toml``."""
    env = os.environ.get("GPUCTL_CONFIG")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_config_dir("gpuctl")) / "config.toml"
