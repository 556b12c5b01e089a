"""What the flows return: plain result objects, rendered by ``gpuctl.render``.

A flow never formats: it returns one of these, and one renderer per result turns it into
text or into its versioned JSON envelope (``gpuctl.render.results``). The CLI maps the
result's ``exit_code`` to the process's exit status and prints nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Health, ServiceSpec, Verdict, owner_of
from gpuctl.core.jobs import JobSpec
from gpuctl.core.model import Snapshot
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Record, SetAside
from gpuctl.errors import ExitCode


class Outcome(StrEnum):
    """How an ``ensure`` ended (the ``outcome`` key of its JSON)."""

    READY = "ready"
    STARTED = "started"
    LOADING = "loading"
    BUSY = "busy"
    UNKNOWN = "unknown"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"

    @property
    def exit_code(self) -> ExitCode:
        return _OUTCOME_EXIT[self]


_OUTCOME_EXIT = {
    Outcome.READY: ExitCode.OK,
    Outcome.STARTED: ExitCode.OK,
    Outcome.LOADING: ExitCode.OK,
    Outcome.BUSY: ExitCode.BUSY,
    Outcome.UNKNOWN: ExitCode.UNKNOWN,
    Outcome.FAILED: ExitCode.FAILED,
    Outcome.TIMEOUT: ExitCode.TIMEOUT,
    Outcome.INTERRUPTED: ExitCode.INTERRUPTED,
}


@dataclass(frozen=True, slots=True)
class Progress:
    """One tick of a wait, for the status line."""

    phase: str
    elapsed_s: float
    memory_mib: int | None = None
    log_line: str = ""
    note: str = ""
    expected_s: float | None = None  # the median of its recent starts (None: first start)


@dataclass
class EnsureResult:
    """How ``ensure`` ended; ``hint`` says what the user can do about a refusal."""

    service: str
    host: str
    outcome: Outcome
    reason: str
    decision: str
    launched: bool = False
    waited_s: float = 0.0
    attempt: dict[str, Any] | None = None
    log_tail: str = ""
    handle: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    hint: str = ""

    @property
    def exit_code(self) -> ExitCode:
        return self.outcome.exit_code

    @classmethod
    def interrupted(cls, service: str, host: str) -> EnsureResult:
        """Ctrl-C while waiting: the server is left to load (the next caller waits for it)."""
        return cls(
            service=service,
            host=host,
            outcome=Outcome.INTERRUPTED,
            reason="interrupted while waiting; the server keeps loading",
            decision="LOADING",
            hint="`gpuctl status` shows it loading; `gpuctl ensure` again waits for it",
        )


@dataclass
class StopResult:
    service: str
    host: str
    stopped: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK


@dataclass(frozen=True, slots=True)
class TouchResult:
    service: str
    record: Record

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK


@dataclass
class LocksReport:
    rows: list[tuple[str, Record | None, str | None]]  # (host, record, error)
    now: float
    # Record files that failed validation and were kept beside the records, per host:
    # listed until someone removes them (they do not make the report fail).
    set_aside: list[tuple[str, SetAside]] = field(default_factory=list)
    # What to do about a host whose records could not be read (by host; None: no advice).
    hints: dict[str, str | None] = field(default_factory=dict)
    # Each host's wait queue (``gpuctl run --wait``), in the order it will be served.
    queue: list[tuple[str, Waiter]] = field(default_factory=list)
    # Records of `gpuctl run` jobs that ended long ago, left out (``locks --finished``).
    hidden_jobs: int = 0

    @property
    def ok(self) -> bool:
        return all(err is None for _, _, err in self.rows)

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if self.ok else ExitCode.UNKNOWN


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """One GPU's memory as the decisions count it (the status bar draws it).

    ``held_mib`` is what the device reports in use; ``promised_mib`` is what is promised
    beyond that to services that are loading or starting (each counts at its budget);
    both None when unknown. ``gpu`` is None for a host-wide figure.
    """

    gpu: int | None
    held_mib: int | None
    promised_mib: int
    total_mib: int | None
    unified: bool = False
    utilization_pct: int | None = None
    name: str | None = None
    error: str | None = None
    temperature_c: int | None = None
    power_w: float | None = None

    @property
    def free_mib(self) -> int | None:
        if self.total_mib is None or self.held_mib is None:
            return None
        return self.total_mib - self.held_mib - self.promised_mib


@dataclass(frozen=True, slots=True)
class HostReport:
    """One host: what its agent (or the local probe) said, or why it said nothing."""

    name: str
    source: str
    snapshot: Snapshot | None
    error: str | None = None
    hint: str | None = None
    verdicts: tuple[Verdict, ...] = ()
    services: tuple[ServiceConfig, ...] = ()
    health: tuple[Health, ...] = ()
    elapsed_s: float = 0.0
    gpu_memory_mib: int | None = None
    servers: Mapping[int, str] = field(default_factory=dict)  # recorded server pid -> service
    memory: tuple[MemoryUse, ...] = ()  # per GPU, or one host-wide figure
    jobs: tuple[JobSpec, ...] = ()  # the `gpuctl run` jobs its records name

    @property
    def ok(self) -> bool:
        return self.snapshot is not None

    def owner(self, pid: int, command: str | None) -> ServiceSpec | None:
        """The service (or ``gpuctl run`` job) a process is, by the same rule the
        decisions use: the pid a record names, else a service's keywords."""
        return owner_of(command, (*self.services, *self.jobs), pid, self.servers)

    @property
    def total_mib(self) -> int | None:
        if self.snapshot is None:
            return None
        return self.snapshot.memory_total_mib or self.gpu_memory_mib


@dataclass(frozen=True, slots=True)
class StatusReport:
    hosts: tuple[HostReport, ...]
    taken_at: str = ""
    filters: tuple[str, ...] = ()  # what --only / --user narrowed, in words

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if all(h.ok for h in self.hosts) else ExitCode.UNKNOWN


@dataclass(frozen=True, slots=True)
class SimClaim:
    pid: int
    name: str
    memory_mib: int
    gpu: int
    command: str | None


@dataclass(frozen=True, slots=True)
class SimListing:
    """``gpuctl sim ls``: the simulated GPU's claims."""

    sim_dir: str
    total_mib: int | None
    claims: tuple[SimClaim, ...]
    totals_mib: tuple[int, ...] = ()  # each simulated GPU's total
    # The total asked (--gpu-memory) differs from what gpu.json says (which is read).
    warning: str | None = None
    # Where the folder came from: --sim-dir, $GPUCTL_SIM_DIR, hosts.NAME.sim_dir, default.
    source: str = ""

    @property
    def used_mib(self) -> int:
        return sum(c.memory_mib for c in self.claims)

    def gpu_used_mib(self, gpu: int) -> int:
        return sum(c.memory_mib for c in self.claims if c.gpu == gpu)
