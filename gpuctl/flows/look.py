"""One way to look at a host and decide: records, recorded pids, keywords, snapshot, classify,
and, where it does not fit, who could be stopped to make room.

``status`` and ``ensure`` both come through here, so they never disagree about a
service: the records are read first, and the servers they name are asked for by pid
(whatever their command line: a ``vllm serve`` under a service called "chat"), along
with the keywords of every service on the host; and both ask for victims through
``with_victims``, so ``status`` says PREEMPTABLE exactly where ``ensure --preempt`` would
preempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TypeVar

import msgspec
from msgspec.structs import replace

from gpuctl.config import ServiceConfig
from gpuctl.core.decision import (
    Decision,
    GpuRoom,
    Health,
    ServiceSpec,
    Verdict,
    classify,
    gpu_rooms,
)
from gpuctl.core.durations import expected_start_s
from gpuctl.core.jobs import job_specs, unreachable
from gpuctl.core.plan import VictimFacts, yields
from gpuctl.core.promised_specs import PromisedSpec, as_promised, strangers
from gpuctl.core.queue import Waiter, held_back, waiter_reason
from gpuctl.core.record import (
    Listing,
    Phase,
    Record,
    SetAside,
    hidden_by_set_aside,
    starting_services,
    unreadable_handle,
)
from gpuctl.core.record_pids import recorded_servers
from gpuctl.core.redact import show_url
from gpuctl.core.snapshot import Snapshot
from gpuctl.core.timestamps import iso_utc
from gpuctl.errors import GpuctlError, NoStore
from gpuctl.flows.deps import EnsureDeps
from gpuctl.flows.ports import ChildFinder, Machine, ServerFinder, SnapshotReader
from gpuctl.flows.results import MemoryUse

S = TypeVar("S", ServiceConfig, PromisedSpec)


def keywords(services: Iterable[ServiceConfig]) -> list[str]:
    """Every service's match keywords, once each, in order."""
    out: dict[str, None] = {}
    for s in services:
        for k in s.keywords:
            out.setdefault(k, None)
    return list(out)


class Observation(msgspec.Struct, frozen=True):
    """What a host said: its records and its snapshot, or why there is no snapshot;
    ``set_aside``: its record files set aside as unreadable; ``found``: servers found on
    this machine for the records (the direct path: by start nonce too)."""

    records: dict[str, Record] = msgspec.field(default_factory=dict)
    snapshot: Snapshot | None = None
    error: str | None = None
    hint: str | None = None
    set_aside: tuple[SetAside, ...] = ()
    found: dict[int, str] = msgspec.field(default_factory=dict)

    @property
    def servers(self) -> dict[int, str]:
        """The pids the records name, and whose they are; with the agent's word for its
        host (the servers it found by start nonce, and the processes they forked)."""
        told = dict(self.snapshot.servers) if self.snapshot is not None else {}
        return {**told, **recorded_servers(self.records.values()), **self.found}


def observe(
    read_records: Callable[[], Listing | Iterable[Record]],
    read_snapshot: SnapshotReader,
    services: Sequence[ServiceConfig],
    *,
    records_required: bool = True,
    find_servers: ServerFinder | None = None,
    find_children: ChildFinder | None = None,
) -> Observation:
    """Records first, then the snapshot with the recorded servers' pids and the keywords.

    Never raises a ``GpuctlError``: a failure becomes the observation's ``error`` (the
    services are then UNKNOWN). With ``records_required=False`` a host that keeps no
    records (an agent started without a state dir: ``NoStore``) leaves them empty instead;
    records that cannot be read still make it UNKNOWN. ``find_servers``: the records'
    servers found on this machine (no agent), as the agent finds them on its host;
    ``find_children``: the processes those servers forked (theirs too).
    """
    records: dict[str, Record] = {}
    aside: tuple[SetAside, ...] = ()
    found: dict[int, str] = {}
    try:
        try:
            got = read_records()
            if isinstance(got, Listing):
                aside = tuple(got.set_aside)
                got = got.records
            records = {r.service: r for r in got}
        except NoStore:
            # An agent without a state dir keeps no records. Any other store failure
            # makes the host UNKNOWN: without its leases, IDLE could be a lie.
            if records_required:
                raise
        if find_servers is not None:
            found = find_servers(records.values())
        roots = {**recorded_servers(records.values()), **found}
        snapshot = read_snapshot(keywords(services), sorted(roots))
        if find_children is not None:
            # After the reading: a child is the server's, but no start of its own.
            found = {**find_children(records.values(), roots), **found}
    except GpuctlError as e:
        return Observation(records, None, e.message, e.hint or None, aside, found)
    return Observation(records, snapshot, set_aside=aside, found=found)


