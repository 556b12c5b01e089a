"""How ``ensure`` ends (``Outcome``), and the results of ``ensure``, ``stop``, ``touch``,
``locks`` and ``sim ls``: plain objects, rendered by ``gpuctl.render``.

Apart from ``gpuctl.flows.results`` (what ``status`` returns, and a wait's ``Progress``) so
that ``gpuctl status``, which needs none of them, does not build their classes at every
start.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

from gpuctl.core.queue import Waiter
from gpuctl.core.record import Record, SetAside, Voided
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


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C once ``ensure`` had a start under way (its nonce recorded, or an earlier
    start's server adopted): its server keeps loading. A plain ``KeyboardInterrupt``
    from ``ensure`` means it started nothing, unless it was waiting on a start."""


class EnsureResult(msgspec.Struct):
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
    notes: list[str] = msgspec.field(default_factory=list)
    hint: str = ""
    # The service's hosts (``hosts = [...]``); empty: ``host`` alone.
    pool: tuple[str, ...] = ()

    @property
    def exit_code(self) -> ExitCode:
        return self.outcome.exit_code

    @classmethod
    def interrupted(
        cls, service: str, host: str, *, ours: bool = True, started: bool = True
    ) -> EnsureResult:
        """Ctrl-C while waiting: the server is left to load (the next caller waits for it).
        ``ours`` False: the wait was on a process only a keyword ties to the service, so
        nothing gpuctl started is loading. ``started`` False: interrupted before it
        started anything or waited on a start (a look, the admission lock, a victim's
        stop), so nothing loads; the decision is UNKNOWN, as it was never acted on."""
        if not started:
            reason, decision = "interrupted before anything was started", "UNKNOWN"
            hint = f"`gpuctl ensure {service}` again starts it"
        elif not ours:
            reason = (
                "interrupted while waiting on a process that names it; "
                "nothing gpuctl started is loading"
            )
            decision = "LOADING"
            hint = (
                "`gpuctl status` shows that process; narrow the service's `match` "
                "if it is not the service"
            )
        else:
            reason, decision = "interrupted while waiting; the server keeps loading", "LOADING"
            hint = "`gpuctl status` shows it loading; `gpuctl ensure` again waits for it"
        return cls(
            service=service,
            host=host,
            outcome=Outcome.INTERRUPTED,
            reason=reason,
            decision=decision,
            hint=hint,
        )


class StopResult(msgspec.Struct):
    service: str
    host: str
    stopped: list[str] = msgspec.field(default_factory=list)
    reason: str = ""

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK


class TouchResult(msgspec.Struct, frozen=True):
    service: str
    record: Record
    # Where it was marked, for a pooled service touched without --host; else None.
    host: str | None = None

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK


class LocksReport(msgspec.Struct):
    rows: list[tuple[str, Record | None, str | None]]  # (host, record, error)
    now: float
    # Record files that failed validation and were kept beside the records, per host:
    # listed until someone removes them (they do not make the report fail).
    set_aside: list[tuple[str, SetAside]] = msgspec.field(default_factory=list)
    # What to do about a host whose records could not be read (by host; None: no advice).
    hints: dict[str, str | None] = msgspec.field(default_factory=dict)
    # Each host's wait queue (``gpuctl run --wait``), in the order it will be served.
    queue: list[tuple[str, Waiter]] = msgspec.field(default_factory=list)
    # Records of `gpuctl run` jobs that ended long ago, left out (``locks --finished``).
    hidden_jobs: int = 0
    # (host, one line) per record whose phase this run healed, for stderr.
    repaired: list[tuple[str, str]] = msgspec.field(default_factory=list)
    # (host, service) of the services this config names: a record of any other is
    # another config's (counted at its promise) or a job's.
    configured: set[tuple[str, str]] = msgspec.field(default_factory=set)
    # Leases and entries found forged (``core.record.void_why``), per host: they count
    # for nothing, and are kept until someone removes them (``adapters.store.voided``).
    voided: list[tuple[str, Voided]] = msgspec.field(default_factory=list)
    # Each pooled service's hosts (``Config.pools``): its rows, one per host, go together.
    pools: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(err is None for _, _, err in self.rows)

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.OK if self.ok else ExitCode.UNKNOWN


class SimClaim(msgspec.Struct, frozen=True):
    pid: int
    name: str
    memory_mib: int
    gpu: int
    command: str | None


class SimListing(msgspec.Struct, frozen=True):
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
