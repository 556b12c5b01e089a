"""Drive a real interactive shell through a pseudo-terminal: type, press TAB, read back.

A completion test that calls the completion function by hand skips what breaks in
practice (the loader ignoring the file, the first TAB completing nothing), so these tests
do what a user does: start ``bash -i`` / ``zsh -i`` / ``fish -i`` on a terminal, load the
shipped file the way that shell loads completions, type a partial command and press TAB.

To read the completed line without parsing the line editor's escape sequences, the test
then jumps to the start of the line (Ctrl-A), types ``echo <marker>`` in front of it and
presses Enter: the shell prints the completed command line after a marker that only the
*execution* of echo produces (``X$((6*7))X`` prints ``X42X``, which the typed text never
contains).
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

# What each shell evaluates to the marker "X42X".
MARKER_EXPR = {"bash": "X$((6*7))X", "zsh": "X$((6*7))X", "fish": "X(math 6 '*' 7)X"}
MARKER = "X42X"
# A prompt the tests can wait for; typed as '@'ps1'@ ' so the echo of typing it does not match.
PROMPT = "@ps1@ "
SET_PROMPT = {
    "bash": "PS1='@'ps1'@ '",
    "zsh": "PROMPT='@'ps1'@ '",
    "fish": "function fish_prompt; echo -n '@'ps1'@ '; end",
}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\x1b\][^\x07]*\x07|\r")


class ShellPty:
    """One interactive shell on a pseudo-terminal, 200 columns wide."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=cwd,
            start_new_session=True,
            # The shell becomes the session leader with the pty as its terminal.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.buf = ""

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def read_until(self, pattern: str, timeout: float = 60.0) -> str:
        """Everything read so far, once ``pattern`` (a regex) matches the plain text."""
        deadline = time.monotonic() + timeout
        while True:
            plain = ANSI.sub("", self.buf)
            m = re.search(pattern, plain)
            if m:
                return plain
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {pattern!r}; the shell showed:\n{plain[-3000:]}"
                )
            r, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the shell exited
                    data = b""
                if not data and self.proc.poll() is not None:
                    raise AssertionError(f"the shell exited; it showed:\n{plain[-3000:]}")
                self.buf += data.decode(errors="replace")

    def run(self, command: str, shell: str, timeout: float = 60.0) -> None:
        """Run a set-up command and wait for the next prompt.

        Keys typed before the prompt is drawn reach a line editor that is not reading yet;
        zsh then lets a TAB in them fail, so every command waits for its prompt.
        """
        self.send(f"{command}; {SET_PROMPT[shell]}; echo {MARKER_EXPR[shell]}done\r")
        self.read_until(MARKER + "done" + r"[\s\S]*" + re.escape(PROMPT), timeout)
        self.buf = ""

    def complete(self, typed: str, shell: str, tabs: int = 1, timeout: float = 60.0) -> str:
        """Type ``typed``, press TAB ``tabs`` times, and return the line the shell then holds.

        The keys are typed ahead: the line editor reads them one by one and answers each
        TAB (which runs ``gpuctl``) before it reads the next key, as it does for a fast typist.
        """
        self.buf = ""
        self.send(typed + "\t" * tabs + "\x01" + f"echo {MARKER_EXPR[shell]} " + "\r")
        pattern = MARKER + r" ?(.*)\n"
        out = self.read_until(pattern + r"[\s\S]*" + re.escape(PROMPT), timeout)
        self.buf = ""
        self.last_output = out
        return re.findall(pattern, out)[-1].strip()

    def close(self) -> None:
        """Hang up: closing the terminal's master side sends the shell SIGHUP (an
        ``exit`` typed at it may wait on a half-typed line or a completion menu)."""
        os.close(self.master)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
