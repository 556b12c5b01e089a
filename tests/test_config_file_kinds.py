"""Files a person names (the config, token files) that are not small regular files:
``/dev/zero`` was read without end (8.6 GB), a FIFO blocked gpuctl in ``open``. Now each
is refused at once with a located error, and ``config check`` flags it. The installed
CLI on real files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import gpuctl_exe


def run(args: list[str], cfg: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUCTL_CONFIG=str(cfg), GPUCTL_STATE_DIR=str(tmp / "state"))
    env.pop("GPUCTL_DEBUG", None)
    return subprocess.run(
        [gpuctl_exe(), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _fifo(tmp: Path) -> Path:
    path = tmp / "fifo"
    os.mkfifo(path)
    return path


def _big(tmp: Path) -> Path:
    path = tmp / "big"
    path.write_bytes(b"t" * (2 * 1024 * 1024))
    return path


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda tmp: Path("/dev/zero"), "is a device, not a regular file"),
        (_fifo, "is a FIFO, not a regular file"),
        (_big, "is larger than 64 KiB"),
    ],
    ids=["dev-zero", "fifo", "2MiB"],
)
def test_a_token_file_that_is_no_small_file_fails_config_check(
    tmp_path: Path, make: object, said: str
) -> None:
    token = make(tmp_path)  # type: ignore[operator]
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[hosts.dgx]\nagent = "http://127.0.0.1:9"\ntoken_file = "{token}"\n')
    r = run(["config", "check"], cfg, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"hosts.dgx.token_file: {token} {said}" in r.stderr, r.stderr
    r = run(["status", "--json"], cfg, tmp_path)
    assert r.returncode == 4 and said in r.stdout, r.stdout + r.stderr  # at once: no hang


@pytest.mark.parametrize("which", ["dev-zero", "fifo", "2MiB"])
def test_a_config_file_that_is_no_small_file_is_a_located_error(tmp_path: Path, which: str) -> None:
    cfg = {"dev-zero": Path("/dev/zero"), "fifo": _fifo(tmp_path), "2MiB": _big(tmp_path)}[which]
    r = run(["config", "check"], cfg, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"gpuctl: error: config file {cfg} is "), r.stderr
    assert "Traceback" not in r.stderr
