"""``ensure``: make a service ready, starting it only when that is safe, exactly once.

The steps (a service is started only after a fresh look under the admission lease):

1. health check; if it answers: touch, done (READY);
2. otherwise ask the store and the agent, and decide (``gpuctl.flows.observe``);
3. IDLE / FITS: take the lease, re-check under it, launch, record the handle, wait;
4. LOADING: wait, never launch; BUSY: exit 3, naming who holds the GPU;
   UNKNOWN: exit 4, never start blind; FAILED: exit 1 with the failure.

Everything it touches comes in through ``EnsureDeps``, so a test can hand it a real
agent, a real store and a real launcher, or fakes for pure units. The waits are
``gpuctl.flows.wait``; the result is ``gpuctl.flows.results.EnsureResult``.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from gpuctl import failpoints
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store import Holder, holder_here
from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.durations import expected_start_s
from gpuctl.core.model import Snapshot
from gpuctl.core.record import LEASE_MARGIN_S, Phase, Record
from gpuctl.errors import AgentAuthError, AgentUnavailable, GpuctlError, StoreError
from gpuctl.flows.admission import ADMISSION, AdmissionTimeout, admission
from gpuctl.flows.deps import EnsureDeps, describe_handle
from gpuctl.flows.hints import refusal_hint
from gpuctl.flows.observe import is_orphaned_start, look
from gpuctl.flows.results import EnsureResult, Outcome
from gpuctl.flows.run_queue import HELD_BACK_HINT, service_held_back
from gpuctl.flows.wait import BystanderWatch, LauncherWatch, Waited, wait_ready

__all__ = ["ADMISSION", "MAX_ROUNDS", "ensure", "launch_under_lease", "on_its_gpu"]

MAX_ROUNDS = 3


class _Ctx:
    """One ``ensure`` call: its deadline, its notes, and how it words a result."""

    def __init__(self, deps: EnsureDeps, timeout_s: float) -> None:
        self.deps = deps
        self.t0 = deps.clock()
        self.deadline = self.t0 + timeout_s
        self.notes: list[str] = []
        # What a start of it usually takes (the median of its recent ones), for the
        # progress bar; None before its first successful start.
        self.expected_s: float | None = None

    def elapsed(self) -> float:
        return self.deps.clock() - self.t0

    def note_once(self, note: str) -> None:
        """A note for the result, once per kind (its words before any detail)."""
        head = note.partition(";")[0].partition("(")[0].strip()
        if not any(n.startswith(head) for n in self.notes):
            self.notes.append(note)

    def result(
        self, outcome: Outcome, reason: str, decision: Decision | str, **kw: Any
    ) -> EnsureResult:
        kw.setdefault("hint", refusal_hint(self.deps, outcome))
        return EnsureResult(
            service=self.deps.service.name,
            host=self.deps.host.name,
            outcome=outcome,
            reason=reason,
            decision=str(decision),
            waited_s=self.elapsed(),
            notes=self.notes,
            **kw,
        )

    def from_verdict(self, verdict: Verdict, **kw: Any) -> EnsureResult:
        outcome = _REFUSALS.get(verdict.decision, Outcome.FAILED)
        kw.setdefault("hint", refusal_hint(self.deps, outcome, verdict))
        return self.result(outcome, verdict.reason, verdict.decision, **kw)

    def from_wait(self, w: Waited, decision: Decision, **kw: Any) -> EnsureResult:
        assert w.outcome is not None
        kw.setdefault("hint", refusal_hint(self.deps, w.outcome, w.verdict))
        return self.result(w.outcome, w.reason, w.decision or decision, log_tail=w.log_tail, **kw)


_REFUSALS = {
    Decision.BUSY: Outcome.BUSY,
    # Without --preempt (or preempt = true) a plan is only reported: exit 3, naming it.
    Decision.PREEMPTABLE: Outcome.BUSY,
    Decision.UNKNOWN: Outcome.UNKNOWN,
    Decision.FAILED: Outcome.FAILED,
}


def ensure(deps: EnsureDeps, *, timeout_s: float | None = None, wait: bool = True) -> EnsureResult:
    """Make ``deps.service`` ready. Returns a result; raises only for misuse.

    Ctrl-C (KeyboardInterrupt) stops waiting and never kills the server: the lease is
    released, the record keeps the server's handle, and the next caller waits for it.
    """
    svc = deps.service
    ctx = _Ctx(deps, timeout_s if timeout_s is not None else svc.health_timeout_s)
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


def _heal(ctx: _Ctx) -> None:
    """Heal the host's records before deciding (``gpuctl.flows.heal``): a victim left
    ``preempted`` over its live server by a killed preemptor is a victim again, and a
    record over a dead server no longer holds its room. Each repair is said at once
    (stderr) and kept in the result's notes."""
    deps = ctx.deps
    if deps.heal_look is None:
        return
    from gpuctl.flows.heal import heal, health_timeouts, repair_lines

    try:
        records = deps.store.records()
    except GpuctlError:
        return  # the round's own read reports it
    repairs = heal(
        deps.store,
        records,
        deps.heal_look,
        deps.entry,
        clock=deps.clock,
        abandoned_after=health_timeouts(deps.config),
    )
    for line in repair_lines(deps.host.name, repairs):
        ctx.notes.append(line)
        if deps.on_repair is not None:
            deps.on_repair(line)


