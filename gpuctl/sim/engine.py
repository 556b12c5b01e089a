"""The fake vLLM's state, shared by its request threads: memory, sleep mode, counters."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from gpuctl.sim.gpu import Claim
from gpuctl.sim.vllm_metrics import Gauges, VllmMetrics

# The KV cache the fake engine has room for, in tokens: a 32B model with an 80 GiB
# budget holds about this much. Requests in flight fill it (the KV-cache usage gauge).
KV_CACHE_TOKENS = 65536


class Request:
    """One request in flight: its tokens count as generated, the first one times TTFT."""

    def __init__(self, engine: Engine, prompt_tokens: int) -> None:
        self._engine = engine
        self._t0 = time.monotonic()
        self._first = True
        self._ended = False
        self.kv_tokens = prompt_tokens

    def token(self) -> None:
        """Call once per generated token, when it is sent."""
        e = self._engine
        with e.metrics.lock:
            e.metrics.generation_tokens += 1
            if self._first:
                e.metrics.ttft.observe(time.monotonic() - self._t0)
                self._first = False
        with e.lock:
            self.kv_tokens += 1
            e.kv_tokens += 1

    def end(self, ok: bool = True) -> None:
        """The engine is done with the request: it leaves ``num_requests_running`` and the
        KV cache before its last bytes go out, as vLLM's scheduler finishes a request
        before the API server sends the answer. So a client that has the whole answer
        never reads itself as still running. Once only; later calls do nothing."""
        e = self._engine
        with e.lock:
            if self._ended:
                return
            self._ended = True
            e.running -= 1
            e.succeeded += ok
            e.kv_tokens -= self.kv_tokens
        e.report_util()


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
        self.cancelled = 0  # requests whose client went away mid-answer
        self.sleeping = False
        self.sleep_level = 0
        # Sleep mode, as vLLM's CuMemAllocator does it. The memory is in two tagged
        # pools; the sim splits it in half (a 32B model on an 80 GiB card is about that).
        self.asleep: set[str] = set()  # the pools given back: "weights", "kv_cache"
        self.host_mib = 0  # weights parked in CPU memory by a level-1 sleep
        self.weights_lost = False  # a level-2 sleep discarded them: reload_weights first
        self.epoch = 0  # a sleep in "abort" mode ends every request of an older epoch
        self.metrics = VllmMetrics()
        self.kv_tokens = 0  # the KV cache the requests in flight hold
        self._util_lock = threading.Lock()

    def pool_mib(self, tag: str) -> int:
        """The GPU memory of one sleep-mode pool."""
        weights = self.memory_mib // 2
        return weights if tag == "weights" else self.memory_mib - weights

    @contextlib.contextmanager
    def request(self, prompt_tokens: int = 0) -> Iterator[Request]:
        """Count a request as running (``vllm:num_requests_running``) while it is served,
        and keep the GPU busy meanwhile (the claim's utilisation, which the probes read)."""
        req = Request(self, prompt_tokens)
        with self.metrics.lock:
            self.metrics.prompt_tokens += prompt_tokens
        with self.lock:
            self.running += 1
            self.kv_tokens += prompt_tokens
        self.report_util()
        ok = False
        try:
            yield req
            ok = True
        finally:
            req.end(ok)

    def busy_pct(self) -> int:
        """How busy the GPU is: idle at 0; one request keeps it at 70 %, each more adds 10."""
        with self.lock:
            running = self.running
        return 0 if running == 0 else min(100, 60 + 10 * running)

    def report_util(self) -> None:
        # One writer at a time, so a late "0" cannot overwrite a newer "70".
        with self._util_lock:
            self.claim.set_util(self.busy_pct())

    def gauges(self) -> Gauges:
        with self.lock:
            return Gauges(
                running=self.running,
                waiting=0,
                succeeded=self.succeeded,
                kv_cache_usage=min(1.0, self.kv_tokens / KV_CACHE_TOKENS),
                cancelled=self.cancelled,
            )
