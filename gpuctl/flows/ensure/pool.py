"""``ensure`` over a pool (``hosts = [...]``): pick the host, exactly once across the pool,
then the single-host ``ensure`` there.

The pick, in order: where the service is READY (or asleep: woken there); where it is
LOADING (that start is joined); where it FITS, the tightest fit first, so the roomiest
hosts stay whole; where it is PREEMPTABLE, by the cheapest plan across the pool; else
BUSY, naming why on each host. A host that cannot be asked (UNKNOWN) is skipped and
named; all of them UNKNOWN is UNKNOWN.

Exactly once: a start takes the lease of the pool's record (``_pool.NAME``) on the
pool's coordinator, the host whose identity (hostname, boot id, state folder, as its
agent reports them) sorts first: the same host for every caller, whatever its config
calls the hosts or in which order it lists them. Under that lease it looks at every host
again, picks, records on the coordinator where the copy runs (``runs_on``), and starts
it there with the single-host ``ensure`` (which takes that host's own lease). A rival
that finds the pool's lease held waits and looks again: it finds the start LOADING and
joins it (``POOL_LEASE_S`` says why that lease is short). While any host of the pool is UNKNOWN (the coordinator among them) nothing is
started, since a copy may run where nobody can see: a copy READY or LOADING elsewhere
still answers. That copy is joined only (``EnsureRequest.join_only``): gone by the time
the join gets there, it is not started again by the join, outside the pool's lease and
its UNKNOWN rule; the pool looks again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
from msgspec.structs import replace

from gpuctl import failpoints
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.plan import plan_cost
from gpuctl.core.pool import host_key, identity_order, pool_record, room_left
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import GpuctlError
from gpuctl.flows.deps import Closers, EnsureDeps, EnsureRequest
from gpuctl.flows.ensure.context import JoinEnded
from gpuctl.flows.ensure.rounds import ensure
from gpuctl.flows.look import look
from gpuctl.flows.op_results import EnsureResult, Outcome

T = TypeVar("T")

# How often a caller that found the pool's start lock held (or the copy it joined
# gone) looks again.
POLL_S = 0.25
# The pool's lease covers the pick and the chosen host's own lease (taken within a
# second or two of the pick, and held through the start and its wait): from then on
# every caller finds the service LOADING there and joins it, so the pool's lease is not
# renewed. A holder that dies holds the pool's starts back this long at most.
POOL_LEASE_S = 60.0
# Joined where found: the start is under way, or the server is there.
_THERE = (Decision.READY, Decision.SLEEPING, Decision.LOADING)
_FITS = (Decision.IDLE, Decision.FITS)


class PoolDeps(Closers, kw_only=True):
    """One ``EnsureDeps`` per host of the pool, in the config's order, each with the
    service placed on its host (``ServiceConfig.on``)."""

    members: list[EnsureDeps]
    # ``ensure --host H``: start it on H alone (the pool's lease still taken, so no
    # second copy starts elsewhere); None: the pool picks.
    only: str | None = None

    @property
    def first(self) -> EnsureDeps:
        return self.members[0]


class View(msgspec.Struct, frozen=True):
    """One host of the pool as a look found it."""

    deps: EnsureDeps
    decision: Decision
    reason: str
    verdict: Verdict | None = None
    # Its identity (``core.pool``), and the order the coordinator is chosen by.
    key: str | None = None
    order: tuple[str, str, str] | None = None

    @property
    def host(self) -> str:
        return self.deps.host.name


def ensure_pool(pd: PoolDeps, req: EnsureRequest | None = None) -> EnsureResult:
    """Make the pooled service ready on one host of its pool (see the module docstring)."""
    req = req or EnsureRequest()
    first = pd.first
    clock = first.clock
    timeout_s = req.timeout_s if req.timeout_s is not None else first.service.health_timeout_s
    t0 = clock()
    deadline = t0 + timeout_s
    while True:
        try:
            answer = _round(pd, req, (t0, deadline))
        except JoinEnded as e:
            # The copy looked at (READY, LOADING) went before it was joined: look again,
            # so that a start goes through the pool's lease, and none while a host of the
            # pool cannot be asked (the join alone would have started it there).
            if clock() >= deadline:
                return _result(
                    pd,
                    [],
                    first,
                    Outcome.TIMEOUT,
                    f"{e}, and the timeout ran out",
                    decision=Decision.LOADING,
                    t0=t0,
                )
            first.sleep(POLL_S)  # the hosts may not agree yet that it went
            continue
        if answer is not None:
            return answer


def _round(pd: PoolDeps, req: EnsureRequest, times: tuple[float, float]) -> EnsureResult | None:
    """One look at the pool and what follows: the answer, or None to look again."""
    first = pd.first
    clock, sleep = first.clock, first.sleep
    t0, deadline = times
    views = _each_host(lambda m: _view(m, force=req.force), pd.members)
    answer = _without_start(pd, views, _within(req, deadline, clock()))
    if answer is not None:
        return answer
    coord = min((v for v in views), key=lambda v: v.order or ("", "", ""))
    store = coord.deps.store
    name = pool_record(first.service.name)
    holder = coord.deps.machine.holder(req.entry)
    try:
        granted, _ = store.acquire(name, holder, POOL_LEASE_S)
    except GpuctlError as e:
        return _result(
            pd,
            views,
            first,
            Outcome.UNKNOWN,
            f"cannot take the pool's start lock on host {coord.host}: {e.message}",
            decision=Decision.UNKNOWN,
            t0=t0,
        )
    if not granted:
        if not req.wait:
            return _result(
                pd,
                views,
                first,
                Outcome.LOADING,
                "another caller is starting it in the pool",
                decision=Decision.LOADING,
                t0=t0,
            )
        if clock() >= deadline:
            return _result(
                pd,
                views,
                first,
                Outcome.TIMEOUT,
                "another caller held the pool's start lock until the deadline",
                decision=Decision.LOADING,
                t0=t0,
            )
        sleep(POLL_S)
        return None
    try:
        return _start_under_lease(pd, req, coord, (name, holder.id), (t0, deadline))
    finally:
        with contextlib.suppress(GpuctlError):  # else the lease expires by itself
            store.release(name, holder.id)


def _within(req: EnsureRequest, deadline: float, now: float) -> EnsureRequest:
    """``req`` for a join: within what is left of the call's deadline."""
    return replace(req, timeout_s=max(0.0, deadline - now))