def memory_use(
    seen: Observation,
    services: Sequence[ServiceConfig],
    now: float,
    total_override_mib: int | None = None,
) -> tuple[MemoryUse, ...]:
    """Each GPU's memory as admission counts it (for the status bar): what it holds, and
    what is promised beyond that to services that are loading or starting (each at its
    budget, on every GPU it may land on), by the same rules as ``decide``."""
    snap = seen.snapshot
    if snap is None:
        return ()
    specs, promised = _accounting(seen, services, now)
    rooms: dict[int, list[GpuRoom]] = {}
    for r in gpu_rooms(
        snap,
        specs,
        starting_services=promised,
        servers=seen.servers,
        total_override_mib=total_override_mib,
    ):
        rooms.setdefault(r.index, []).append(r)
    devices = snap.device_list()
    unknown = tuple(unknown_promises(seen, services))
    out = []
    for d in devices:
        mine = rooms.get(d.index, [])
        # A GPU with MIG on is one room per instance: the GPU holds what they all hold.
        room = mine[0] if len(mine) == 1 else None
        held = d.memory_used_mib
        if d.mig and all(m.memory_used_mib is not None for m in d.mig):
            held = sum(m.memory_used_mib or 0 for m in d.mig)
        committed = sum(r.committed_mib for r in mine)
        out.append(
            MemoryUse(
                gpu=d.index if len(devices) > 1 else None,
                held_mib=held,
                promised_mib=max(0, committed - (held or 0)),
                unknown_promises=unknown,
                total_mib=room.total_mib if room else d.memory_total_mib,
                unified=d.unified,
                utilization_pct=d.utilization_pct,
                name=d.name,
                error=d.error,
                temperature_c=d.temperature_c,
                power_w=d.power_w,
            )
        )
    return tuple(out)


