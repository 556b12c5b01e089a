"""The console script's first step: a Ctrl-C while gpuctl's modules load (the first tenth
of a second of every command) ends the command with exit 130 and one line, as a Ctrl-C
during its work does, not with a traceback from whichever import it landed in. Nothing
has been read or written by then, so nothing is left to undo."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _interrupted_while_loading(signum: int, frame: FrameType | None) -> None:
    try:
        sys.stderr.write("gpuctl: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def main() -> None:
    """``gpuctl``: load the app with Ctrl-C ending quietly, then run it with Ctrl-C as a
    KeyboardInterrupt again (each command gives back what it holds on its way out)."""
    # Only where Ctrl-C raises KeyboardInterrupt: a SIGINT that the shell made ignored
    # (a background job) stays ignored.
    quiet = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if quiet:
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from gpuctl import failpoints

    failpoints.hit("cli.loading")
    from gpuctl.cli.app import main as run

    if quiet:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    run()
