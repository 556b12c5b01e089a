"""Config values that passed and should not have (or that need a decision): a 1e-300 s
health timeout, ``match = []``; and ``idle_timeout = "Never"``, which is taken as
"never" (case does not matter, as for every keyword). The CLI in process on real files;
the installed one for ``status``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import gpuctl_exe, gpuctl_in_process

BASE = (
    '[hosts.local]\nprobe = "sim"\n\n[services.web]\nlauncher = "process"\n'
    'command = "sleep 60"\nhealth = "http://127.0.0.1:9/health"\n'
)


def check(tmp_path: Path, extra: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuctl config ARGS`` (default ``check``) on BASE + ``extra``, in this process."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE + extra)
    argv = ("config", *(args or ("check",)))
    return gpuctl_in_process(cfg, *argv, env={"GPUCTL_STATE_DIR": str(tmp_path / "s")})


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


@pytest.mark.parametrize(
    ("memory", "said"),
    [
        ("20", 'a size needs its unit, got 20: write "20GiB" or "20MiB"'),
        ('"1023"', "a size needs its unit, got '1023': write \"1023GiB\" or \"1023MiB\""),
        ("80.5", 'a size needs its unit, got 80.5: write "80.5GiB" or "81MiB"'),
        ('"0.25"', "a size needs its unit, got '0.25': write \"0.25GiB\" or \"1MiB\""),
    ],
)  # fmt: skip
def test_a_bare_budget_is_refused_naming_both_readings(
    tmp_path: Path, memory: str, said: str
) -> None:
    """``memory = 20`` was silently 20 MiB (a budget that fits beside anything), when 20
    GiB was meant; ``80.5`` was cut. Every command refuses it the same way."""
    for cmd in ("check", "show"):
        r = check(tmp_path, f'match = ["web"]\nmemory = {memory}\n', cmd)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr == f"gpuctl: error: services.web.memory: {said}\n", r.stderr
    env = dict(os.environ, GPUCTL_CONFIG=str(tmp_path / "c.toml"))
    env.update(GPUCTL_STATE_DIR=str(tmp_path / "s"), GPUCTL_SIM_DIR=str(tmp_path / "sim"))
    st = subprocess.run(
        [gpuctl_exe(), "status", "--json"], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert st.returncode == 1 and f"services.web.memory: {said}" in st.stderr, st.stderr
    for fine in ('"20MiB"', '"20GiB"', '"1.5G"'):
        r = check(tmp_path, f'match = ["web"]\nmemory = {fine}\n')
        assert (r.returncode, r.stderr) == (0, ""), (fine, r.stderr)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--memory", "10", "--", "true"],
        ["agent", "--gpu-memory", "10"],
        ["sim", "hold", "--name", "x", "--memory", "10"],
    ],
)
def test_a_bare_size_on_the_command_line_is_refused_the_same(
    tmp_path: Path, argv: list[str]
) -> None:
    """``gpuctl run --memory 10`` was 10 MiB: the same refusal as the config's, exit 2."""
    env = dict(os.environ, GPUCTL_CONFIG=str(tmp_path / "none.toml"))
    env.update(GPUCTL_STATE_DIR=str(tmp_path / "s"), GPUCTL_SIM_DIR=str(tmp_path / "sim"))
    r = subprocess.run(
        [gpuctl_exe(), *argv], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert 'a size needs its unit, got \'10\': write "10GiB" or "10MiB"' in r.stderr, r.stderr
