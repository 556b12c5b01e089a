"""The agent's snapshot builder: a probe reading plus this host's identity, ``starting``,
and the servers its records name (``scan_servers``).

The memory rules live in ``gpuctl.core.snapshot.snapshot_from_reading``, which the direct
path (``gpuctl.adapters.local``) uses too: one way to observe a host.

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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
from msgspec.structs import replace

from gpuctl.adapters import procinfo
from gpuctl.adapters.recorded_servers import find_servers, server_children
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.store_api import read_all
from gpuctl.core.record import Phase, Record
from gpuctl.core.snapshot import (
    GpuProcess,
    HostIdentity,
    ProbeReading,
    Snapshot,
    StartingProcess,
    snapshot_from_reading,
)


class Scan(msgspec.Struct, frozen=True):
    """One probe reading and when it was taken (UTC, ISO 8601 with 'Z')."""

    reading: ProbeReading
    taken_at: str


def agent_snapshot(
    scan: Scan,
    starting: tuple[StartingProcess, ...] | None,
    *,
    host: HostIdentity,
    state_dir: str | None,
    gpu_memory_mib: int | None,
    loading: tuple[StartingProcess, ...] = (),
    servers: tuple[tuple[int, str], ...] = (),
    promised: bool = False,
) -> Snapshot:
    """The ``/status`` snapshot of one scan; ``starting`` None when no keywords were asked.

    ``loading``: servers of ours not on the GPU yet (``scan_servers``), listed
    in ``processes`` with ``on_gpu`` false and ``memory_mib`` 0 for clients of the
    original API; gpuctl's own accounting skips them (``Snapshot.gpu_processes``).
    ``servers``: (pid, service) of the servers the records name and their children.
    ``promised``: a record holds a lease or says ``starting`` (``is_idle`` is false).
    """
    snap = snapshot_from_reading(
        scan.reading,
        taken_at=scan.taken_at,
        starting=starting,
        host=host,
        state_dir=state_dir,
        gpu_memory_mib=gpu_memory_mib,
    )
    if servers or promised:
        snap = replace(snap, servers=servers, promised=promised)
    if not loading:
        return snap
    listed = {p.pid for p in snap.processes}
    extra = tuple(
        GpuProcess(pid=s.pid, command=s.command, memory_mib=0, user=s.user, on_gpu=False)
        for s in dict((s.pid, s) for s in loading if s.pid not in listed).values()
    )
    return replace(snap, processes=snap.processes + extra) if extra else snap


log = logging.getLogger("gpuctl.agent")


class Servers(msgspec.Struct, frozen=True):
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
    records, _ = read_all(store)
    return records


def scan_servers(
    store: DirectStore | None,
    match: Sequence[str] = (),
    max_age_s: float = 900.0,
    sim_dir: str | None = None,
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
            for p in procinfo.find_matching(match, sim_dir=sim_dir)
            if p.pid not in seen and p.age_s is not None and p.age_s <= max_age_s
        ]
    return Servers(tuple(recorded), tuple(loading), tuple(sorted(owners.items())), promised)
