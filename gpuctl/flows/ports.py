"""The ports the flows work through: what a flow needs of the world, as small interfaces.

A flow never reaches for a concrete adapter (``gpuctl/flows/ruff.toml`` fences them off):
``gpuctl.wiring`` builds the real ones and hands them in; a test hands in fakes, or real
adapters against a loopback agent. The interfaces a flow names by type (``Store``,
``Launcher``, ``Handle``) live beside their implementations in ``gpuctl.adapters.store.base``
and ``gpuctl.adapters.launchers.base``, the only adapter modules a flow may import.

The ports of one service's use cases (``ensure``, ``stop``, ``touch``, ``resume``) come in
groups, each a frozen value: ``Probe`` (how the host is read), ``Launchers`` (how servers and
run jobs are started and stopped), ``ServerChecks`` (what the servers answer), ``Tell``
(where the person waiting hears of it), and the ``Machine`` this process runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Health
from gpuctl.core.record import Holder, Record
from gpuctl.core.snapshot import HostIdentity, Snapshot
from gpuctl.flows.results import Progress

if TYPE_CHECKING:
    from gpuctl.adapters.launchers.base import Launcher
    from gpuctl.core.heal import ServerTruth

# (match keywords, recorded server pids) -> the host's snapshot
SnapshotReader = Callable[[Sequence[str], Sequence[int]], Snapshot]
# (a run job's record name, its handle, the holder id of our lease on it, the snapshot)
# -> stops the job's CMD, from here or through the agent (``wiring.build.run_job_stopper``);
# True when it had to be killed.
JobStopper = Callable[[str, dict[str, Any], str, Snapshot | None], bool]
# records -> {pid: service} of their servers found on this machine (the direct path,
# as the agent finds them on its host)
ServerFinder = Callable[[Iterable[Record]], dict[int, str]]
# (records, {pid: service} of their servers) -> {pid: service} of the processes those
# servers forked
ChildFinder = Callable[[Iterable[Record], Mapping[int, str]], dict[int, str]]
# (another service, snapshot) -> its launcher, to stop a victim with
VictimLauncher = Callable[[ServiceConfig, Snapshot | None], "Launcher"]
# (a running service) -> its server's requests in flight (vLLM's /metrics); None: no such
# metric; raises GpuctlError when it cannot be read
InFlightReader = Callable[[ServiceConfig], int | None]


class Machine(Protocol):
    """This machine and this process: who holds a lease, and what a pid here is.

    A lease, an in-flight entry or a queue entry names its holder by host, boot, pid and
    the pid's start time, so a holder killed here is told from a live one."""

    @property
    def here(self) -> HostIdentity:
        """This machine's host name and boot id."""
        ...

    def holder(self, entry: str) -> Holder:
        """A fresh holder for this process (a new id per call), for the entry point."""
        ...

    def start_time(self, pid: int) -> float | None:
        """When ``pid`` started (None: no such process here)."""
        ...

    def is_same_process(self, pid: int, started: float | None) -> bool:
        """Whether ``pid`` still runs the process that started at ``started``."""
        ...

    def command_of(self, pid: int) -> str | None:
        """The command line of ``pid`` (None: not readable)."""
        ...


class JobChild(Protocol):
    """A run job's CMD, forked and held before it runs (``gpuctl run`` records it first)."""

    pid: int
    # The job's mark in CMD's environment (recorded: a stop signals only a pid carrying it)
    nonce: str

    def go(self) -> None:
        """Let CMD run. Raises the ``OSError`` its exec failed with."""
        ...

    def abandon(self) -> None:
        """Never run CMD."""
        ...

    def wait(self) -> int:
        """CMD's exit code; negative N for a signal N."""
        ...


# (argv, environment, job name, preemptible) -> CMD forked in its own session, held before
# it runs, with the job's marks added to its environment
JobSpawner = Callable[[list[str], dict[str, str], str, bool], JobChild]


class Probe(msgspec.Struct, frozen=True):
    """How the host is read: its snapshot, and where there is no agent, the records'
    servers found on this machine (the agent finds and names them on its own host)."""

    read: SnapshotReader
    # The same, never from a cache: the re-check under the admission lock and a stop act
    # on it (None: ``read`` reads fresh already, as the local probe does).
    read_fresh: SnapshotReader | None = None
    find_servers: ServerFinder | None = None
    find_children: ChildFinder | None = None

    def fresh(self) -> SnapshotReader:
        return self.read_fresh or self.read


def _unknown(_record: Record) -> bool | None:
    return None


class Launchers(msgspec.Struct, frozen=True):
    """How servers and run jobs are started, found and stopped."""

    # (snapshot) -> the service's own launcher
    own: Callable[[Snapshot | None], Launcher]
    # (another service, snapshot) -> its launcher, to stop a victim with (None: no victim
    # can be stopped)
    other: VictimLauncher | None = None
    # record -> whether the server its handle names still runs (None: cannot be told)
    handle_alive: Callable[[Record], bool | None] = _unknown
    # How a preempted run job is stopped (None: none can be).
    stop_job: JobStopper | None = None


class ServerChecks(msgspec.Struct, frozen=True):
    """What the service's server, and the others', answer."""

    health: Callable[[], Health]
    # (another service) -> its server's requests in flight
    in_flight: InFlightReader | None = None
    # (its health URL, sleep level) -> wakes a vLLM from sleep mode (at that URL's origin)
    wake: Callable[[str, int], None] | None = None
    # record -> what its server is seen doing: ``ensure`` first heals the phases of the
    # host's records that lie about their servers (``gpuctl.flows.heal``). None: it heals
    # nothing.
    truth: Callable[[Record], ServerTruth] | None = None


class Tell(msgspec.Struct, frozen=True):
    """Where the person waiting hears of it (the CLI's stderr, a progress line)."""

    progress: Callable[[Progress], None] | None = None
    # A line at once: why a wait may be for nothing, rather than only after the timeout.
    notice: Callable[[str], None] | None = None
    # Each repair of a record, at once (with --json too: a repair of another service's
    # record is news whatever the output). None: only the result's notes.
    on_repair: Callable[[str], None] | None = None
