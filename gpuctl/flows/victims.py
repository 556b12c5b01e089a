"""Who could be stopped to make room: the facts the victim planner needs
(``gpuctl.core.plan``) about the work running on a host, and the one way ``status`` and
``ensure`` ask for them (``with_victims``), so both say PREEMPTABLE alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Decision, ServiceSpec, Verdict
from gpuctl.core.jobs import job_specs, unreachable
from gpuctl.core.model import HostIdentity
from gpuctl.core.plan import VictimFacts, yields
from gpuctl.core.promised_specs import as_promised, strangers
from gpuctl.core.record import Phase, Record
from gpuctl.errors import GpuctlError

if TYPE_CHECKING:
    from gpuctl.flows.observe import Observation


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
    from gpuctl.core.durations import expected_start_s

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
    idle = [
        (o, r)
        for o in as_promised(services, seen.records)
        if (r := seen.records.get(o.name)) is not None
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
    here: HostIdentity | None = None,
    now: float | None = None,
) -> dict[str, VictimFacts]:
    """What the planner needs of each other service that runs: its priority, whether
    gpuctl can stop it (a launcher, and a record naming its server), a lease on it, what
    a restart costs (its recorded start durations), its last use, and its requests in
    flight (``counts``: the store's; and, for services of lower priority,
    ``server_in_flight``: the server's own metric). A count that cannot be read (a
    ``GpuctlError``) is unknown: such a service is no victim. A run job is one only where
    it can be signalled (``core.jobs.unreachable``): on this machine (``here``; None: this
    one), or on the machine the snapshot was read on (the agent's; for a host read
    without one, this machine).

    A server of equal or higher priority is a victim only where it yields
    (``core.plan.yields``): for it, ``idle_s`` is ``now`` (None: this machine's clock)
    less its last use (or, never used, when its phase began), its server's in-flight
    metric is read only once it is idle past its ``yield_after``, and ``kind`` and
    ``yield_after_s`` come from its config."""
    if now is None:
        import time

        now = time.time()

    # Each at its record's own figures: its priority is what its start promised.
    others = as_promised(others, seen.records)
    candidates = [
        o
        for o in others
        if o.name != svc.name
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
        if r.phase in (Phase.RUNNING, Phase.STARTING, Phase.PREEMPTED):
            # This config does not say how to stop it (no launcher): it holds its room.
            out[f.name] = VictimFacts(
                f.name, f.priority, managed=False, in_config=False, last_used=r.last_used
            )
    jobs = job_specs(seen.records.values(), exclude=svc.name)
    if jobs and here is None:
        from gpuctl.adapters.procinfo import host_identity

        here = host_identity()
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
