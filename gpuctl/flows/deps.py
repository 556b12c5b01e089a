"""What the flows work with: every adapter, the clock and the sleep come in as arguments.

``gpuctl.wiring.build`` builds the real ones; a test hands in fakes, or real adapters
against a loopback agent. No flow reaches for an adapter, ``time.time`` or
``time.sleep`` by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuctl.adapters.procinfo import host_identity
from gpuctl.adapters.store import Store
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.decision import Health
from gpuctl.core.model import HostIdentity, Snapshot
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Listing, Record
from gpuctl.flows.results import Progress

if TYPE_CHECKING:
    # Annotations only: ``status`` never builds a launcher, nor imports their base.
    from gpuctl.adapters.launchers.base import Handle, Launcher
    from gpuctl.core.heal import ServerTruth

# (match keywords, recorded server pids) -> the host's snapshot
SnapshotReader = Callable[[Sequence[str], Sequence[int]], Snapshot]
# (a run job's record name, its handle, the holder id of our lease on it, the snapshot)
# -> stops the job's CMD, from here or through the agent (``flows.preempt.job_stopper``);
# True when it had to be killed.
JobStopper = Callable[[str, dict[str, Any], str, Snapshot | None], bool]
# records -> {pid: service} of their servers found on this machine (the direct path:
# ``adapters.recorded_servers.find_servers``, as the agent finds them on its host)
ServerFinder = Callable[[Iterable[Record]], dict[int, str]]
# (records, {pid: service} of their servers) -> {pid: service} of the processes those
# servers forked (``adapters.recorded_servers.server_children``)
ChildFinder = Callable[[Iterable[Record], Mapping[int, str]], dict[int, str]]


@dataclass
class Closers:
    """The clients a command opened, closed once when it ends."""

    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the clients the adapters opened (agent connections, a Docker client)."""
        while self.closers:
            self.closers.pop()()


@dataclass
class EnsureDeps(Closers):
    """The adapters ``ensure``, ``stop`` and ``touch`` work with, for one service."""

    config: Config = field(kw_only=True)
    service: ServiceConfig = field(kw_only=True)
    host: HostConfig = field(kw_only=True)
    store: Store = field(kw_only=True)
    read_snapshot: SnapshotReader = field(kw_only=True)
    # The same, never from a cache: the re-check under the admission lock and a stop act
    # on it (None: ``read_snapshot`` reads fresh already, as the local probe does).
    read_snapshot_fresh: SnapshotReader | None = field(kw_only=True, default=None)
    check_health: Callable[[], Health] = field(kw_only=True)
    make_launcher: Callable[[Snapshot | None], Launcher] = field(kw_only=True)
    handle_alive: Callable[[Record], bool | None] = field(kw_only=True, default=lambda r: None)
    clock: Callable[[], float] = field(kw_only=True, default=time.time)
    sleep: Callable[[float], None] = field(kw_only=True, default=time.sleep)
    progress: Callable[[Progress], None] | None = field(kw_only=True, default=None)
    # A line for the person waiting, at once (the CLI prints it on stderr): why a wait
    # may be for nothing, rather than only after the timeout.
    notice: Callable[[str], None] | None = field(kw_only=True, default=None)
    entry: str = field(kw_only=True, default="ensure")
    # record -> what its server is seen doing (``gpuctl.adapters.server_truth``): ensure
    # first heals the phases of the host's records that lie about their servers
    # (``gpuctl.flows.heal``). None: it heals nothing.
    heal_look: Callable[[Record], ServerTruth] | None = field(kw_only=True, default=None)
    # Where each repair is said at once (the CLI's stderr, with --json too: a repair of
    # another service's record is news whatever the output). None: only the notes.
    on_repair: Callable[[str], None] | None = field(kw_only=True, default=None)
    # (base URL, sleep level) -> wakes a vLLM from sleep mode (``adapters.vllm.wake``)
    wake_server: Callable[[str, int], None] | None = field(kw_only=True, default=None)
    # Preemption: carry out a PREEMPTABLE plan (``--preempt``; the service's
    # ``preempt = true`` too), and plan victims with requests in flight (``--force``).
    preempt: bool = field(kw_only=True, default=False)
    force: bool = field(kw_only=True, default=False)
    # (another service, snapshot) -> its launcher, to stop a victim with
    launcher_for: Callable[[ServiceConfig, Snapshot | None], Launcher] | None = field(
        kw_only=True, default=None
    )
    # (another service) -> its server's requests in flight (vLLM's /metrics); None: no
    # such metric; raises GpuctlError when it cannot be read
    server_in_flight: Callable[[ServiceConfig], int | None] | None = field(
        kw_only=True, default=None
    )
    # Without an agent: the records' servers (and their children) found on this machine,
    # as the agent finds them on its host and names them in its snapshot.
    find_servers: ServerFinder | None = field(kw_only=True, default=None)
    find_children: ChildFinder | None = field(kw_only=True, default=None)
    # How a preempted run job is stopped (None: only one whose CMD runs on this machine).
    stop_job: JobStopper | None = field(kw_only=True, default=None)
    # This machine (a run job is signalled here only when its record names it).
    here: HostIdentity = field(kw_only=True, default_factory=host_identity)

    def fresh_reader(self) -> SnapshotReader:
        return self.read_snapshot_fresh or self.read_snapshot


