"""The servers this host's records name, and the loading servers older clients cannot see.

The servers the records name, by handle or by start nonce, are found by
``gpuctl.adapters.recorded_servers.find_servers`` (the direct path uses it too) and
reported like any recorded server: whatever their command line says, they are that
service's, and so are the processes they forked. ``/status`` names each one's service
(``servers``), so a client attributes what they hold to it.

Clients of the original ``GET /status`` read only ``processes`` and ``is_idle``; a server
still importing and reading weights holds no GPU memory yet, so they would see an idle
GPU. For them the agent also lists, in ``processes`` with ``memory_mib: 0`` and
``on_gpu: false``, the recorded servers and the processes matching the keywords it was
started with (``--match``) that are younger than ``--match-max-age``.

``promote_ready`` completes ``starting`` -> ``running`` for a record whose health URL
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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from gpuctl.adapters import procinfo
from gpuctl.adapters.health import local_addresses
from gpuctl.adapters.recorded_servers import find_servers, server_children
from gpuctl.adapters.store import DirectStore
from gpuctl.core.health_reach import HealthReach, IpAddress
from gpuctl.core.record import Phase, Record
from gpuctl.core.redact import show_url
from gpuctl.core.snapshot import StartingProcess

log = logging.getLogger("gpuctl.agent")


@dataclass(frozen=True, slots=True)
class Servers:
    """One scan: the recorded servers (by pid or nonce) and, for ``--match``, the young
    keyword matches. Both are live, non-zombie processes; commands are redacted."""

    recorded: tuple[StartingProcess, ...] = ()
    loading: tuple[StartingProcess, ...] = ()
    # (pid, service): the recorded servers and the processes they forked, so a client
    # attributes each process (and the memory it holds) to its service.
    owners: tuple[tuple[int, str], ...] = ()
    # A record holds a lease or says ``starting``: the GPU is promised, though the
    # server may not exist yet (``Snapshot.promised``, so ``is_idle`` is false).
    promised: bool = False


def _records(store: DirectStore) -> list[Record]:
    from gpuctl.agent.store_api import read_all

    records, _ = read_all(store)
    return records


def scan_servers(
    store: DirectStore | None, match: Sequence[str] = (), max_age_s: float = 900.0
) -> Servers:
    """Runs in a worker thread (see ``TtlCell``)."""
    recorded: list[StartingProcess] = []
    owners: dict[int, str] = {}
    promised = False
    if store is not None:
        try:
            records = _records(store)
            # Read with the records, not from a reading that predates them: the app drops
            # this scan on any store write, through it or straight to the files.
            promised = any(r.lease is not None or r.phase is Phase.STARTING for r in records)
            roots = find_servers(records)
            owners = {**server_children(records, roots), **roots}
        except Exception as err:  # the store's own failure must not take /status down
            log.warning("reading the records for /status failed: %s: %s", type(err).__name__, err)
            roots = {}
            # Unread records may hold a lease: never answer idle on a store we cannot read.
            promised = True
        recorded = procinfo.describe_pids(dict.fromkeys(roots))
    loading: list[StartingProcess] = []
    if match:
        seen = {p.pid for p in recorded}
        loading = [
            p
            for p in procinfo.find_matching(match)
            if p.pid not in seen and p.age_s is not None and p.age_s <= max_age_s
        ]
    return Servers(tuple(recorded), tuple(loading), tuple(sorted(owners.items())), promised)


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
        if not url:
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
    from gpuctl.adapters.server_truth import truth_reader
    from gpuctl.adapters.store import holder_here
    from gpuctl.flows.heal import heal

    look = truth_reader(on_host=True, may_fetch=gate.allows)
    repairs = heal(store, _records(store), look, "agent", new_holder=holder_here)
    return [f"repaired {r.service}: {r.line}" for r in repairs]


def promote(store: DirectStore, service: str) -> bool:
    """``starting`` -> ``running`` (the store's touch with ``ready``; it never revives a
    stopped record). True when the record is running afterwards."""
    return store.touch(service, ready=True).phase is Phase.RUNNING


async def promote_loop(
    store: DirectStore, interval_s: float, on_change: Callable[[], None], gate: HealthGate
) -> None:
    """Every ``interval_s``: complete ``starting`` -> ``running`` for the records whose
    health URL answers 200 (runs with the app; cancelled at shutdown)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(2.0), follow_redirects=False) as client:
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
