"""One ``ensure`` call's context, shared by its rounds, its launch, its wake and its
preemption: the deadline, the notes, how it words a result, and the two steps every part
takes (mark the service used; wait for someone else's start)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.record import LEASE_MARGIN_S, Phase, Record, stopping
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import AgentAuthError, GpuctlError
from gpuctl.flows import story
from gpuctl.flows.deps import EnsureDeps, EnsureRequest, describe_handle
from gpuctl.flows.hints import refusal_hint
from gpuctl.flows.op_results import EnsureResult, Outcome
from gpuctl.flows.wait import BystanderWatch, Waited, wait_ready


class JoinEnded(Exception):
    """An ``ensure`` asked only to join (``EnsureRequest.join_only``) found nothing left
    to join where it would start one: the caller looks again and decides by its own
    rules. Raised before anything is launched or stopped."""


def no_start_on_a_join(ctx: Ctx) -> None:
    """Raise ``JoinEnded`` where a join-only ``ensure`` would start the service."""
    if ctx.req.join_only:
        raise JoinEnded(
            f"{ctx.deps.service.name} on host {ctx.deps.host.name} went before it was joined"
        )


class Ctx:
    """One ``ensure`` call: what it was asked, its deadline, its notes, and how it words a
    result."""

    def __init__(self, deps: EnsureDeps, req: EnsureRequest) -> None:
        self.deps, self.req = deps, req
        timeout_s = req.timeout_s if req.timeout_s is not None else deps.service.health_timeout_s
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
        outcome = REFUSALS.get(verdict.decision, Outcome.FAILED)
        if verdict.decision is not Decision.FAILED:  # a refusal (a failed start told its own)
            story.tell(self.deps.store, story.refused(self.deps.service, self.req.entry, verdict))
        kw.setdefault("hint", refusal_hint(self.deps, outcome, verdict))
        return self.result(outcome, verdict.reason, verdict.decision, **kw)

    def from_wait(self, w: Waited, decision: Decision, **kw: Any) -> EnsureResult:
        assert w.outcome is not None
        kw.setdefault("hint", refusal_hint(self.deps, w.outcome, w.verdict))
        return self.result(w.outcome, w.reason, w.decision or decision, log_tail=w.log_tail, **kw)


REFUSALS = {
    Decision.BUSY: Outcome.BUSY,
    # Without --preempt (or preempt = true) a plan is only reported: exit 3, naming it.
    Decision.PREEMPTABLE: Outcome.BUSY,
    Decision.UNKNOWN: Outcome.UNKNOWN,
    Decision.FAILED: Outcome.FAILED,
}


def bystander(
    ctx: Ctx, decision: Decision, reason: str, hint: str = "", *, ours: bool = True
) -> EnsureResult | None:
    """Wait for someone else's start; None when it ended and this caller may start it.
    ``hint``: the decision's own advice, kept for a timeout (the start may not be ours).
    ``ours``: False when only a keyword ties what loads to the service."""
    waited = wait_ready(ctx, BystanderWatch(ctx, reason, ours=ours))
    if waited.outcome is None:
        return None
    if waited.outcome is Outcome.READY:
        touch(ctx, ready=True, url=waited.url)
    if waited.outcome is Outcome.TIMEOUT and hint and waited.verdict is None:
        return ctx.from_wait(waited, decision, hint=hint)
    return ctx.from_wait(waited, decision)


STOPPING = object()


def touch(ctx: Ctx, ready: bool = False, url: str | None = None) -> object:
    """Mark it used; ``STOPPING`` when a stop holds its lease (the touch then lost).
    ``url``: the health URL that answered where it is not the service's as written (a
    Slurm job's ``{node}`` expanded), recorded where the record keeps another."""
    try:
        svc = ctx.deps.service
        rec = ctx.deps.store.touch(svc.name, ready=ready, promise=svc.promise())
        if ready and unrecorded_server(rec):
            record_found_server(ctx)
        if ready and url and rec.health != url and not stopping(rec):
            record_health(ctx, url)
    except AgentAuthError:
        # Not a passing failure: with a token that may not write (the read-only one)
        # every use would go unrecorded, and reclaim would stop the server under its user.
        raise
    except GpuctlError as e:
        ctx.notes.append(f"could not mark it used: {e.message}")
        return None

    return STOPPING if stopping(rec) else None


def unrecorded_server(rec: Record | None) -> bool:
    """A server that answers while its record names none: its caller went between the
    spawn and recording it (phase and start nonce written, no handle), and a touch or
    the agent then marked it ready. No lease: a live one is the caller that records it."""
    return (
        rec is not None
        and rec.phase in (Phase.STARTING, Phase.RUNNING)
        and not rec.handle
        and bool(rec.start_nonce)
        and rec.lease is None
    )


def record_found_server(ctx: Ctx) -> None:
    """Record the handle of an unrecorded start's server, under the lease (a stop holding
    it wins: nothing is written). Without a handle, stop, heal and reclaim could tell its
    process only by the nonce; with one, by its pid or container. Best effort: a failure
    leaves the record as it was, for a later use to find."""
    _write_under_lease(ctx, lambda: found_server(ctx), "the server of an earlier start")


def record_health(ctx: Ctx, url: str) -> None:
    """Record the URL its server answered on, under the lease (a stop or start holding
    it wins: nothing is written, a later use tries again). Best effort."""
    _write_under_lease(ctx, lambda: RecordUpdate(health=url), "where its server answers")


def _write_under_lease(ctx: Ctx, update: Callable[[], RecordUpdate | None], what: str) -> None:
    """Take the lease, write ``update()`` (made once it is held) and let it go; when
    another holder has it, write nothing. A store error is said in the notes."""
    deps, svc = ctx.deps, ctx.deps.service
    holder = deps.machine.holder(ctx.req.entry)
    try:
        granted, _ = deps.store.acquire(svc.name, holder, LEASE_MARGIN_S)
        if not granted:
            return
        deps.store.release(svc.name, holder.id, update())
    except GpuctlError as e:
        ctx.notes.append(f"could not record {what}: {e.message}")


def found_server(ctx: Ctx) -> RecordUpdate | None:
    """The caller holds the lease: when the record names no server but a start nonce,
    find that start's server by it; the update that records its handle, or None (also
    when the store or the launcher cannot be asked: said in the notes)."""
    deps, svc = ctx.deps, ctx.deps.service
    try:
        rec = deps.store.get(svc.name)
        if rec.handle or not rec.start_nonce:
            return None
        # The snapshot names the host's machine: a process launcher finds servers only
        # on the machine it runs on.
        handle = deps.launchers.own(deps.probe.read((), ())).find(svc, rec.start_nonce)
    except GpuctlError as e:
        ctx.notes.append(f"could not look for the server of an earlier start: {e.message}")
        return None
    if handle is None:
        return None
    ctx.notes.append(
        f"found the server of an earlier start whose caller went ({describe_handle(handle)})"
    )
    return RecordUpdate(handle=handle.to_dict())
