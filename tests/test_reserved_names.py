"""Service names that start with ``_`` are the store's own (``_admission``, ``_inflight``,
``_reclaim``): a service named so shared their lock and record, and deadlocked. The
config refuses them with a located error; the store still takes its own names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.config import parse_config
from gpuctl.core.names import is_service_name, is_valid_name
from gpuctl.errors import ConfigError
from tests.conftest import gpuctl_exe


@pytest.mark.parametrize("name", ["_admission", "_inflight", "_reclaim", "_x"])
def test_config_check_refuses_a_reserved_service_name(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[hosts.local]\nprobe = "sim"\n\n[services.{name}]\nlauncher = "process"\n'
        f'command = "sleep 1"\nhealth = "http://127.0.0.1:9/health"\nmatch = ["x"]\n'
    )
    env = dict(os.environ, GPUCTL_CONFIG=str(cfg), GPUCTL_STATE_DIR=str(tmp_path / "s"))
    r = subprocess.run(
        [gpuctl_exe(), "config", "check"], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(
        f"gpuctl: error: services.{name}: a service name may not start with '_'"
    )
    with pytest.raises(ConfigError, match="may not start with '_'"):
        parse_config({"hosts": {"dgx": {}}, "services": {name: {}}})


def test_the_store_still_takes_its_own_names(tmp_path: Path) -> None:
    assert is_valid_name("_admission") and not is_service_name("_admission")
    store = DirectStore(tmp_path / "state")
    h = holder_here("test")
    granted, _ = store.acquire("_admission", h, 10)
    assert granted
    store.release("_admission", h.id)