def _start_under_lease(
    pd: PoolDeps,
    req: EnsureRequest,
    coord: View,
    lease: tuple[str, str],
    times: tuple[float, float],
) -> EnsureResult:
    """Holding the pool's lease (``lease``: the record's name and the holder's id): look
    at every host again (fresh), pick, record where, and start there within the deadline
    (``times``: the call's start and its deadline)."""
    name, holder_id = lease
    t0, deadline = times
    views = _each_host(lambda m: _view(m, force=req.force, fresh=True), pd.members)
    answer = _without_start(
        pd, views, _within(req, deadline, coord.deps.clock()), recorded=_recorded(coord, name)
    )
    if answer is not None:
        return answer
    chosen, refusal = _pick_start(pd, views, req, t0)
    if chosen is None:
        assert refusal is not None
        return refusal
    if chosen.key is not None:
        coord.deps.store.update(name, holder_id, RecordUpdate(runs_on=chosen.key))
    left = max(0.0, deadline - chosen.deps.clock())
    preempt = req.preempt or chosen.decision is Decision.PREEMPTABLE
    result = ensure(chosen.deps, replace(req, timeout_s=left, preempt=preempt))
    return _decorated(pd, views, result, chosen)


def _recorded(coord: View, name: str) -> str | None:
    """Where the coordinator's record says the copy was started (None: nowhere known)."""
    try:
        return coord.deps.store.get(name).runs_on
    except GpuctlError:
        return None


def _each_host(fn: Callable[[EnsureDeps], T], members: Sequence[EnsureDeps]) -> list[T]:
    """``fn`` of each host, in the config's order: at once, a thread each, so a host that
    answers slowly (or times out) costs its own time, not the sum of all the hosts'
    times. The calls are blocking HTTP requests with their own timeouts, on clients that
    are safe across threads."""
    if len(members) <= 1:
        return [fn(m) for m in members]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(members))) as threads:
        return list(threads.map(fn, members))


def _view(deps: EnsureDeps, *, force: bool, fresh: bool = False) -> View:
    """The service on one host: its health, else the decision of a look there."""
    try:
        health = deps.servers.health()
        if health.ok:
            return View(deps, Decision.READY, f"{deps.service.name} answers its health check")
        verdict, seen = look(deps, health, fresh=fresh, force=force)
    except GpuctlError as e:
        return View(deps, Decision.UNKNOWN, e.message)
    snap = seen.snapshot
    if verdict.decision is Decision.UNKNOWN or snap is None:
        return View(deps, Decision.UNKNOWN, verdict.reason, verdict)
    if snap.host is None:
        return View(deps, Decision.UNKNOWN, "its agent names no host identity", verdict)
    ident = (snap.host.hostname, snap.host.boot_id, snap.state_dir)
    return View(
        deps,
        verdict.decision,
        verdict.reason,
        verdict,
        key=host_key(*ident),
        order=identity_order(*ident),
    )