def _bystander(ctx: _Ctx, decision: Decision, reason: str, hint: str = "") -> EnsureResult | None:
    """Wait for someone else's start; None when it ended and this caller may start it.
    ``hint``: the decision's own advice, kept for a timeout (the start may not be ours)."""
    waited = wait_ready(ctx, BystanderWatch(ctx, reason))
    if waited.outcome is None:
        return None
    if waited.outcome is Outcome.READY:
        _touch(ctx, ready=True)
    if waited.outcome is Outcome.TIMEOUT and hint and waited.verdict is None:
        return ctx.from_wait(waited, decision, hint=hint)
    return ctx.from_wait(waited, decision)


def _ensure_round(ctx: _Ctx, wait: bool) -> EnsureResult | None:
    """One look and what follows from it; None means "look again"."""
    deps, svc = ctx.deps, ctx.deps.service
    health = deps.check_health()
    if health.ok:
        if _touch(ctx, ready=True) is _STOPPING:
            # It answers, but a stop (gpuctl stop, reclaim) holds its lease and will end
            # it: not ready. Wait for the stop, then look again (and start it).
            return _after_stop(ctx, wait)
        return ctx.result(Outcome.READY, f"{svc.name} answers its health check", Decision.READY)

    verdict, seen = look(deps, health)
    first = verdict.decision
    ctx.expected_s = _expected(seen.records.get(svc.name), deps.clock())
    if first is Decision.FAILED:
        record = seen.records.get(svc.name)
        f = record.failure if record else None
        return ctx.from_verdict(verdict, log_tail=f.log_tail if f else "")
    if first is Decision.PREEMPTABLE and (deps.preempt or svc.preempt) and verdict.plan:
        from gpuctl.flows.preempt import preempt

        return preempt(ctx, verdict, seen.snapshot, wait, launch_under_lease)
    if first in _REFUSALS:
        return ctx.from_verdict(verdict)
    if first is Decision.SLEEPING and deps.wake_server is not None:
        from gpuctl.flows.wake import wake

        return wake(ctx, wait, lambda: admission(ctx), deps.wake_server)
    orphan = first is Decision.LOADING and is_orphaned_start(seen.records.get(svc.name))
    if first in (Decision.LOADING, Decision.SLEEPING) and not orphan:
        ctx.notes.append(f"found it {first.value}: {verdict.reason}")
        _touch(ctx)
        if not wait:
            return ctx.result(Outcome.LOADING, verdict.reason, first, hint=verdict.hint)
        if verdict.hint and deps.notice is not None:
            # Only a keyword ties what it waits for to the service: it may be somebody
            # else's process, and the wait would run to the timeout for nothing.
            deps.notice(f"{svc.name}: waiting for {verdict.reason}; {verdict.hint}")
        return _bystander(ctx, first, verdict.reason, verdict.hint)
    # IDLE or FITS: take the lease; whoever holds it is the only one who launches. A
    # start whose caller went before recording its server (LOADING: the agent names
    # that server by its start nonce) is adopted under the lease: its handle recorded.
    holder = holder_here(deps.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    granted, _ = deps.store.acquire(svc.name, holder, ttl, svc.promise())
    if not granted:
        if not wait:
            return ctx.result(Outcome.LOADING, "another caller is starting it", Decision.LOADING)
        return _bystander(ctx, Decision.LOADING, "another caller holds the lease")
    return launch_under_lease(ctx, holder, ttl, first, wait)


def on_its_gpu(svc: ServiceConfig, verdict: Verdict, snapshot: Snapshot | None) -> ServiceConfig:
    """The service as launched: on a host of several GPUs, pinned to the GPU admission
    found room on (``CUDA_VISIBLE_DEVICES``), since CUDA would otherwise put it on GPU 0,
    where it may not fit. A service whose ``env`` pins it already is left as it is."""
    if (
        verdict.gpu is None
        or snapshot is None
        or len(snapshot.device_list()) < 2
        or "CUDA_VISIBLE_DEVICES" in svc.env
    ):
        return svc
    return replace(svc, env={**svc.env, "CUDA_VISIBLE_DEVICES": str(verdict.gpu)})


def launch_under_lease(
    ctx: _Ctx,
    holder: Holder,
    ttl: float,
    first: Decision,
    wait: bool,
    *,
    restore: dict[str, Any] | None = None,
) -> EnsureResult | None:
    """``restore``: what the record was before a caller (``ensure --preempt``) marked it
    ``starting`` to promise its memory; put back on every path that launches nothing
    (a refusal, the deadline, an exception), so no `starting` record without a start
    stays behind to hold the room."""
    deps, svc = ctx.deps, ctx.deps.service
    released = False
    unlaunched = restore

    def release(update: dict[str, Any] | None = None) -> None:
        nonlocal released
        if released:
            return
        released = True  # once: a failed release is not retried (the lease expires by itself)
        if update is None and unlaunched is not None:
            update = unlaunched
        try:
            deps.store.release(svc.name, holder.id, update)
        except GpuctlError as e:
            ctx.notes.append(f"could not release the lease: {e.message} (it expires by itself)")

    try:
        # Re-check, then spawn, one service at a time on the host (the admission lock):
        # otherwise two services could each re-check before the other spawned, and both
        # start into the same memory.
        with admission(ctx):
            # Between our look and the lease, someone may have started it (their lease
            # released, the server loading), or another service may have taken the memory.
            health = deps.check_health()
            if health.ok:
                release({"touch": True, "phase": Phase.RUNNING.value})
                return ctx.result(
                    Outcome.READY, f"{svc.name} answers its health check", Decision.READY
                )
            # Fresh, never the agent's cached reading: a server spawned a moment ago by a
            # caller that then died is in no cache yet.
            verdict, seen = look(deps, health, own_holder=holder.id, fresh=True)
            own = seen.records.get(svc.name)
            adopted: Handle | None = None
            if verdict.decision in (
                Decision.IDLE,
                Decision.FITS,
                Decision.LOADING,
            ) and is_orphaned_start(own, held=True):
                # A start whose caller died before recording its server: find that server
                # (by its start nonce) before starting another.
                assert own is not None
                try:
                    adopted = deps.make_launcher(seen.snapshot).find(svc, own.start_nonce)
                except GpuctlError as e:
                    release()
                    return ctx.result(
                        Outcome.UNKNOWN,
                        f"cannot tell whether the start under way still runs: {e.message}",
                        Decision.UNKNOWN,
                    )
            if verdict.decision not in (Decision.IDLE, Decision.FITS) and adopted is None:
                release()
                if verdict.decision is not Decision.LOADING:
                    return ctx.from_verdict(verdict)
                if not wait:
                    return ctx.result(
                        Outcome.LOADING, verdict.reason, verdict.decision, hint=verdict.hint
                    )
                waiting: Verdict | None = verdict
            elif adopted is not None:
                waiting = None
                launcher = deps.make_launcher(seen.snapshot)
                assert own is not None
                started_at = own.since
                handle = adopted
                unlaunched = None
                deps.store.update(svc.name, holder.id, {"handle": handle.to_dict()})
                ctx.notes.append(
                    f"found the server of an earlier start whose caller went ({describe_handle(handle)})"
                )
            else:
                waiting = None
                if deps.clock() >= ctx.deadline:
                    # Never launch after our own deadline: the caller has given up on us.
                    release()
                    return ctx.result(
                        Outcome.TIMEOUT,
                        f"did not start {svc.name}: the timeout ran out before it was admitted",
                        first,
                    )
                # Services are not queued, but do not take the room of a higher-priority
                # waiter at the head of the `run --wait` queue (core.queue says why).
                held = service_held_back(
                    deps.store.waiters(),
                    priority=svc.priority,
                    need_mib=svc.memory_mib,
                    verdict=verdict,
                    snapshot=seen.snapshot,
                    total_override_mib=deps.host.gpu_memory_mib,
                )
                if held is not None:
                    release()
                    return ctx.result(
                        Outcome.BUSY,
                        held,
                        Decision.BUSY,
                        hint=HELD_BACK_HINT,
                    )
                launcher = deps.make_launcher(seen.snapshot)
                started_at = deps.clock()
                nonce = secrets.token_hex(8)
                # From here a start is under way (its nonce recorded): never put back.
                unlaunched = None
                # `starting` under the admission lock: from now on the others count this
                # service at its budget, even before its server exists. The nonce goes
                # into the server's environment: if we die before recording the server,
                # the next caller finds it by the nonce.
                deps.store.update(
                    svc.name,
                    holder.id,
                    {
                        "phase": Phase.STARTING.value,
                        "handle": None,
                        "touch": True,
                        "start_nonce": nonce,
                        # The agent polls it to move a start whose caller went (or
                        # did not wait) to `running` once the server answers.
                        "health": svc.health,
                    },
                )
                try:
                    handle = launcher.start(on_its_gpu(svc, verdict, seen.snapshot), nonce)
                except (GpuctlError, OSError) as e:
                    msg = e.message if isinstance(e, GpuctlError) else str(e)
                    attempt = _attempt(started_at, deps.clock(), launcher.kind, "failed", msg)
                    release({"attempt": attempt, "failure": {"error": msg, "log_tail": ""}})
                    hint = e.hint if isinstance(e, GpuctlError) and e.hint else None
                    return ctx.result(
                        Outcome.FAILED,
                        f"start failed: {msg}",
                        first,
                        launched=False,
                        attempt=attempt,
                        **({"hint": hint} if hint else {}),
                    )
                try:
                    try:
                        # The window the nonce covers (a kill -9 here): spawned, not recorded.
                        failpoints.hit("ensure.after_spawn")
                    finally:
                        # Recorded even on Ctrl-C, so the next caller need not look for it.
                        deps.store.update(svc.name, holder.id, {"handle": handle.to_dict()})
                except KeyboardInterrupt:
                    # A Ctrl-C here (or during that write) ends as one while waiting does:
                    # server recorded, attempt `interrupted`, lease given back.
                    interrupted = _attempt(started_at, deps.clock(), launcher.kind, "interrupted")
                    release({"attempt": interrupted, "handle": handle.to_dict()})
                    raise
        if waiting is not None:
            return _bystander(ctx, waiting.decision, waiting.reason, waiting.hint)
        if not wait and adopted is not None:
            release()
            return ctx.result(
                Outcome.LOADING,
                f"found its server loading ({describe_handle(handle)}); not waiting",
                Decision.LOADING,
                handle=handle.to_dict(),
            )
        if not wait:
            attempt = _attempt(started_at, deps.clock(), launcher.kind, "started")
            release({"attempt": attempt})
            return ctx.result(
                Outcome.STARTED,
                f"launched with {launcher.kind}; not waiting",
                first,
                launched=adopted is None,
                attempt=attempt,
                handle=handle.to_dict(),
            )
        try:
            waited = wait_ready(ctx, LauncherWatch(ctx, launcher, handle, holder, ttl))
        except KeyboardInterrupt:
            attempt = _attempt(started_at, deps.clock(), launcher.kind, "interrupted")
            release({"attempt": attempt})
            raise
        outcome = waited.outcome
        assert outcome is not None  # only a bystander is told to look again
        attempt = _attempt(
            started_at,
            deps.clock(),
            launcher.kind,
            outcome.value,
            waited.reason if outcome is not Outcome.READY else None,
        )
        update: dict[str, Any] = {"attempt": attempt}
        if outcome is Outcome.READY:
            update.update({"phase": Phase.RUNNING.value, "failure": None, "touch": True})
        elif outcome is Outcome.FAILED:
            update["failure"] = {"error": waited.reason, "log_tail": waited.log_tail}
        release(update)
        return ctx.from_wait(
            waited, first, launched=adopted is None, attempt=attempt, handle=handle.to_dict()
        )
    except AdmissionTimeout as e:
        return ctx.result(
            Outcome.TIMEOUT,
            f"did not start {svc.name}: the timeout ran out while another start held the "
            f"host's admission lock ({e.who})",
            first,
        )
    finally:
        if not released:
            release()


def _attempt(
    started: float, ended: float, kind: str, outcome: str, error: str | None = None
) -> dict[str, Any]:
    a: dict[str, Any] = {
        "started": round(started, 3),
        "ended": round(ended, 3),
        "duration_s": round(ended - started, 3),
        "launcher": kind,
        "outcome": outcome,
    }
    if error:
        a["error"] = error
    return a


def _expected(record: Record | None, now: float) -> float | None:
    """What is left of a start, by the median of the recent ones: all of it for a start
    of our own; for one under way already (we wait for it), less what it has run."""
    expected = expected_start_s(record)
    if expected is None or record is None or record.phase is not Phase.STARTING:
        return expected
    return max(1.0, expected - max(0.0, now - record.since))


_STOPPING = object()


def _touch(ctx: _Ctx, ready: bool = False) -> object:
    """Mark it used; ``_STOPPING`` when a stop holds its lease (the touch then lost)."""
    try:
        svc = ctx.deps.service
        rec = ctx.deps.store.touch(svc.name, ready=ready, promise=svc.promise())
    except AgentAuthError:
        # Not a passing failure: with a token that may not write (the read-only one)
        # every use would go unrecorded, and reclaim would stop the server under its user.
        raise
    except GpuctlError as e:
        ctx.notes.append(f"could not mark it used: {e.message}")
        return None
    from gpuctl.adapters.store.inflight import stopping

    return _STOPPING if stopping(rec) else None


def _after_stop(ctx: _Ctx, wait: bool) -> EnsureResult | None:
    """Wait (within the deadline) for a stop under way to end; None: look again."""
    deps, svc = ctx.deps, ctx.deps.service
    from gpuctl.adapters.store.inflight import stopping

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


# One ``ensure`` call's context, as the preemption flow sees it.
Ctx = _Ctx
