"""The fake vLLM's ``/metrics``: the series vLLM's own Grafana dashboard reads.

Names and types as vLLM exports them (``vllm/engine/metrics.py``, ``vllm/v1/metrics``):
requests running and waiting, successes, prompt and generation token counters, the
time-to-first-token histogram (vLLM's buckets), and the KV-cache usage gauge under its
current name (``vllm:kv_cache_usage_perc``) and the one older dashboards read
(``vllm:gpu_cache_usage_perc``). Values are fractions and seconds, as in vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class Histogram:
    """A Prometheus histogram: cumulative buckets, a sum and a count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: str) -> list[str]:
        out = [
            f'{name}_bucket{{{labels},le="{le}"}} {float(n)}'
            for le, n in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        return out


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the engine reports at scrape time."""

    running: int
    waiting: int
    succeeded: int
    kv_cache_usage: float  # 0.0-1.0
    cancelled: int = 0  # streams whose client went away mid-answer (the sim's own counter)


class VllmMetrics:
    """Counters and the TTFT histogram, updated by the request threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)

    def render(self, model_id: str, g: Gauges) -> str:
        escaped = model_id.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        labels = f'model_name="{escaped}"'
        lab = f"{{{labels}}}"
        with self.lock:
            prompt, generation = self.prompt_tokens, self.generation_tokens
            ttft = self.ttft.samples("vllm:time_to_first_token_seconds", labels)
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{lab} {float(g.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{lab} {float(g.waiting)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{lab} {float(g.succeeded)}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{lab} {float(prompt)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{lab} {float(generation)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *ttft,
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{lab} {g.kv_cache_usage}",
            "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage "
            "(the name before vLLM V1; older dashboards read it).",
            "# TYPE vllm:gpu_cache_usage_perc gauge",
            f"vllm:gpu_cache_usage_perc{lab} {g.kv_cache_usage}",
            # Not a vLLM metric (vLLM logs "Aborted request"): the tests count with it
            # that a client going away cancels the request.
            "# HELP gpuctl_sim_requests_cancelled_total Requests aborted because their client "
            "went away mid-answer.",
            "# TYPE gpuctl_sim_requests_cancelled_total counter",
            f"gpuctl_sim_requests_cancelled_total{lab} {float(g.cancelled)}",
        ]
        return "\n".join(lines) + "\n"
