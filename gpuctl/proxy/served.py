"""The requests the proxy served for each service, told to the journal in batches.

``gpuctl usage`` counts every request the proxy served (PROXY REQ), not only those it
held through a cold start. The request path already counts each answer in the proxy's
metrics (``ProxyMetrics.requests``: one dict increment); nothing is added to it. Every
``EVERY_S`` (and once when the proxy stops) what those counts grew by is told as one
``proxy`` event per service (``requests_served``, over ``period_s``), from a worker
thread, through each host's store (a pooled service's: where the proxy last found its
copy): a journal write per minute and service, never one per request.

Served: answered with a status below 500, other than 429. A 5xx is a server that
failed or a start the proxy could not make; a 429 is the proxy's own refusal
(``max_concurrent`` in flight). ``gpuctl_proxy_requests_total{code}`` has every answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gpuctl import failpoints
from gpuctl.config import Config
from gpuctl.errors import GpuctlError

log = logging.getLogger("gpuctl.proxy")

# How often the counts are told; a test shortens it (failpoint ``proxy.served_every``).
EVERY_S = 60.0


def served(code: int) -> bool:
    return code < 500 and code != 429


class ServedBatches:
    """What the proxy's answer counts grew by since the last batch, per service."""

    def __init__(
        self,
        conf: Config,
        requests: Mapping[tuple[str, int], int],
        clock: Callable[[], float] = time.monotonic,
        where: Mapping[str, str] | None = None,
    ) -> None:
        self.conf = conf
        # service -> the host of its pool that served it (the proxy's own map, read
        # only); a service not in it is told on its first host.
        self.where: Mapping[str, str] = {} if where is None else where
        self.requests = requests  # the metrics' own counts, read on the event loop
        self.clock = clock
        self.told: dict[str, int] = {}
        self.since = clock()
        self.every_s = failpoints.seconds("proxy.served_every", EVERY_S)

    def due(self) -> tuple[list[tuple[str, int]], float]:
        """(service, requests served since the last batch), and the seconds it spans.
        Call it on the event loop (where the counts move)."""
        totals: dict[str, int] = {}
        for (svc, code), n in list(self.requests.items()):
            if served(code):
                totals[svc] = totals.get(svc, 0) + n
        batch = [(s, n - self.told.get(s, 0)) for s, n in totals.items()]
        batch = [(s, n) for s, n in batch if n > 0]
        self.told = totals
        now = self.clock()
        period, self.since = now - self.since, now
        return batch, period

    def tell(self, batch: list[tuple[str, int]], period_s: float) -> None:
        """One event per service, through each host's store; never raises."""
        from gpuctl.adapters.store import store_for
        from gpuctl.flows import story

        by_host: dict[str, list[tuple[str, int]]] = {}
        for name, n in batch:
            svc = self.conf.services.get(name)
            if svc is not None:
                host = self.where.get(name, svc.host)
                by_host.setdefault(host, []).append((name, n))
        for host, counts in by_host.items():
            try:
                store = store_for(self.conf.host(host))
            except GpuctlError as e:
                log.warning("cannot tell %s's served requests: %s", host, e.message)
                continue
            try:
                events = [
                    story.ev("proxy", name, "proxy", requests_served=n, period_s=round(period_s, 3))
                    for name, n in counts
                ]
                story.tell(store, *events)
            finally:
                store.close()

    async def flush(self) -> None:
        batch, period = self.due()
        if batch:
            await asyncio.to_thread(self.tell, batch, period)

    async def loop(self) -> None:
        """Every ``every_s``, the batch (runs with the app; cancelled at shutdown)."""
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.flush()
            except Exception as err:  # never let the loop die: the next round tells it
                log.warning("telling served requests failed: %s: %s", type(err).__name__, err)
