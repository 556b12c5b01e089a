"""What the flows return: plain result objects, rendered by ``gpuctl.render``.

A flow never formats: it returns one of these, and one renderer per result turns it into
text or into its versioned JSON envelope (``gpuctl.render.results``). The CLI maps the
result's ``exit_code`` to the process's exit status and prints nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Health, ServiceSpec, Verdict, owner_of
from gpuctl.core.jobs import JobSpec
from gpuctl.core.promise import Promise
from gpuctl.core.promised_specs import PromisedSpec
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import ExitCode

# The phase of the tick that tells a start's ETA before anything is launched or waited on.
CHECKING = "checking"


class Progress(msgspec.Struct, frozen=True):
    """One tick of a wait, for the status line."""

    phase: str
    elapsed_s: float
    memory_mib: int | None = None
    log_line: str = ""
    note: str = ""
    expected_s: float | None = None  # the median of its recent starts (None: first start)
    # False while what it waits on is tied to the service only by a keyword (no record
    # names it): maybe not a server at all, so no ETA, and Ctrl-C leaves nothing loading.
    ours: bool = True


class MemoryUse(msgspec.Struct, frozen=True):
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
    # Services whose records hold memory without saying how much (an older release's):
    # what is promised, and so what is free, is then unknown.
    unknown_promises: tuple[str, ...] = ()

    @property
    def free_mib(self) -> int | None:
        if self.total_mib is None or self.held_mib is None or self.unknown_promises:
            return None
        return self.total_mib - self.held_mib - self.promised_mib


class OtherService(msgspec.Struct, frozen=True):
    """A service the host's records name that this config does not, while it holds or
    promises memory: admission counts it at its record's promise (``promise`` None: an
    older release wrote the record, and its memory is unknown)."""

    name: str
    phase: str
    promise: Promise | None
    pids: tuple[int, ...] = ()
    memory_mib: int = 0  # what its processes hold now

    @property
    def spec(self) -> PromisedSpec:
        """As the decisions see it (no budget where its record does not say one)."""
        return PromisedSpec.of(self.name, self.promise or Promise(None, 0))


class HostReport(msgspec.Struct, frozen=True):
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
    servers: Mapping[int, str] = msgspec.field(
        default_factory=dict
    )  # recorded server pid -> service
    memory: tuple[MemoryUse, ...] = ()  # per GPU, or one host-wide figure
    jobs: tuple[JobSpec, ...] = ()  # the `gpuctl run` jobs its records name
    others: tuple[OtherService, ...] = ()  # services only other configs name
    # The servers that would yield now to a start that asks to preempt, whatever the
    # priorities (``core.plan.yields``), and how long each has been idle, in seconds.
    yielding: Mapping[str, float] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.snapshot is not None

    @property
    def specs(self) -> tuple[ServiceSpec, ...]:
        """Every service a process may belong to: configured, ``gpuctl run`` jobs, and
        those only other configs name."""
        return (*self.services, *self.jobs, *(o.spec for o in self.others))

    def owner(self, pid: int, command: str | None) -> ServiceSpec | None:
        """The service (or ``gpuctl run`` job) a process is, by the same rule the
        decisions use: the pid a record names, else a service's keywords."""
        return owner_of(command, self.specs, pid, self.servers)

    @property
    def total_mib(self) -> int | None:
        if self.snapshot is None:
            return None
        return self.snapshot.memory_total_mib or self.gpu_memory_mib


class StatusReport(msgspec.Struct, frozen=True):
    hosts: tuple[HostReport, ...]
    taken_at: str = ""
    filters: tuple[str, ...] = ()  # what --only / --user narrowed, in words

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if all(h.ok for h in self.hosts) else ExitCode.UNKNOWN


__all__ = [
    "HostReport",
    "MemoryUse",
    "Progress",
    "StatusReport",
]
