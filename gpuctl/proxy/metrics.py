"""The proxy's counters and their Prometheus text (``GET /metrics``), by service.

::

    gpuctl_proxy_requests_total{service,code}         counter: service="" for no service's
    gpuctl_proxy_requests_in_flight{service}          gauge
    gpuctl_proxy_cold_starts_total{service}           counter: starts, not requests held
    gpuctl_proxy_queue_wait_seconds{service}          histogram: held before forwarding
    gpuctl_proxy_upstream_latency_seconds{service}    histogram: until the upstream's headers

Plain dicts updated on the event loop (one thread): no locks, nothing per request but
a few additions.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import msgspec

QUEUE_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram(msgspec.Struct):
    bounds: tuple[float, ...]
    counts: list[int] = msgspec.field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = []
        running = 0
        counts = self.counts or [0] * len(self.bounds)
        for bound, c in zip(self.bounds, counts, strict=True):
            running += c
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


class ProxyMetrics:
    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.cold_starts: defaultdict[str, int] = defaultdict(int)
        self.queue_wait: dict[str, Histogram] = {}
        self.upstream_latency: dict[str, Histogram] = {}

    def waited(self, service: str, seconds: float) -> None:
        h = self.queue_wait.get(service)
        if h is None:
            h = self.queue_wait[service] = Histogram(QUEUE_BUCKETS)
        h.observe(seconds)

    def upstream(self, service: str, seconds: float) -> None:
        h = self.upstream_latency.get(service)
        if h is None:
            h = self.upstream_latency[service] = Histogram(LATENCY_BUCKETS)
        h.observe(seconds)

    def render(self, services: list[str]) -> str:
        """Every configured service appears in the gauges and counters, at 0 when unused."""
        lines: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")

        head(
            "gpuctl_proxy_requests_total",
            "counter",
            "Requests answered, by service and status; service is empty for those no service "
            "answered (no such model or service, a bad key, the proxy's own endpoints).",
        )
        for (svc, code), n in sorted(self.requests.items()):
            lines.append(f'gpuctl_proxy_requests_total{{service="{_esc(svc)}",code="{code}"}} {n}')
        head("gpuctl_proxy_requests_in_flight", "gauge", "Requests being served now.")
        for svc in services:
            lines.append(
                f'gpuctl_proxy_requests_in_flight{{service="{_esc(svc)}"}} {self.in_flight[svc]}'
            )
        head(
            "gpuctl_proxy_cold_starts_total",
            "counter",
            "Times the service was started (or checked) by the ensure flow because it did "
            "not answer: once per start, however many requests it held.",
        )
        for svc in services:
            lines.append(
                f'gpuctl_proxy_cold_starts_total{{service="{_esc(svc)}"}} {self.cold_starts[svc]}'
            )
        for name, table, text in (
            (
                "gpuctl_proxy_queue_wait_seconds",
                self.queue_wait,
                "Time a request was held for its service to become ready.",
            ),
            (
                "gpuctl_proxy_upstream_latency_seconds",
                self.upstream_latency,
                "Time from forwarding a request to the upstream's response headers.",
            ),
        ):
            head(name, "histogram", text)
            for svc in sorted(table):
                lines += table[svc].lines(name, f'service="{_esc(svc)}"')
        return "\n".join(lines) + "\n"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
