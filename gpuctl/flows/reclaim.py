"""``gpuctl reclaim``: give the GPU back, from cron (docs/how-to/reclaim.md).

Per host, one run at a time (a lease on the pseudo-service ``_reclaim``; a second run
finds it held and leaves at once). Then:

0. heal the phases its records say (``gpuctl.flows.heal``): a ``preempted`` record whose
   server runs becomes ``running`` (so it is stopped when idle, and never "resumed"
   over itself), a ``running`` one whose server is gone becomes ``stopped``;
1. read the host once: its records and its in-flight counts (one list each, whatever
   the number of services), and a snapshot only when something may be stopped;
2. judge every service (``gpuctl.core.idle.judge``), reading a server's own in-flight
   requests (vLLM's ``/metrics``) only for the services past their timeout;
3. for each service to free: take its lease (without waiting: a lease held means
   someone is starting, stopping or waking it), judge again under the lease with the
   record the lease came with and fresh in-flight counts, and only then stop it, put
   it to sleep, or unload it. While reclaim holds the lease, a touch changes nothing
   and a new ``in_use`` waits, so either they win (before the lease) or reclaim does;
4. touch the services busy past their timeout;
5. rotate the launchers' logs on this machine that grew past their size.

Nothing is stopped on a host that could not be read (exit 4), and nothing gpuctl did
not start: a stop goes by the record's handle only, never by keywords.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
from msgspec.structs import replace

from gpuctl.adapters.launchers.base import Handle, Launcher
from gpuctl.adapters.store.base import Store
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.heal import Repair, ServerTruth
from gpuctl.core.idle import (
    Action,
    Candidate,
    IdleFacts,
    judge,
    needs_in_flight,
    needs_lingering,
)
from gpuctl.core.pool import gathered
from gpuctl.core.record import RECLAIM_TTL_MAX_S, Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import HostIdentity, Snapshot
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.flows import story
from gpuctl.flows.deps import Closers
from gpuctl.flows.heal import heal, health_timeouts
from gpuctl.flows.ports import Machine, SnapshotReader
from gpuctl.flows.resume import Resumed

if TYPE_CHECKING:
    from gpuctl.core.events import Event

RUN_LOCK = "_reclaim"
RUN_LOCK_TTL_S = RECLAIM_TTL_MAX_S
STOP_LEASE_MARGIN_S = 60.0


class ReclaimHost(msgspec.Struct):
    """One host as reclaim sees it: its store, its snapshot, and how to act on a service."""

    host: HostConfig
    store: Store
    read_snapshot: SnapshotReader
    # service -> its server's requests in flight (None: no such metric); raises GpuctlError
    server_in_flight: Callable[[ServiceConfig], int | None]
    # (service, snapshot) -> its launcher
    make_launcher: Callable[[ServiceConfig, Snapshot | None], Launcher]
    # (service) -> puts a vLLM to sleep at its sleep_level; raises GpuctlError
    sleep_server: Callable[[ServiceConfig], None]
    # record -> what its server is seen doing (``gpuctl.wiring`` builds it), for the
    # heal pass; None: no heal.
    look: Callable[[Record], ServerTruth] | None = None


class ReclaimDeps(Closers, kw_only=True):
    config: Config
    hosts: list[ReclaimHost]
    machine: Machine
    clock: Callable[[], float] = time.time
    # Rotates the launchers' logs on this machine by size; returns the ones rotated.
    rotate_logs: Callable[[], list[str]] | None = None
    # (host, its store, dry run) -> the preempted ``resume = true`` services brought back
    # (``gpuctl.flows.resume``), after the stops; None: resumes nothing.
    resume: Callable[[HostConfig, Store, bool], list[Resumed]] | None = None


class Planned(msgspec.Struct):
    """A candidate on a host, and what became of it."""

    host: str
    candidate: Candidate
    done: bool = False
    error: str | None = None
    hint: str = ""


class HostOutcome(msgspec.Struct):
    name: str
    error: str | None = None
    hint: str = ""
    busy: str | None = None  # another reclaim runs there (a second run leaves at once)


class ReclaimReport(msgspec.Struct):
    dry_run: bool
    hosts: list[HostOutcome] = msgspec.field(default_factory=list)
    planned: list[Planned] = msgspec.field(default_factory=list)
    rotated_logs: list[str] = msgspec.field(default_factory=list)
    # (host, resume): preempted services brought back (or tried) after the stops.
    resumed: list[tuple[str, Resumed]] = msgspec.field(default_factory=list)
    # (host, repair): records whose phase was healed before the stops (said on stderr).
    repaired: list[tuple[str, Repair]] = msgspec.field(default_factory=list)
    # Each pooled service's hosts (``Config.pools``): its candidates go together.
    pools: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)

    @property
    def exit_code(self) -> ExitCode:
        if any(h.error for h in self.hosts):
            return ExitCode.UNKNOWN
        if any(p.error for p in self.planned) or any(r.failed for _, r in self.resumed):
            return ExitCode.FAILED
        return ExitCode.OK


def reclaim(deps: ReclaimDeps, *, dry_run: bool = False) -> ReclaimReport:
    """Reclaim every host in ``deps``. Never raises for a host: its error is reported."""
    report = ReclaimReport(dry_run)
    for rh in deps.hosts:
        outcome = HostOutcome(rh.host.name)
        report.hosts.append(outcome)
        try:
            _reclaim_host(deps, rh, outcome, report, dry_run)
            if deps.resume is not None and outcome.busy is None:
                # After the stops, highest priority first: what they freed may let a
                # preempted batch come back.
                report.resumed += [
                    (rh.host.name, r) for r in deps.resume(rh.host, rh.store, dry_run)
                ]
        except GpuctlError as e:
            outcome.error, outcome.hint = e.message, e.hint
    if deps.rotate_logs is not None and not dry_run:
        # The servers' logs on this machine (the cron job on the GPU host): a server that
        # runs for weeks must not fill the disk.
        report.rotated_logs = deps.rotate_logs()
    # A pooled service is judged on each host of its pool (its copy may run on any, and
    # each copy idles on its own), and said as one service.
    report.pools = deps.config.pools()
    report.planned = gathered(report.planned, _planned_place, report.pools)
    return report


def _planned_place(p: Planned) -> tuple[str, str]:
    return p.candidate.service, p.host


def _reclaim_host(
    deps: ReclaimDeps,
    rh: ReclaimHost,
    outcome: HostOutcome,
    report: ReclaimReport,
    dry_run: bool,
) -> None:
    planned = report.planned
    run = deps.machine.holder("reclaim")
    if not dry_run:
        granted, rec = rh.store.acquire(RUN_LOCK, run, RUN_LOCK_TTL_S)
        if not granted:
            lease = rec.lease
            outcome.busy = (
                f"another reclaim runs there ({lease.entry} pid {lease.pid} on {lease.host})"
                if lease
                else "another reclaim runs there"
            )
            return
    try:
        services = deps.config.services_on(rh.host.name)
        listed = rh.store.records()
        if rh.look is not None and not dry_run:
            timeouts = health_timeouts(deps.config)
            repairs = heal(
                rh.store,
                listed,
                rh.look,
                "reclaim",
                new_holder=deps.machine.holder,
                clock=deps.clock,
                abandoned_after=timeouts,
            )
            report.repaired += [(rh.host.name, r) for r in repairs]
            if repairs:
                listed = rh.store.records()
        records = {r.service: r for r in listed}
        in_flight = rh.store.inflight()
        now = deps.clock()
        lingering = _Lingering(rh.store)
        facts = [
            _facts(s, records.get(s.name), in_flight, now, rh, lingering=lingering)
            for s in services
        ]
        # One snapshot, and only when something may be freed: where a process launcher's
        # server runs decides whether this machine can signal it.
        snapshot: Snapshot | None = None
        if any(judge(f, now).action.frees for f in facts):
            snapshot = rh.read_snapshot([], [])
            facts = [
                _where(f, s, rh.host, snapshot, deps.machine.here)
                for f, s in zip(facts, services, strict=True)
            ]
        for svc, f in zip(services, facts, strict=True):
            c = judge(f, now)
            p = Planned(rh.host.name, c)
            planned.append(p)
            if dry_run or c.quiet:
                continue
            if c.action is Action.TOUCH:
                _touch(rh, svc, p)
            elif c.action.frees:
                _free(deps, rh, svc, p, snapshot)
    finally:
        if not dry_run:
            with contextlib.suppress(GpuctlError):
                rh.store.release(RUN_LOCK, run.id)
            if not rh.host.agent and hasattr(rh.store, "prune_journal"):  # no agent prunes here
                rh.store.prune_journal()


class _Lingering:
    """The host's lingering in-flight entries (``Store.lingering``), read once, when a
    service past its timeout first needs them."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._left: dict[str, float] | None = None

    def of(self, service: str) -> float:
        if self._left is None:
            self._left = self._store.lingering()
        return self._left.get(service, 0.0)


