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
        ("80.5", 'services.web.memory: a bare number means MiB and must be whole, got 80.5: '
                 'write "80.5GiB" or "81MiB"'),
        ('"0.25"', "services.web.memory: a bare number means MiB and must be whole, got '0.25': "
                   'write "0.25GiB" or "1MiB"'),
    ],
)  # fmt: skip
def test_a_fractional_bare_budget_is_refused_not_cut(
    tmp_path: Path, memory: str, said: str
) -> None:
    """``memory = 80.5`` was shown as 80MiB by `config show`: cut silently. Bare is MiB
    (documented), so a fraction is refused with the two things the user may have meant."""
    for cmd in ("check", "show"):
        r = check(tmp_path, f'match = ["web"]\nmemory = {memory}\n', cmd)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr == f"gpuctl: error: {said}\n", r.stderr


def test_a_small_bare_budget_passes_the_check_with_a_warning(tmp_path: Path) -> None:
    """``memory = 20`` is 20 MiB (documented), almost surely 20 GiB meant: the check says
    so, names the key and both fixes, and still passes; a unit, or 1 GiB and more, is quiet."""
    r = check(tmp_path, 'match = ["web"]\nmemory = 20\n')
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        "warning: services.web.memory: the bare number 20 means 20 MiB; "
        'write "20GiB" if you meant GiB, or "20MiB" to keep it\n'
    )
    assert r.stdout.endswith(": ok (1 host, 1 service)\n"), r.stdout
    r = check(tmp_path, 'match = ["web"]\nmemory = "1023"\n')
    assert r.returncode == 0 and "services.web.memory: the bare number '1023'" in r.stderr
    for quiet in ('"20MiB"', '"20GiB"', "1024", "80.0e3"):
        r = check(tmp_path, f'match = ["web"]\nmemory = {quiet}\n')
        assert (r.returncode, r.stderr) == (0, ""), (quiet, r.stderr)
    # Only the check says it: status, which every script runs, does not repeat it.
    env = dict(os.environ, GPUCTL_CONFIG=str(tmp_path / "c.toml"))
    env.update(GPUCTL_STATE_DIR=str(tmp_path / "s"), GPUCTL_SIM_DIR=str(tmp_path / "sim"))
    (tmp_path / "c.toml").write_text(BASE + 'match = ["web"]\nmemory = 20\n')
    st = subprocess.run(
        [gpuctl_exe(), "status", "--json"], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert st.returncode == 0 and "warning" not in st.stderr, st.stderr