def decide(
    svc: ServiceSpec,
    health: Health,
    seen: Observation,
    *,
    others: Sequence[ServiceConfig],
    now: float,
    total_override_mib: int | None = None,
    record: Record | None = None,
    handle_alive: bool | None = None,
    own_holder: str | None = None,
    orphan_is_loading: bool = True,
    victims: Mapping[str, VictimFacts] | None = None,
    force: bool = False,
    host_hint: bool = True,
) -> Verdict:
    """Classify ``svc`` on what was seen (the one call of ``classify`` in the flows).

    A start of ``svc`` whose caller went before recording its server (``orphaned_starts``)
    is LOADING while its health timeout runs, where nothing else says so: its server may
    be reading weights unseen, and it is never called free. ``ensure`` asks with
    ``orphan_is_loading=False``: it looks for that server itself, under the lease.
    A record set aside with no phase left may hide a start too: UNKNOWN (``hidden_start``).
    ``host_hint``: an UNKNOWN for want of a snapshot carries the host's own hint (the
    agent's advice); ``status`` shows that once on the host's line instead.
    """
    slurm = slurm_placed(seen, others)
    if svc.name in slurm or getattr(svc, "launcher", None) == "slurm":
        return slurm_verdict(
            svc,
            health,
            record if record is not None else seen.records.get(svc.name),
            handle_alive=handle_alive,
            now=now,
            own_holder=own_holder,
        )
    if slurm:
        # Slurm admits its own jobs: they hold no room on this host's GPUs.
        seen = replace(seen, records={k: v for k, v in seen.records.items() if k not in slurm})
        others = [o for o in others if o.name not in slurm]
    error = seen.error
    specs, leased = _accounting(seen, others, now, me=svc.name)
    own = record if record is not None else seen.records.get(svc.name)
    verdict = classify(
        svc,
        health,
        seen.snapshot,
        others=specs,
        agent_error=error,
        total_override_mib=total_override_mib,
        record=own,
        handle_alive=handle_alive,
        now=now,
        own_holder=own_holder,
        leased=leased,
        servers=seen.servers,
        victims=victims,
        force=force,
    )
    if host_hint and seen.snapshot is None and seen.hint and verdict.decision is Decision.UNKNOWN:
        # The agent's own advice (a refused token: which key to check) is the hint, once;
        # not words inside the reason that the caller's hint line would repeat.
        host = next((o.host for o in others if o.name == svc.name), None)
        where = f"; `gpuctl status -H {host}` shows that host" if host else ""
        verdict = replace(verdict, hint=verdict.hint or f"{seen.hint}{where}")
    if verdict.decision not in (Decision.READY, Decision.SLEEPING, Decision.UNKNOWN):
        # A server that answers its health check is no hidden start: it wins.
        aside = hidden_start(seen, svc, own, now, own_holder)
        if aside is not None:
            reason, hint = hidden_words(svc, aside)
            return replace(verdict, decision=Decision.UNKNOWN, reason=reason, hint=hint)
    dropped = unreadable_handle(own)
    if dropped is not None and verdict.decision not in (
        Decision.READY,
        Decision.SLEEPING,
        Decision.UNKNOWN,
        Decision.LOADING,
    ):
        # What salvage kept did not prove its server (a LOADING did): it may run unseen.
        reason, hint = unreadable_words(svc, own, dropped, seen.set_aside)
        return replace(verdict, decision=Decision.UNKNOWN, reason=reason, hint=hint, plan=None)
    if verdict.decision in (Decision.IDLE, Decision.FITS, Decision.PREEMPTABLE):
        unknown = unknown_promises(seen, others, me=svc.name)
        if unknown:
            reason, hint = unknown_words(unknown, seen.records)
            return replace(verdict, decision=Decision.UNKNOWN, reason=reason, hint=hint, plan=None)
    if (
        orphan_is_loading
        and verdict.decision in (Decision.IDLE, Decision.FITS)
        and own is not None
        and orphaned_starts([own], [svc], now)
    ):
        return replace(
            verdict,
            decision=Decision.LOADING,
            reason="a start is under way whose caller went before recording its server "
            f"(counted until {svc.health_timeout_s:.0f}s after it began)",
        )
    return verdict


def unknown_words(names: Sequence[str], records: Mapping[str, Record]) -> tuple[str, str]:
    """(reason, hint) for services whose records promise memory they do not state."""
    first = names[0]
    phase = records[first].phase.value if first in records else "running"
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return (
        f"{first}{more} is {phase} by a record an older gpuctl wrote, which does not say "
        f"how much memory it promises, and this config does not name it: what fits beside "
        f"it is unknown",
        f"run `gpuctl touch {first}` (or ensure it) from a config that names it, which "
        "writes its figures into the record; or stop it there",
    )


def unreadable_words(
    svc: ServiceSpec, rec: Record | None, dropped: str, set_aside: Sequence[SetAside]
) -> tuple[str, str]:
    """(reason, hint) for a record whose handle salvage could not keep whole."""
    copies = [a for a in set_aside if a.service == svc.name]
    kept = max(copies, key=lambda a: a.at) if copies else None
    file = f"records/{kept.file}" if kept else f"the set-aside copy of records/{svc.name}.json"
    phase = rec.phase.value if rec is not None else "running"
    return (
        f"its record says {phase}, but its handle was unreadable ({dropped} failed the "
        f"schema; the file was kept as {file}): its server may run unseen",
        f"look for its server (`gpuctl status --wide`, `ps`); if it runs, stop it by hand; "
        f"then `gpuctl stop {svc.name}` clears the record, and remove {file} once seen",
    )