def _facts(
    svc: ServiceConfig,
    rec: Record | None,
    in_flight: dict[str, int],
    now: float,
    rh: ReclaimHost,
    *,
    lingering: _Lingering,
) -> IdleFacts:
    rec = rec or Record(service=svc.name)
    lease = rec.lease
    f = IdleFacts(
        service=svc.name,
        managed=svc.launcher is not None,
        idle_timeout_s=svc.idle_timeout_s,
        stop=svc.stop,
        launcher=svc.launcher,
        sleep_level=svc.sleep_level,
        phase=rec.phase,
        last_used=rec.last_used,
        since=rec.since,
        lease=f"{lease.entry} pid {lease.pid} on {lease.host}" if lease else None,
        has_handle=bool(rec.handle),
        store_in_flight=in_flight.get(svc.name, 0),
    )
    if needs_lingering(f, now):
        try:
            # A lingering entry (``core.record.LINGER_ENTRY``): a proxy may send it a
            # request without counting it first, so it is not stopped while one stands
            # (an Ollama model is not unloaded either).
            f = replace(f, store_lingering_s=lingering.of(svc.name))
            if needs_in_flight(f, now):
                f = replace(f, server_in_flight=rh.server_in_flight(svc))
        except GpuctlError as e:
            f = replace(f, in_flight_error=e.message)
    return f


