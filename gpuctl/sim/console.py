"""Log lines of the simulated servers, in vLLM's and uvicorn's form (``INFO ...``)."""

from __future__ import annotations

import sys
import threading

_log_lock = threading.Lock()


def log(message: str, *, err: bool = False) -> None:
    """One log line, vLLM style: ``INFO ...`` on stdout, errors on stderr."""
    stream = sys.stderr if err else sys.stdout
    with _log_lock:
        try:
            stream.write(message + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed log must not take the server down


def info(message: str) -> None:
    log(f"INFO {message}")
