"""What each use case works with: the ports it acts through (``gpuctl.flows.ports``),
and for one service's use cases a frozen request saying what the caller asks.

``gpuctl.wiring`` builds the real ports; a test hands in fakes, or real adapters against a
loopback agent. No flow reaches for an adapter, ``time.time`` or ``time.sleep`` by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpuctl.adapters.store.base import Store
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.decision import Health
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Listing, Record
from gpuctl.flows.ports import (
    ChildFinder,
    InFlightReader,
    Launchers,
    Machine,
    Probe,
    ServerChecks,
    ServerFinder,
    SnapshotReader,
    Tell,
)

if TYPE_CHECKING:
    # Annotations only: ``status`` never builds a launcher, nor imports their base.
    from gpuctl.adapters.launchers.base import Handle
    from gpuctl.core.heal import ServerTruth


class Closers(msgspec.Struct):
    """The clients a command opened, closed once when it ends."""

    closers: list[Callable[[], None]] = msgspec.field(default_factory=list)

    def close(self) -> None:
        """Close the clients the adapters opened (agent connections, a Docker client)."""
        while self.closers:
            self.closers.pop()()


class EnsureRequest(msgspec.Struct, frozen=True):
    """What the caller of ``ensure`` (or ``resume``) asks: a value, never changed by a flow."""

    # Who asks (the lease's ``entry``: ensure, api, proxy, resume, reclaim, run…).
    entry: str = "ensure"
    # How long to wait for ready (None: the service's ``health_timeout``).
    timeout_s: float | None = None
    # Wait for the server to answer; False: return once its start is recorded.
    wait: bool = True
    # Carry out a PREEMPTABLE plan (``--preempt``; the service's ``preempt = true`` too).
    preempt: bool = False
    # Plan victims with requests in flight too (``--force``).
    force: bool = False
    # Use the copy that is there (READY, asleep: woken, LOADING: waited for), never start
    # one: where it would launch or preempt, ``ensure`` raises ``JoinEnded`` instead. The
    # pool's join: a start there goes through the pool's own rules (its lease, and no
    # start while one of its hosts cannot be asked).
    join_only: bool = False


class EnsureDeps(Closers, kw_only=True):
    """The ports ``ensure``, ``stop``, ``touch`` and ``resume`` act through, for one service."""

    config: Config
    service: ServiceConfig
    host: HostConfig
    store: Store
    probe: Probe
    launchers: Launchers
    servers: ServerChecks
    machine: Machine
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    tell: Tell = msgspec.field(default_factory=Tell)


class LocalProbeOptions(msgspec.Struct, frozen=True):
    """How to read this machine's GPU when there is no agent (``status --probe``)."""

    probe: str = "auto"
    sim_dir: Path | None = None
    gpu_memory_mib: int | None = None


class HostDeps(msgspec.Struct):
    """One host as ``status`` sees it: its store's records and its snapshot."""

    host: HostConfig
    source: str  # the agent's URL, or which local probe
    read_records: Callable[[], Listing | list[Record]]
    read_snapshot: SnapshotReader
    find_servers: ServerFinder | None = None
    find_children: ChildFinder | None = None
    # The store's in-flight counts (``Store.inflight``), for the victims of PREEMPTABLE;
    # raises GpuctlError when they cannot be read. None: nothing counts as a victim.
    read_inflight: Callable[[], Mapping[str, int]] | None = None
    # The store's ``gpuctl run --wait`` queue (``Store.waiters``): a service that fits is
    # BUSY while a higher-priority head waits for its room, as ``ensure`` refuses it.
    # Raises GpuctlError when it cannot be read. None: no queue to ask.
    read_waiters: Callable[[], Sequence[Waiter]] | None = None


class StatusDeps(Closers, kw_only=True):
    """The adapters ``status`` works with: every host to ask, and health checks."""

    config: Config
    hosts: list[HostDeps]
    # This machine: a run job is a victim only where it can be signalled from here or by
    # the host's agent.
    machine: Machine
    # (health URL, timeout) -> its answer; never raises
    check_health: Callable[[str, float], Health]
    # (Ollama URL, model, timeout, the models other services name or None) -> the
    # model's health from /api/ps; with the others, its memory counts every model loaded
    # there but theirs (adapters.launchers.ollama.check_ollama); never raises
    check_ollama: Callable[[str, str, float, frozenset[str] | None], Health] | None = None
    # (health URL, its answer, timeout) -> "sleeping" when vLLM sleep mode says so
    check_sleeping: Callable[[str, Health, float], Health] | None = None
    health_timeout_s: float = 2.0
    # (a running service) -> its server's requests in flight, as ``ServerChecks`` has it
    server_in_flight: InFlightReader | None = None
    clock: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


class LocksDeps(Closers, kw_only=True):
    """The adapters ``locks`` works with: the store of each host asked."""

    config: Config
    hosts: list[HostConfig]
    store_of: Callable[[HostConfig], Store]
    machine: Machine
    clock: Callable[[], float] = time.time
    # host -> how its records' servers are seen (``gpuctl.wiring`` builds it):
    # ``locks`` heals the phases that lie before it lists them. None: it only lists.
    look_of: Callable[[HostConfig], Callable[[Record], ServerTruth]] | None = None


def describe_handle(h: Handle) -> str:
    """A server by what its launcher recorded: ``container X``, ``pid N`` or the kind."""
    if h.container_name:
        return f"container {h.container_name}"
    if h.job_id:
        return f"Slurm job {h.job_id}"
    return f"pid {h.pid}" if h.pid else h.kind