def _where(
    f: IdleFacts, svc: ServiceConfig, host: HostConfig, snap: Snapshot, here: HostIdentity
) -> IdleFacts:
    """A process-launched server on another machine: only that machine can signal it."""
    if svc.launcher != "process" or not host.agent:
        return f
    there = snap.host
    if there is not None and (there.hostname, there.boot_id) == (here.hostname, here.boot_id):
        return f
    return replace(f, remote_process=there.hostname if there else f"host {host.name}")


def _touch(rh: ReclaimHost, svc: ServiceConfig, p: Planned) -> None:
    try:
        rh.store.touch(svc.name, promise=svc.promise())
        p.done = True
    except GpuctlError as e:
        p.error, p.hint = f"touch failed: {e.message}", e.hint


def _free(
    deps: ReclaimDeps, rh: ReclaimHost, svc: ServiceConfig, p: Planned, snap: Snapshot | None
) -> None:
    """Stop (sleep, unload) one service under its lease, after judging it again there."""
    holder = deps.machine.holder("reclaim")
    ttl = svc.stop_timeout_s + STOP_LEASE_MARGIN_S
    granted, rec = rh.store.acquire(svc.name, holder, ttl)
    if not granted:
        lease = rec.lease
        who = f"{lease.entry} pid {lease.pid} on {lease.host}" if lease else "someone"
        p.candidate = replace(p.candidate, action=Action.KEEP, reason=f"lease held by {who}")
        return
    update: RecordUpdate | None = None
    touch_after = False
    try:
        # Under the lease: the record it came with is fresh (a touch before it counts,
        # none after it does), and any in_use that began before it is in the counts.
        now = deps.clock()
        # The lingering entries before the counts: under the lease an entry may turn
        # from lingering to counted, never back (``Store.inflight_end``), so a request
        # its holder counts between the two reads is in the second.
        lingering = _Lingering(rh.store)
        lingering.of(svc.name)
        f = _facts(svc, replace(rec, lease=None), rh.store.inflight(), now, rh, lingering=lingering)
        if snap is not None:
            f = _where(f, svc, rh.host, snap, deps.machine.here)
        again = judge(f, now)
        if again.action is not p.candidate.action:
            p.candidate = again
            touch_after = again.action is Action.TOUCH
            return
        try:
            if again.action is Action.SLEEP:
                rh.sleep_server(svc)
                update = RecordUpdate(phase=Phase.SLEEPING)
            else:
                handle = Handle.from_dict(rec.handle) if rec.handle else Handle(kind="ollama")
                launcher = rh.make_launcher(svc, snap)
                launcher.stop(handle, svc.stop_timeout_s, svc.name)
                update = RecordUpdate(phase=Phase.STOPPED, handle=None)
        except GpuctlError as e:
            p.error, p.hint = e.message, e.hint
            return
        p.done = True
    finally:
        with contextlib.suppress(GpuctlError):
            rh.store.release(svc.name, holder.id, update, event=_stop_event(svc, rec, update))
        if touch_after:
            _touch(rh, svc, p)


def _stop_event(svc: ServiceConfig, rec: Record, update: RecordUpdate | None) -> Event | None:
    """The journal's word for a reclaim's stop (or sleep): idle for how long."""
    if update is None:
        return None
    sleep = update.phase is Phase.SLEEPING
    idle = rec.idle_for(time.time())
    return story.ev(
        "stop",
        svc.name,
        "reclaim",
        cause="sleep" if sleep else "idle",
        before=rec.phase,
        after=Phase.SLEEPING if sleep else Phase.STOPPED,
        reason=f"idle past its {svc.idle_timeout_s:.0f}s idle timeout",
        idle_s=idle,
        budget_mib=svc.memory_mib,
    )


def report_lines(report: ReclaimReport) -> Sequence[Planned]:
    """The candidates worth a line (everything but the quiet keeps)."""
    return [p for p in report.planned if not p.candidate.quiet or p.error]
