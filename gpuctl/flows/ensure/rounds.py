"""``ensure``: make a service ready, starting it only when that is safe, exactly once.

The steps (a service is started only after a fresh look under the admission lease):

1. health check; if it answers: touch, done (READY);
2. otherwise ask the store and the agent, and decide (``gpuctl.flows.look``);
3. IDLE / FITS: take the lease, re-check under it, launch, record the handle, wait;
4. LOADING: wait, never launch; BUSY: exit 3, naming who holds the GPU;
   UNKNOWN: exit 4, never start blind; FAILED: exit 1 with the failure.

What the caller asks comes in as an ``EnsureRequest``; everything it touches, through
``EnsureDeps``'s ports, so a test can hand it a real
agent, a real store and a real launcher, or fakes for pure units. The waits are
``gpuctl.flows.wait``; the result is ``gpuctl.flows.results.EnsureResult``.
"""

from __future__ import annotations

import contextlib

from gpuctl.core.decision import Decision
from gpuctl.core.record import LEASE_MARGIN_S, stopping
from gpuctl.errors import AgentUnavailable, GpuctlError, StoreError
from gpuctl.flows.admission import admission
from gpuctl.flows.deps import EnsureDeps, EnsureRequest
from gpuctl.flows.ensure.context import (
    REFUSALS,
    STOPPING,
    Ctx,
    bystander,
    no_start_on_a_join,
    touch,
)
from gpuctl.flows.ensure.launch import expected_left_s, launch_under_lease
from gpuctl.flows.ensure.preempt import preempt
from gpuctl.flows.ensure.wake import wake
from gpuctl.flows.heal import heal, health_timeouts, repair_lines
from gpuctl.flows.look import is_orphaned_start, look
from gpuctl.flows.op_results import EnsureResult, Outcome, StartInterrupted
from gpuctl.flows.results import CHECKING, Progress

MAX_ROUNDS = 3
# A look that ends in a start of our own: its ETA is told at once. (A LOADING one may
# be a process that only names the service, with no ETA: its wait tells what it knows.)
_OWN_START = (Decision.IDLE, Decision.FITS)


def ensure(deps: EnsureDeps, req: EnsureRequest | None = None) -> EnsureResult:
    """Make ``deps.service`` ready, as ``req`` asks (default: wait up to its health
    timeout, preempt nothing). Returns a result; raises only for misuse.

    Ctrl-C (KeyboardInterrupt) stops waiting and never kills the server: the lease is
    released, the record keeps the server's handle, and the next caller waits for it.
    """
    req = req or EnsureRequest()
    ctx = Ctx(deps, req)
    wait = req.wait
    _heal(ctx)
    for _ in range(MAX_ROUNDS):
        try:
            result = _ensure_round(ctx, wait)
        except (StoreError, AgentUnavailable) as e:
            # A lock held too long, a read-only state dir, an agent gone mid-way: still a
            # result, so --json prints its object (the store's hint names the file).
            outcome = Outcome.UNKNOWN if isinstance(e, AgentUnavailable) else Outcome.FAILED
            kw = {"hint": e.hint} if e.hint else {}
            return ctx.result(outcome, e.message, Decision.UNKNOWN, **kw)
        if result is not None:
            return result
    return ctx.result(
        Outcome.FAILED,
        f"the starts under way ended {MAX_ROUNDS} times without a running server",
        Decision.LOADING,
    )


def _heal(ctx: Ctx) -> None:
    """Heal the host's records before deciding (``gpuctl.flows.heal``): a victim left
    ``preempted`` over its live server by a killed preemptor is a victim again, and a
    record over a dead server no longer holds its room. Each repair is said at once
    (stderr) and kept in the result's notes."""
    deps = ctx.deps
    if deps.servers.truth is None:
        return

    try:
        records = deps.store.records()
    except GpuctlError:
        return  # the round's own read reports it
    repairs = heal(
        deps.store,
        records,
        deps.servers.truth,
        ctx.req.entry,
        new_holder=deps.machine.holder,
        clock=deps.clock,
        abandoned_after=health_timeouts(deps.config),
    )
    for line in repair_lines(deps.host.name, repairs):
        ctx.notes.append(line)
        if deps.tell.on_repair is not None:
            deps.tell.on_repair(line)