def _without_start(
    pd: PoolDeps, views: Sequence[View], req: EnsureRequest, recorded: str | None = None
) -> EnsureResult | None:
    """The answer that needs no start: the copy is there (READY, asleep, LOADING), or a
    host cannot be asked (no start then). None: a start is to be decided."""
    there = [v for v in views if v.decision in _THERE]
    elsewhere = [v for v in there if pd.only is not None and v.host != pd.only]
    if elsewhere and len(elsewhere) == len(there):
        v = elsewhere[0]
        asked = next(m for m in pd.members if m.host.name == pd.only)  # the host refused
        return _result(
            pd,
            views,
            asked,
            Outcome.BUSY,
            f"the pool's copy is {v.decision.value} on host {v.host}, not {pd.only}",
            decision=Decision.BUSY,
            t0=pd.first.clock(),
            hint=f"drop --host to use it there, or `gpuctl stop {v.deps.service.name} "
            f"--host {v.host}` first",
        )
    there = [v for v in there if v not in elsewhere]
    if there:
        # READY first, then asleep, then LOADING; among equals the host the
        # coordinator's record names, then the config's order.
        rank = {d: i for i, d in enumerate(_THERE)}
        best = min(
            there,
            key=lambda v: (rank[v.decision], v.key != recorded if recorded else False),
        )
        failpoints.hit("pool.join")
        joined = ensure(best.deps, replace(req, join_only=True))
        return _decorated(pd, views, joined, best)
    unknown = [v for v in views if v.decision is Decision.UNKNOWN]
    if len(unknown) == len(views):
        return _result(
            pd,
            views,
            pd.first,
            Outcome.UNKNOWN,
            "no host of the pool can be asked: " + _each(unknown),
            decision=Decision.UNKNOWN,
            t0=pd.first.clock(),
        )
    if unknown:
        # The host the answer names is the one that stops the start (the line reads
        # "UNKNOWN on b"), never a host that answered.
        return _result(
            pd,
            views,
            unknown[0].deps,
            Outcome.UNKNOWN,
            f"not started: a copy may run where nobody can see ({_each(unknown)})",
            decision=Decision.UNKNOWN,
            t0=pd.first.clock(),
            hint="check those hosts' agents (`gpuctl status`); a start waits until every "
            "host of the pool answers",
        )
    return None


def _pick_start(
    pd: PoolDeps, views: Sequence[View], req: EnsureRequest, t0: float
) -> tuple[View | None, EnsureResult | None]:
    """Where to start it: the tightest fit, else the cheapest preemption plan (when the
    caller or the service asks to preempt); else the refusal naming each host."""
    if pd.only is not None:
        views = [v for v in views if v.host == pd.only]
    fits = [v for v in views if v.decision in _FITS and v.verdict is not None]
    if fits:
        return min(fits, key=lambda v: _left(v.verdict)), None
    plans = [
        v
        for v in views
        if v.decision is Decision.PREEMPTABLE and v.verdict is not None and v.verdict.plan
    ]
    if plans:
        cheapest = min(plans, key=lambda v: plan_cost(v.verdict.plan))  # type: ignore[union-attr, arg-type]
        if req.preempt or pd.first.service.preempt:
            return cheapest, None
        verdict = cheapest.verdict
        assert verdict is not None
        return None, _result(
            pd,
            views,
            cheapest.deps,
            Outcome.BUSY,
            f"fits on no host as things are; the cheapest plan is on {cheapest.host}: "
            f"{verdict.reason}",
            decision=Decision.PREEMPTABLE,
            t0=t0,
            hint=verdict.hint,
        )
    failed = [v for v in views if v.decision is Decision.FAILED]
    decision = Decision.FAILED if failed and len(failed) == len(views) else Decision.BUSY
    outcome = Outcome.FAILED if decision is Decision.FAILED else Outcome.BUSY
    return None, _result(
        pd,
        views,
        pd.first,
        outcome,
        "no host of the pool has room: " + _each(views),
        decision=decision,
        t0=t0,
    )


def _left(verdict: Verdict | None) -> float:
    assert verdict is not None
    return room_left(verdict.free_mib, verdict.need_mib)


def _each(views: Sequence[View]) -> str:
    """``dgx1: BUSY (…); dgx2: UNKNOWN (…)``."""
    return "; ".join(f"{v.host}: {v.decision.value} ({v.reason})" for v in views)


def _skipped(views: Sequence[View]) -> list[str]:
    return [
        f"skipped host {v.host}: UNKNOWN ({v.reason})"
        for v in views
        if v.decision is Decision.UNKNOWN
    ]


def _decorated(
    pd: PoolDeps, views: Sequence[View], result: EnsureResult, chosen: View
) -> EnsureResult:
    """A member's result as the pool's: its host, the pool, and the hosts skipped."""
    notes = [*_skipped(views), *result.notes]
    pool = tuple(m.host.name for m in pd.members)
    return replace(result, host=chosen.host, pool=pool, notes=notes)


def _result(
    pd: PoolDeps,
    views: Sequence[View],
    deps: EnsureDeps,
    outcome: Outcome,
    reason: str,
    *,
    decision: Decision,
    t0: float,
    hint: str = "",
) -> EnsureResult:
    pool = tuple(m.host.name for m in pd.members)
    skipped = _skipped(views) if outcome is not Outcome.UNKNOWN else []
    return EnsureResult(
        service=deps.service.name,
        host=deps.host.name,
        outcome=outcome,
        reason=reason,
        decision=decision.value,
        waited_s=max(0.0, deps.clock() - t0),
        notes=skipped,
        hint=hint,
        pool=pool,
    )


def members_of(make: Callable[[str], EnsureDeps], hosts: Sequence[str]) -> list[EnsureDeps]:
    """One ``EnsureDeps`` per host, in order."""
    return [make(h) for h in hosts]