def slurm_placed(seen: Observation, services: Sequence[ServiceConfig]) -> set[str]:
    """The services whose servers Slurm places: configured with ``launcher = "slurm"``,
    or, for a service the config does not name, recorded with a Slurm job's handle. A
    record's handle is anyone's to write: for a named service the config says which
    launcher runs it, so a forged ``kind`` cannot take its promise off the host's GPUs."""
    named = {s.name for s in services}
    out = {s.name for s in services if s.launcher == "slurm"}
    out.update(
        r.service
        for r in seen.records.values()
        if r.service not in named and (r.handle or {}).get("kind") == "slurm"
    )
    return out


def slurm_verdict(
    svc: ServiceSpec,
    health: Health,
    record: Record | None,
    *,
    handle_alive: bool | None,
    now: float,
    own_holder: str | None,
) -> Verdict:
    """A Slurm job's service, decided without the host's GPU memory: Slurm admits it
    (and queues it while the cluster is full), so gpuctl counts it against no budget and
    nothing against it. ``classify``'s rows that do not read memory still hold: READY on
    a healthy answer, LOADING under another caller's lease or while its job is queued or
    runs, FAILED in its back-off; otherwise it FITS."""
    empty = Snapshot(
        memory_used_mib=None,
        memory_total_mib=None,
        unified_memory=False,
        probe="slurm",
        taken_at=iso_utc(now),
        starting=(),
    )
    verdict = classify(
        svc,
        health,
        empty,
        record=record,
        handle_alive=handle_alive,
        now=now,
        own_holder=own_holder,
    )
    if verdict.decision is Decision.READY and health.url:
        # `{node}` expanded: where the server answers, which the config cannot say.
        return replace(verdict, reason=f"{verdict.reason} at {show_url(health.url)}")
    if verdict.decision in (Decision.READY, Decision.SLEEPING, Decision.LOADING, Decision.FAILED):
        return verdict
    job = (record.handle or {}).get("job_id") if record is not None else None
    if (
        handle_alive is None
        and job
        and record is not None
        and record.phase in (Phase.STARTING, Phase.RUNNING)
    ):
        # Not asked (``status`` does not call squeue): a submitted job may be queued or
        # run, so never FITS, where a second start would submit a second job.
        return Verdict(
            svc.name,
            Decision.LOADING,
            f"Slurm job {job} submitted (not asked whether it runs); "
            f"health: {health.detail or health.state}",
        )
    return Verdict(svc.name, Decision.FITS, SLURM_ADMITS)


SLURM_ADMITS = "Slurm admits it (gpuctl counts no GPU memory for a Slurm job)"


def hidden_start(
    seen: Observation, svc: ServiceSpec, rec: Record | None, now: float, holder: str | None = None
) -> SetAside | None:
    """The set-aside file that may hide a start of ``svc`` (``hidden_by_set_aside``)."""
    kept, timeout = seen.set_aside, svc.health_timeout_s
    return (
        hidden_by_set_aside(svc.name, rec, kept, timeout, now, own_holder=holder) if kept else None
    )


def hidden_words(svc: ServiceSpec, aside: SetAside) -> tuple[str, str]:
    """(reason, hint) for a start a set-aside record may hide."""
    until, file = iso_utc(aside.at + 1.0 + svc.health_timeout_s), f"records/{aside.file}"
    return (
        f"its record was set aside as unreadable ({file}); a start it hid may be loading "
        f"unseen until {until}",
        f"once no start of {svc.name} is under way, remove {file} (`gpuctl locks` lists "
        f"it); or wait until {until}, or until its health answers",
    )


