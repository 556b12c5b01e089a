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
        # Sleep mode, as vLLM's CuMemAllocator does it. The memory is in two tagged
        # pools; the sim splits it in half (a 32B model on an 80 GiB card is about that).
        self.asleep: set[str] = set()  # the pools given back: "weights", "kv_cache"
        self.host_mib = 0  # weights parked in CPU memory by a level-1 sleep
        self.weights_lost = False  # a level-2 sleep discarded them: reload_weights first
        self.epoch = 0  # a sleep in "abort" mode ends every request of an older epoch

    def pool_mib(self, tag: str) -> int:
        """The GPU memory of one sleep-mode pool."""
        weights = self.memory_mib // 2
        return weights if tag == "weights" else self.memory_mib - weights

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
