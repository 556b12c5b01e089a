"""Outside text reaches the terminal escaped and the JSON as strict UTF-8: a process
whose argv carries escape sequences, a raw byte, a newline, DEL and Rich markup, on the
simulated GPU, seen by `gpuctl status` (plain and --wide) through a pseudo-terminal
and by `--json` through a strict decoder."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from typing import Any

import pytest

from gpuctl.core.safe_text import json_safe, visible
from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl_exe, tagged

# ESC [2J clears the screen, ESC ]0;pwn BEL retitles the terminal; \udcff is the raw
# byte 0xff as Python reads a non-UTF-8 argv.
HOSTILE = "A\x1b[2J\x1b]0;pwn\x07B\nC\x7fD\udcffE[bold red]F\u202eG"


def test_visible_escapes_controls_bytes_and_bidi() -> None:
    assert visible(HOSTILE) == ("A\\x1b[2J\\x1b]0;pwn\\x07B\\x0aC\\x7fD\\xffE[bold red]F\\u202eG")
    assert visible("a\nb\tc\x9b", keep_newlines=True) == "a\nb\\x09c\\x9b"
    assert visible("plain — ünïcode ✓ C:\\x") == "plain — ünïcode ✓ C:\\x"
    assert visible(visible(HOSTILE)) == visible(HOSTILE)  # idempotent


def test_json_safe_replaces_only_lone_surrogates() -> None:
    got = json_safe({"k\udc80": ["x\udcff", "\ud800", "\x1b", 3, None]})
    assert got == {"k\\x80": ["x\\xff", "\\ud800", "\x1b", 3, None]}
    json.dumps(got).encode("utf-8", errors="strict")


def test_safe_console_never_interprets_data() -> None:
    import io

    from rich.table import Table

    from gpuctl.render.safe import console, plain

    out = io.StringIO()
    c = console(file=out, force_terminal=True, width=200)
    t = Table()
    t.add_row("raw[bold]cell\x1b[2J", plain(HOSTILE))  # a forgotten plain() is caught too
    c.print(t)
    text = out.getvalue()
    assert "\x1b[2J" not in text and "\x07" not in text and "\x1b]" not in text
    assert "raw[bold]cell" in text and "[bold red]" in text


def _through_a_pty(args: list[str], env: dict[str, str]) -> bytes:
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=slave, stdin=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    proc.wait(timeout=30)
    return out


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


@pytest.mark.e2e
def test_hostile_argv_in_status_tty_and_json(sim_host: SimHost) -> None:
    name = tagged("evil")
    cfg = sim_host.write_config(f'[services.{name}]\nmatch = ["{name}"]\nmemory = "120GiB"\n')
    hold = sim_host.hold(name + HOSTILE, "20GiB")
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg), "COLUMNS": "250", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    deadline = time.monotonic() + 20
    while True:
        r = subprocess.run(
            [gpuctl_exe(), "status", "--json"], env=env, capture_output=True, check=False
        )
        obj = json.loads(r.stdout.decode("utf-8", errors="strict"))
        cmds = [p["command"] or "" for h in obj["hosts"] for p in h["processes"]]
        mine = [c for c in cmds if name in c]
        if (mine and "pwn" in mine[0]) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert mine, (r.stderr, cmds, hold.poll())
    for s in _strings(obj):
        s.encode("utf-8", errors="strict")  # no lone surrogate left
    # The data is kept (controls are JSON-escaped data), the raw byte as `\xff`.
    assert "\x1b[2J" in mine[0] and "\\xff" in mine[0]

    for extra in ([], ["--wide"]):
        out = _through_a_pty([gpuctl_exe(), "status", *extra], env)
        assert name.encode() in out, out
        assert b"\x1b[" in out  # a terminal: Rich styled it (so raw bytes would reach one)
        # Rich's own styles are ESC [ ... m; the data's clear-screen, title and bell are not.
        assert b"\x1b[2J" not in out and b"\x1b]" not in out and b"\x07" not in out, out
        assert b"\xff" not in out and b"\x7f" not in out
        assert b"\\x1b[2J\\x1b]0;pwn\\x07B" in out, out
        # Markup in argv is shown as typed, not turned into a style.
        assert b"[bold red]" in out, out