def _accounting(
    seen: Observation, services: Sequence[ServiceConfig], now: float, me: str = ""
) -> tuple[list[ServiceSpec], list[str]]:
    """The services as the memory accounting counts them (each record at its own
    promise, a sleeping one at what it holds), and those whose memory is promised though
    their server may not show yet (a start under way, an orphaned start), leaving out
    ``me``: one set of rules for the decisions and for the status bar. Services the
    records name and ``services`` does not count too, at their records' promises
    (``core.promises``)."""
    configured = as_promised(services, seen.records)
    foreign, _ = strangers(seen.records.values(), (s.name for s in services), exclude=me)
    # ``gpuctl run`` jobs count like services, by the pid their record names.
    specs: list[ServiceSpec] = [
        *_asleep_at_what_they_hold(configured, seen.records, me),
        *_asleep_at_what_they_hold(foreign, seen.records, me),
        *job_specs(seen.records.values(), exclude=me),
    ]
    promised = [
        *starting_services(seen.records.values(), exclude=me),
        *orphaned_starts(seen.records.values(), [*configured, *foreign], now, exclude=me),
        # A start a set-aside record may hide counts at its budget too, and so does a
        # server whose handle salvage could not keep whole.
        *(
            s.name
            for s in services
            if s.name != me
            and (
                hidden_start(seen, s, rec := seen.records.get(s.name), now)
                or unreadable_handle(rec) is not None
            )
        ),
    ]
    return specs, promised


def unknown_promises(
    seen: Observation, services: Sequence[ServiceConfig], me: str = ""
) -> list[str]:
    """Services whose records hold memory without saying how much, and which no config
    here names: nothing beside them can be called free."""
    return strangers(seen.records.values(), (s.name for s in services), exclude=me)[1]


def _asleep_at_what_they_hold(
    others: Sequence[S], records: Mapping[str, Record], me: str
) -> list[S]:
    """Another service asleep (vLLM sleep mode, record phase ``sleeping``) counts at what
    its process still holds, not at its budget: the memory it gave back is free for
    others, and its own wake is admitted again (``gpuctl.flows.ensure.wake``). On unified
    memory a level-1 sleep holds on to its weights, and that is what it then counts at."""

    def asleep(o: S) -> bool:
        r = records.get(o.name)
        return o.name != me and r is not None and r.phase is Phase.SLEEPING

    return [replace(o, memory_mib=None) if asleep(o) else o for o in others]


def is_orphaned_start(record: Record | None, *, held: bool = False) -> bool:
    """A start whose caller went (killed, Ctrl-C) between admission and recording its
    server: phase ``starting``, no live lease, no handle, a start nonce (a launch writes
    it with ``starting``, before its spawn; a preemption making room marks the service
    ``starting`` without one: nothing spawned). Its server may be loading unseen (an
    agent's cached reading, no match keyword yet). ``held``: the caller holds the lease
    itself now (so the lease on the record is its own)."""
    return (
        record is not None
        and record.phase is Phase.STARTING
        and (held or record.lease is None)
        and not record.handle
        and bool(record.start_nonce)
    )


def orphaned_starts(
    records: Iterable[Record], services: Sequence[ServiceSpec], now: float, exclude: str = ""
) -> list[str]:
    """Services with an orphaned start still within their health timeout: they count at
    their budget for everyone else until their own next ``ensure`` finds the server (or
    proves it dead), a ``stop`` ends it, or the health timeout runs out. Counting them
    as nothing admitted a rival 80 GiB service into a server's memory (an OOM)."""
    timeout = {s.name: s.health_timeout_s for s in services}
    return [
        r.service
        for r in records
        if r.service != exclude
        and r.service in timeout
        and is_orphaned_start(r)
        and now < r.since + timeout[r.service]
    ]


