"""``gpuctl status --watch`` in a real pseudo-terminal, ended with Ctrl-C as a person
ends it: what the screen shows afterwards."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import config_env, gpuctl_exe, tagged
from tests.term_screen import screen

COLUMNS = 100


def _read_until(fd: int, done: bytes, out: bytearray, timeout_s: float, times: int = 1) -> bool:
    """Read the terminal into ``out`` until ``done`` was written ``times`` times (False:
    the child closed it, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            return False
        if not chunk:
            return False
        out += chunk
        if out.count(done) >= times:
            return True
    return False


def test_watch_ends_with_one_header_and_a_sparkline_of_held_memory(tmp_path: Path) -> None:
    """After Ctrl-C the header was on screen twice: the terminal's "^C" echo wrapped past
    the full-width panel, and the last redraw started one line too low. The sparkline
    labelled "used" counted memory only promised to a loading service."""
    name = tagged("chat")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[hosts.gpu]\nprobe = "sim"\n\n'
        f'[services."{name}"]\nlauncher = "process"\ncommand = "sleep 600"\n'
        'health = "http://127.0.0.1:1/health"\nmemory = "120GiB"\n'
    )
    # Names the service as a word, off the GPU: LOADING, 120 GiB promised, nothing held.
    loading = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", name])
    env = {
        **config_env(cfg),
        "GPUCTL_STATE_DIR": str(tmp_path / "s"),
        "GPUCTL_SIM_DIR": str(tmp_path / "sim"),
        "COLUMNS": str(COLUMNS),
        "LINES": "50",
        "TERM": "xterm-256color",
    }
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: gpuctl on the pty (never back into pytest)
        try:
            os.execve(gpuctl_exe(), [gpuctl_exe(), "status", "--watch", "-i", "250ms"], env)
        finally:
            os._exit(127)
    out = bytearray()
    try:
        # Three frames drawn (each ends with the panel's bottom), then Ctrl-C.
        assert _read_until(fd, "─╯".encode(), out, 30, times=3), out.decode(errors="replace")
        os.write(fd, b"\x03")
        _read_until(fd, b"\x00never", out, 20)  # to the end of its output
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        loading.kill()
        loading.wait()
    text = out.decode(errors="replace")
    shown = screen(text, COLUMNS)
    assert os.waitstatus_to_exitcode(status) in (0, 130, -signal.SIGINT), status
    assert sum("Ctrl-C to quit" in ln for ln in shown) == 1, "\n".join(shown)
    assert sum(ln.startswith("╭─") for ln in shown) == 1, "\n".join(shown)
    assert "LOADING" in text, "\n".join(shown)
    (spark,) = [ln for ln in shown if ln.startswith("│ used ")]
    levels = spark.split("used", 1)[1].split()[0]
    assert set(levels) == {"▁"}, spark  # 0 of 128 GiB held, 120 GiB only promised
