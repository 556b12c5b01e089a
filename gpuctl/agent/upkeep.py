"""The agent's upkeep of its host's records: the loop that completes starts and heals
the phases that lie about their servers, so a host stays true when no command looks.

``promote_loop`` completes ``starting`` -> ``running`` for a record whose health URL
answers 200 (a URL the agent may fetch: this machine's, on ``--health-ports``;
``HealthGate``), so a start whose launcher went away (``--no-wait``, a killed caller) does
not stay ``starting`` until the next ``ensure``. The same loop heals the other phases
that lie about their server on this host (``gpuctl.flows.heal``): a ``preempted`` record
whose server runs, a ``running`` one whose server is gone, an abandoned ``starting``, so
a host heals within seconds even when no command looks, and a read-only client's
``status`` only has to report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

import httpx

from gpuctl.adapters.health import local_addresses
from gpuctl.adapters.http_clients import async_http_client
from gpuctl.adapters.recorded_servers import truth_reader
from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.store_api import read_all
from gpuctl.config.slurm_fields import names_node
from gpuctl.core.health_reach import HealthReach, IpAddress
from gpuctl.core.record import Phase, Record
from gpuctl.core.redact import show_url
from gpuctl.flows.heal import heal

log = logging.getLogger("gpuctl.agent")


def _records(store: DirectStore) -> list[Record]:
    records, _ = read_all(store)
    return records


# Refused URLs remembered so each is logged once; forgotten all at once past this many.
_MAX_REPORTED = 1024


class HealthGate:
    """Whether the agent may fetch a record's health URL (``core.health_reach``), logging
    each refused URL once: a refused record is reported, not logged every round."""

    def __init__(
        self,
        reach: HealthReach,
        local: Callable[[], Collection[IpAddress]] = local_addresses,
    ) -> None:
        self.reach = reach
        self._local = local
        self._reported: set[tuple[str, str]] = set()

    def allows(self, record: Record) -> bool:
        url = record.health
        if not url or names_node(url):
            # A Slurm job's `{node}` left unexpanded (a record of an older gpuctl): the
            # agent cannot know the node, and that text is no URL to fetch.
            return False
        why = self.reach.refusal(url, self._local())
        if why is None:
            return True
        key = (record.service, url)
        if key not in self._reported:
            if len(self._reported) >= _MAX_REPORTED:
                self._reported.clear()
            self._reported.add(key)
            log.warning(
                "not fetching the health URL %s of %s: %s; its phase is left as it is "
                "(pass its port to `gpuctl agent --health-ports`, or fix its health)",
                show_url(url),
                record.service,
                why,
            )
        return False


def starting_with_health(store: DirectStore, gate: HealthGate) -> list[Record]:
    """Records that wait for their server to answer: phase starting, a health URL the
    agent may fetch."""
    return [r for r in _records(store) if r.phase is Phase.STARTING and r.health and gate.allows(r)]


def heal_here(store: DirectStore, gate: HealthGate) -> list[str]:
    """One heal pass over this host's records (the agent is on the host: pids count);
    the repairs done, as log lines."""
    look = truth_reader(on_host=True, may_fetch=gate.allows)
    repairs = heal(store, _records(store), look, "agent", new_holder=holder_here)
    return [f"repaired {r.service}: {r.line}" for r in repairs]


def promote(store: DirectStore, service: str) -> bool:
    """``starting`` -> ``running`` (the store's touch with ``ready``; it never revives a
    stopped record). True when the record is running afterwards."""
    return store.touch(service, ready=True, entry="agent").phase is Phase.RUNNING


async def promote_loop(
    store: DirectStore, interval_s: float, on_change: Callable[[], None], gate: HealthGate
) -> None:
    """Every ``interval_s``: complete ``starting`` -> ``running`` for the records whose
    health URL answers 200 (runs with the app; cancelled at shutdown)."""
    # async_http_client: TLS (the CA bundle, ~25 ms of CPU) is set up only if a health
    # URL is https://, not at every agent start.
    async with async_http_client(2.0) as client:
        while True:
            await asyncio.sleep(interval_s)
            try:
                waiting = await asyncio.to_thread(starting_with_health, store, gate)
                for record in waiting:
                    assert record.health is not None
                    try:
                        answer = await client.get(record.health)
                    except httpx.HTTPError:
                        continue  # still loading (refused, reset, slow): the next round
                    if answer.status_code == 200 and await asyncio.to_thread(
                        promote, store, record.service
                    ):
                        log.info("%s answers its health check: running", record.service)
                        on_change()
            except Exception as err:  # never let the loop die: the next round retries
                log.warning("completing starts failed: %s: %s", type(err).__name__, err)
            try:
                repaired = await asyncio.to_thread(heal_here, store, gate)
                for line in repaired:
                    log.warning("%s", line)
                if repaired:
                    on_change()
            except Exception as err:  # as above
                log.warning("healing phases failed: %s: %s", type(err).__name__, err)