def look(
    deps: EnsureDeps,
    health: Health,
    own_holder: str | None = None,
    *,
    fresh: bool = False,
    force: bool = False,
) -> tuple[Verdict, Observation]:
    """Ask the store and the agent about ``deps.service``, and decide. Never raises for an
    unreachable agent or store: the decision is then UNKNOWN. ``fresh``: never from the
    agent's reading cache (the re-check before a launch). ``force``: plan victims with
    requests in flight too (``--force``)."""
    svc = deps.service
    others = deps.config.services_on(svc.host)
    reader = deps.probe.fresh() if fresh else deps.probe.read
    seen = observe(
        deps.store.listing,
        reader,
        others or [svc],
        find_servers=deps.probe.find_servers,
        find_children=deps.probe.find_children,
    )
    record = seen.records.get(svc.name)
    alive = deps.launchers.handle_alive(record) if record is not None and record.handle else None
    judge = partial(
        decide,
        svc,
        health,
        seen,
        others=others,
        now=deps.clock(),
        total_override_mib=deps.host.gpu_memory_mib,
        handle_alive=alive,
        own_holder=own_holder,
        orphan_is_loading=False,
    )
    facts = partial(
        victim_facts,
        seen,
        others,
        svc,
        counts=deps.store.inflight,
        server_in_flight=deps.servers.in_flight,
        machine=deps.machine,
        now=deps.clock(),
    )
    verdict = with_victims(judge(), svc, judge, facts, force=force)
    if verdict.decision is Decision.LOADING and alive and record is not None:
        queued = _queued(deps, record)
        if queued is not None:
            verdict = replace(verdict, reason=queued)
    return verdict, seen


def _queued(deps: EnsureDeps, record: Record) -> str | None:
    """Why a scheduler still queues the server the record names (Slurm's PENDING
    reason), where the service's launcher can tell; None otherwise."""
    from gpuctl.adapters.launchers.base import Handle, QueueReporter

    if (record.handle or {}).get("kind") != "slurm":
        return None
    try:
        launcher = deps.launchers.own(None)
        if not isinstance(launcher, QueueReporter):
            return None
        return launcher.queue_state(Handle.from_dict(dict(record.handle or {})))
    except GpuctlError:
        return None


# Who could be stopped to make room: the facts the victim planner (``gpuctl.core.plan``)
# needs about the work running on a host, and the one way ``status`` and ``ensure`` ask
# for them (``with_victims``), so both say PREEMPTABLE alike.


def with_victims(
    verdict: Verdict,
    svc: ServiceSpec,
    judge: Callable[..., Verdict],
    facts: Callable[[], Mapping[str, VictimFacts]],
    *,
    force: bool = False,
) -> Verdict:
    """``verdict``, or, where it is BUSY, the verdict again with what is known of the
    running work as victims: PREEMPTABLE when stopping some of it would make room, else
    BUSY naming what may not be stopped. ``status`` and ``ensure`` both decide through
    here, so ``status`` says PREEMPTABLE exactly where ``ensure --preempt`` would preempt.

    Asked only when it does not fit: the in-flight counts cost a store read, and a
    server's a request each.
    """
    if verdict.decision is not Decision.BUSY or svc.memory_mib is None:
        return verdict
    victims = facts()
    if not victims:
        return verdict
    again = judge(victims=victims, force=force)
    # A run job has no `preempt` key (its --preempt is a flag of the run itself).
    if again.plan is not None and getattr(svc, "preempt", False) is True:
        # Its `preempt = true` already asks for it: a plain `ensure` stops them.
        stops = ", ".join(again.plan.names)
        hint = f"`gpuctl ensure {svc.name}` stops {stops} to make room (its preempt = true)"
        return replace(again, hint=hint)
    return again


def idle_seconds(r: Record, now: float) -> float:
    """How long ``r``'s service has gone unused: since its last use or since its phase
    began, whichever is later. A start marks a use when it begins, so a server whose
    load outlasted its ``yield_after`` would otherwise be idle the moment it answers,
    and yield before anyone could use it."""
    ref = r.since if r.last_used is None else max(r.last_used, r.since)
    return max(0.0, now - ref)


def could_yield(o: ServiceConfig, idle_s: float) -> bool:
    """Idle past its ``yield_after`` by the clock alone (a batch never): worth reading
    its server's in-flight requests to know whether it yields."""
    return o.kind != "batch" and o.yield_after_s is not None and idle_s >= o.yield_after_s