def _ensure_round(ctx: Ctx, wait: bool) -> EnsureResult | None:
    """One look and what follows from it; None means "look again"."""
    deps, svc = ctx.deps, ctx.deps.service
    health = deps.servers.health()
    if health.ok:
        if touch(ctx, ready=True, url=health.url) is STOPPING:
            # It answers, but a stop (gpuctl stop, reclaim) holds its lease and will end
            # it: not ready. Wait for the stop, then look again (and start it).
            return _after_stop(ctx, wait)
        return ctx.result(Outcome.READY, f"{svc.name} answers its health check", Decision.READY)

    verdict, seen = look(deps, health, force=ctx.req.force)
    first = verdict.decision
    ctx.expected_s = expected_left_s(seen.records.get(svc.name), deps.clock())
    if ctx.expected_s is not None and first in _OWN_START and deps.tell.progress is not None:
        # The ETA as soon as it is known: the proxy's Retry-After for a request it holds
        # past queue_timeout is this, even before the launch's first tick.
        deps.tell.progress(Progress(CHECKING, ctx.elapsed(), expected_s=ctx.expected_s))
    if first is Decision.FAILED:
        record = seen.records.get(svc.name)
        f = record.failure if record else None
        return ctx.from_verdict(verdict, log_tail=f.log_tail if f else "")
    if first is Decision.PREEMPTABLE and (ctx.req.preempt or svc.preempt) and verdict.plan:
        no_start_on_a_join(ctx)  # before any victim stops
        return preempt(ctx, verdict, seen.snapshot, wait)
    if first in REFUSALS:
        return ctx.from_verdict(verdict)
    if first is Decision.SLEEPING and deps.servers.wake is not None:
        return wake(ctx, wait, lambda: admission(ctx), deps.servers.wake)
    orphan = first is Decision.LOADING and is_orphaned_start(seen.records.get(svc.name))
    if first in (Decision.LOADING, Decision.SLEEPING) and not orphan:
        ctx.notes.append(f"found it {first.value}: {verdict.reason}")
        touch(ctx)
        if not wait:
            return ctx.result(Outcome.LOADING, verdict.reason, first, hint=verdict.hint)
        if verdict.hint and deps.tell.notice is not None:
            # Only a keyword ties what it waits for to the service: it may be somebody
            # else's process, and the wait would run to the timeout for nothing.
            deps.tell.notice(f"{svc.name}: waiting for {verdict.reason}; {verdict.hint}")
        # The hint comes with a wait tied to the service by a keyword alone.
        return bystander(ctx, first, verdict.reason, verdict.hint, ours=not verdict.hint)
    # IDLE or FITS: take the lease; whoever holds it is the only one who launches. A
    # start whose caller went before recording its server (LOADING: the agent names
    # that server by its start nonce) is adopted under the lease: its handle recorded.
    holder = deps.machine.holder(ctx.req.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    try:
        granted, _ = deps.store.acquire(svc.name, holder, ttl, svc.promise())
        if not granted:
            if not wait:
                return ctx.result(
                    Outcome.LOADING, "another caller is starting it", Decision.LOADING
                )
            return bystander(ctx, Decision.LOADING, "another caller holds the lease")
        return launch_under_lease(ctx, holder, ttl, first, wait)
    except StartInterrupted:
        raise  # the launch gave the lease back, with its attempt
    except KeyboardInterrupt:
        # A Ctrl-C as the lease was granted (its answer still on the wire) or before the
        # launch took charge of it: give back whatever is ours. A release by a holder
        # that does not hold the lease changes nothing, so a second one is harmless.
        with contextlib.suppress(GpuctlError):
            deps.store.release(svc.name, holder.id)
        raise


def _after_stop(ctx: Ctx, wait: bool) -> EnsureResult | None:
    """Wait (within the deadline) for a stop under way to end; None: look again."""
    deps, svc = ctx.deps, ctx.deps.service

    ctx.note_once("found it being stopped; waiting for the stop to end")
    if not wait:
        return ctx.result(Outcome.LOADING, "a stop of it is under way", Decision.LOADING)
    while deps.clock() < ctx.deadline:
        try:
            if not stopping(deps.store.get(svc.name)):
                return None
        except GpuctlError:
            pass
        deps.sleep(0.25)
    return ctx.result(
        Outcome.TIMEOUT, f"{svc.name} was still being stopped at the deadline", Decision.LOADING
    )
