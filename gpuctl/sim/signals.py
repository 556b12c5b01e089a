"""Stop flags for the simulated workloads: SIGTERM and SIGINT end them cleanly."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StopFlag:
    """Set by SIGTERM/SIGINT; polled by the simulated workloads' main loops.

    A flag polled every few tens of milliseconds, not an Event waited on: a signal
    handler that sets an Event can deadlock against the main thread inside ``wait``.
    """

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def is_set(self) -> bool:
        return self.signal is not None

    def sleep(self, seconds: float, step: float = 0.05) -> bool:
        """Sleep up to ``seconds``; return False as soon as a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while not self.is_set:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(step, left))
        return False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM and SIGINT into a ``StopFlag`` for the block (main thread only)."""
    import signal

    flag = StopFlag()

    def handler(signum: int, _frame: object) -> None:
        flag.signal = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