def _service_facts(
    o: ServiceConfig,
    r: Record,
    stored: Mapping[str, int] | None,
    server_in_flight: Callable[[ServiceConfig], int | None] | None,
    now: float,
) -> VictimFacts:
    """One running service's facts; its server's in-flight metric is read where
    ``server_in_flight`` is given and the store counts none (one request each)."""

    in_flight: int | None = None if stored is None else stored.get(o.name, 0)
    unread = o.launcher == "ollama"  # Ollama says nothing of the requests it serves
    if (
        in_flight == 0
        and server_in_flight is not None
        and o.launcher != "ollama"
        and o.kind != "batch"  # a batch answers no requests: nothing can be in flight
    ):
        try:
            metric = server_in_flight(o)
        except GpuctlError:
            in_flight = None
        else:
            in_flight = metric or 0
            unread = metric is None
    # Idle is known only where the server itself says nothing is in flight: a request
    # sent straight to a server with no metrics to read (not vLLM, Ollama) is invisible
    # to the store's counts, and a yield would cut it. Such a server never yields; a
    # strictly lower priority is stopped as before, its requests being counted as none.
    yield_after = None if unread else o.yield_after_s
    return VictimFacts(
        o.name,
        o.priority,
        managed=o.launcher is not None and (bool(r.handle) or r.phase is Phase.PREEMPTED),
        in_flight=in_flight,
        leased=r.lease is not None or r.phase is not Phase.RUNNING,
        restart_s=expected_start_s(r),
        last_used=r.last_used,
        idle_s=idle_seconds(r, now),
        yield_after_s=yield_after,
        kind=o.kind,
    )


def yielding(
    seen: Observation,
    services: Sequence[ServiceConfig],
    *,
    counts: Callable[[], Mapping[str, int]],
    server_in_flight: Callable[[ServiceConfig], int | None] | None,
    now: float,
) -> dict[str, float]:
    """The servers that would yield now (``core.plan.yields``) to any start or job that
    asks to preempt, with how long each has been idle: for ``status``, on the facts the
    planner reads. The in-flight counts are read only where some server is idle past
    its ``yield_after`` by the clock; where they cannot be read, none is said to yield."""
    slurm = slurm_placed(seen, services)
    idle = [
        (o, r)
        for o in as_promised(services, seen.records)
        if o.name not in slurm
        and (r := seen.records.get(o.name)) is not None
        and r.phase is Phase.RUNNING
        and could_yield(o, idle_seconds(r, now))
    ]
    if not idle:
        return {}
    try:
        stored = counts()
    except GpuctlError:
        return {}
    out: dict[str, float] = {}
    for o, r in idle:
        f = _service_facts(o, r, stored, server_in_flight, now)
        if yields(f) and f.idle_s is not None:
            out[o.name] = f.idle_s
    return out