ServiceDeps = EnsureDeps


@dataclass(frozen=True, slots=True)
class LocalProbeOptions:
    """How to read this machine's GPU when there is no agent (``status --probe``)."""

    probe: str = "auto"
    sim_dir: Path | None = None
    gpu_memory_mib: int | None = None


@dataclass
class HostDeps:
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


@dataclass
class StatusDeps(Closers):
    """The adapters ``status`` works with: every host to ask, and health checks."""

    config: Config = field(kw_only=True)
    hosts: list[HostDeps] = field(kw_only=True)
    # (health URL, timeout) -> its answer; never raises
    check_health: Callable[[str, float], Health] = field(kw_only=True)
    # (Ollama URL, model, timeout, the models other services name or None) -> the
    # model's health from /api/ps; with the others, its memory counts every model loaded
    # there but theirs (adapters.launchers.ollama.check_ollama); never raises
    check_ollama: Callable[[str, str, float, frozenset[str] | None], Health] | None = field(
        kw_only=True, default=None
    )
    # (health URL, its answer, timeout) -> "sleeping" when vLLM sleep mode says so
    check_sleeping: Callable[[str, Health, float], Health] | None = field(
        kw_only=True, default=None
    )
    health_timeout_s: float = field(kw_only=True, default=2.0)
    # (a running service) -> its server's requests in flight, as ``EnsureDeps`` has it
    server_in_flight: Callable[[ServiceConfig], int | None] | None = field(
        kw_only=True, default=None
    )
    clock: Callable[[], float] = field(kw_only=True, default=time.time)
    monotonic: Callable[[], float] = field(kw_only=True, default=time.monotonic)
    sleep: Callable[[float], None] = field(kw_only=True, default=time.sleep)


@dataclass
class LocksDeps(Closers):
    """The adapters ``locks`` works with: the store of each host asked."""

    config: Config = field(kw_only=True)
    hosts: list[HostConfig] = field(kw_only=True)
    store_of: Callable[[HostConfig], Store] = field(kw_only=True)
    clock: Callable[[], float] = field(kw_only=True, default=time.time)
    # host -> how its records' servers are seen (``gpuctl.adapters.server_truth``):
    # ``locks`` heals the phases that lie before it lists them. None: it only lists.
    look_of: Callable[[HostConfig], Callable[[Record], ServerTruth]] | None = field(
        kw_only=True, default=None
    )


def describe_handle(h: Handle) -> str:
    """A server by what its launcher recorded: ``container X``, ``pid N`` or the kind."""
    if h.container_name:
        return f"container {h.container_name}"
    return f"pid {h.pid}" if h.pid else h.kind
