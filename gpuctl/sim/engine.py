"""The fake vLLM's state, shared by its request threads: memory, sleep mode, counters."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from gpuctl.sim.gpu import Claim


class Engine:
    """The server's state, shared by the request threads."""

    def __init__(
        self,
        claim: Claim,
        memory_mib: int,
        model_id: str,
        enable_sleep_mode: bool,
        token_delay_s: float,
        *,
        dies_at: float | None = None,
    ) -> None:
        self.dies_at = dies_at
        self.claim = claim
        self.memory_mib = memory_mib
        self.model_id = model_id
        self.enable_sleep_mode = enable_sleep_mode
        self.token_delay_s = token_delay_s
        self.started = int(time.time())
        self.lock = threading.Lock()
        self.sleep_lock = threading.Lock()  # one sleep/wake at a time
        self.running = 0
        self.succeeded = 0
        self.sleeping = False
        self.sleep_level = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count a request as running (``vllm:num_requests_running``) while it is served."""
        with self.lock:
            self.running += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            with self.lock:
                self.running -= 1
                self.succeeded += ok