def victim_facts(
    seen: Observation,
    others: Sequence[ServiceConfig],
    svc: ServiceSpec,
    *,
    counts: Callable[[], Mapping[str, int]],
    server_in_flight: Callable[[ServiceConfig], int | None] | None = None,
    machine: Machine,
    now: float | None = None,
) -> dict[str, VictimFacts]:
    """What the planner needs of each other service that runs: its priority, whether
    gpuctl can stop it (a launcher, and a record naming its server), a lease on it, what
    a restart costs (its recorded start durations), its last use, and its requests in
    flight (``counts``: the store's; and, for services of lower priority,
    ``server_in_flight``: the server's own metric). A count that cannot be read (a
    ``GpuctlError``) is unknown: such a service is no victim. A run job is one only where
    it can be signalled (``core.jobs.unreachable``): on this machine (``machine``), or on
    the machine the snapshot was read on (the agent's; for a host read without one, this
    machine).

    A server of equal or higher priority is a victim only where it yields
    (``core.plan.yields``): for it, ``idle_s`` is ``now`` (None: this machine's clock)
    less its last use (or, never used, when its phase began), its server's in-flight
    metric is read only once it is idle past its ``yield_after``, and ``kind`` and
    ``yield_after_s`` come from its config.

    A server Slurm places (``slurm_placed``) is never a victim, nor yields: who runs
    first and who is preempted there is Slurm's priority, and a stop around it would
    only free a node Slurm hands to its queue. ``reclaim`` of an idle one still cancels
    it (that is its owner giving the job up, not gpuctl choosing between users)."""
    if now is None:
        now = time.time()

    # Each at its record's own figures: its priority is what its start promised.
    slurm = slurm_placed(seen, others)
    others = as_promised(others, seen.records)
    candidates = [
        o
        for o in others
        if o.name != svc.name
        and o.name not in slurm
        and (r := seen.records.get(o.name)) is not None
        # PREEMPTED too: one another caller is stopping now is named as such (a start or
        # stop under way), not as a process gpuctl did not start.
        and r.phase in (Phase.RUNNING, Phase.STARTING, Phase.PREEMPTED)
    ]
    stored: Mapping[str, int] | None = {}
    if candidates:
        try:
            stored = counts()
        except GpuctlError:
            stored = None
    out: dict[str, VictimFacts] = {}
    for o in candidates:
        r = seen.records[o.name]
        ask = o.priority < svc.priority or could_yield(o, idle_seconds(r, now))
        out[o.name] = _service_facts(o, r, stored, server_in_flight if ask else None, now)
    foreign, _ = strangers(seen.records.values(), (o.name for o in others), exclude=svc.name)
    for f in foreign:
        r = seen.records[f.name]
        if f.name in slurm:
            continue
        if r.phase in (Phase.RUNNING, Phase.STARTING, Phase.PREEMPTED):
            # This config does not say how to stop it (no launcher): it holds its room.
            out[f.name] = VictimFacts(
                f.name, f.priority, managed=False, in_config=False, last_used=r.last_used
            )
    jobs = job_specs(seen.records.values(), exclude=svc.name)
    # Asked only where a job runs: reading this machine's identity costs a file read.
    here = machine.here if jobs else None
    agent = seen.snapshot.host if seen.snapshot is not None else None
    for job in jobs:
        # A run job has no requests: --preemptible says whether it may be stopped, and
        # where its CMD runs whether anyone here can.
        assert here is not None
        out[job.name] = VictimFacts(
            job.name,
            job.priority,
            job=True,
            preemptible=job.preemptible,
            in_flight=0,
            unreachable=unreachable(seen.records[job.name].handle or {}, here, agent),
        )
    return out


# The wait queue of ``gpuctl run --wait`` (``gpuctl.core.queue``) as a service sees it:
# ``ensure`` and ``status`` ask the same question of an IDLE or FITS verdict.

HELD_BACK_HINT = (
    "it starts once the queue's head has its room; or give the service a higher priority"
)


def service_held_back(
    waiters: Iterable[Waiter],
    *,
    priority: int,
    need_mib: int | None,
    verdict: Verdict,
    snapshot: Snapshot | None,
    total_override_mib: int | None,
) -> str | None:
    """Under the admission lock, before a service (``ensure``, ``resume``, the proxy)
    launches on an IDLE or FITS verdict: why it must not (a live head of higher
    priority whose room it would take; ``core.queue.held_back``), or None. ``status``
    asks the same of an IDLE or FITS verdict, so it says BUSY where ``ensure`` would.
    ``waiters``: the store's live queue (``Store.waiters``)."""
    devices = snapshot.device_list() if snapshot is not None else ()
    totals = {
        d.index: d.memory_total_mib if d.memory_total_mib is not None else total_override_mib
        for d in devices
    }
    known = [t for t in totals.values() if t is not None]
    # IDLE: nothing holds the GPU, its whole memory is free.
    free = verdict.free_mib if verdict.free_mib is not None else totals.get(verdict.gpu or 0)
    head = held_back(
        waiters,
        priority=priority,
        need_mib=verdict.need_mib if verdict.need_mib is not None else need_mib,
        free_mib=free,
        largest_mib=max(known) if known else None,
    )
    if head is None:
        return None
    return waiter_reason(head, time.strftime("%H:%M:%S", time.localtime(head.since)))
