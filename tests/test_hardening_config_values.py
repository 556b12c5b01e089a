"""Config values that passed and should not have (or that need a decision): a 1e-300 s
health timeout, ``match = []``; and ``idle_timeout = "Never"``, which is taken as
"never" (case does not matter, as for every keyword). The installed CLI on real files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import gpuctl_exe

BASE = (
    '[hosts.local]\nprobe = "sim"\n\n[services.web]\nlauncher = "process"\n'
    'command = "sleep 60"\nhealth = "http://127.0.0.1:9/health"\n'
)


def check(tmp_path: Path, extra: str, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE + extra)
    env = dict(os.environ, GPUCTL_CONFIG=str(cfg), GPUCTL_STATE_DIR=str(tmp_path / "s"))
    return subprocess.run(
        [gpuctl_exe(), "config", *(args or ("check",))], env=env, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ('match = ["web"]\nhealth_timeout = 1e-300\n',
         "services.web.health_timeout: a duration must be at least 1ms, got 1e-300"),
        ('match = ["web"]\nhealth_timeout = "0.5ms"\n',
         "services.web.health_timeout: a duration must be at least 1ms"),
        ("match = []\n", "services.web.match: an empty list: name at least one keyword"),
    ],
)  # fmt: skip
def test_refused_with_a_located_error(tmp_path: Path, extra: str, said: str) -> None:
    r = check(tmp_path, extra)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"gpuctl: error: {said}"), r.stderr


def test_never_in_any_case_is_never(tmp_path: Path) -> None:
    r = check(tmp_path, 'match = ["web"]\nidle_timeout = "Never"\nhealth_timeout = "1ms"\n')
    assert r.returncode == 0, r.stderr
    shown = check(tmp_path, 'match = ["web"]\nidle_timeout = "NEVER"\n', "show")
    assert 'idle_timeout = "never"' in shown.stdout, shown.stdout
