"""The sim walkthrough of README's "Try it" (and docs/tutorial/try-it.md), run as a
reader pastes it: nothing it starts is left holding the simulated GPU, and no background
job prints into the next command's output."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpuctl.sim.host import free_port
from tests.conftest import gpuctl_exe, tagged

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def walkthrough(page: Path) -> str:
    """The page's shell block that starts with `cat > sim.toml`."""
    blocks = re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith("cat > sim.toml")]
    return block


@pytest.mark.parametrize("page", ["README.md", "docs/tutorial/try-it.md"])
def test_the_sim_walkthrough_leaves_nothing_behind(page: str, tmp_path: Path) -> None:
    block = walkthrough(ROOT / page)
    # A port of its own, a shorter load, and a service name no other test's process
    # carries (the default match is the name: another run's `--name vllm` would count as
    # this one loading); the rest as written.
    port = str(free_port())
    script = (
        block.replace("8000", port)
        .replace("--load-time 20s", "--load-time 1s")
        .replace("vllm", tagged("vllm"))
    )
    env = {
        "PATH": f"{Path(gpuctl_exe()).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GPUCTL_SIM_DIR": str(tmp_path / "sim"),
        "GPUCTL_STATE_DIR": str(tmp_path / "state"),
        "COLUMNS": "120",
        "NO_COLOR": "1",
        "LANG": "C.UTF-8",
    }

    def sim(*args: str) -> str:
        return subprocess.run(
            [gpuctl_exe(), "sim", *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    try:
        r = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "FITS" in r.stdout and "comfyui" in r.stdout, r.stdout
        # The background hold's own lines went to its log, not into status's output.
        assert "holding" not in r.stdout + r.stderr, r.stdout + r.stderr
        # Nothing left on the simulated GPU: the hold was stopped, not left for ten
        # minutes (it releases its claim as it exits, a moment after the kill).
        deadline = time.monotonic() + 10
        while "no claims" not in (left := sim("ls")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "no claims: the GPU is idle" in left, left
    finally:
        sim("reset", "--all")
