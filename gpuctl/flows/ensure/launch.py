"""The launch under the admission lease: re-check, record ``starting``, start, record the
handle, wait. Exactly-once is decided here: no ``starting`` record without a start, no
start without a fresh look under the lease."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from gpuctl import failpoints
from gpuctl.adapters.launchers.base import Handle
from gpuctl.config import ServiceConfig
from gpuctl.config.slurm_fields import names_node
from gpuctl.core.decision import Decision, Verdict
from gpuctl.core.durations import expected_start_s
from gpuctl.core.record import Holder, Phase, Record
from gpuctl.core.record_shapes import RecordUpdate, StartFailure
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import GpuctlError
from gpuctl.flows import story
from gpuctl.flows.admission import AdmissionTimeout, admission
from gpuctl.flows.deps import describe_handle
from gpuctl.flows.ensure.context import Ctx, bystander, found_server, no_start_on_a_join
from gpuctl.flows.look import HELD_BACK_HINT, is_orphaned_start, look, service_held_back
from gpuctl.flows.op_results import EnsureResult, Outcome, StartInterrupted
from gpuctl.flows.wait import LauncherWatch, wait_ready

if TYPE_CHECKING:
    from gpuctl.core.events import Event


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


def _answered(url: str | None) -> dict[str, Any]:
    """The record's ``health`` where the URL that answered is not the service's as
    written (a Slurm job's ``{node}`` expanded): the agent's poll and ``status`` read it
    there, since neither asks Slurm for the node."""
    return {"health": url} if url else {}


def launch_under_lease(
    ctx: Ctx,
    holder: Holder,
    ttl: float,
    first: Decision,
    wait: bool,
    *,
    restore: RecordUpdate | None = None,
) -> EnsureResult | None:
    """``restore``: what the record was before a caller (``ensure --preempt``) marked it
    ``starting`` to promise its memory; put back on every path that launches nothing
    (a refusal, the deadline, an exception), so no `starting` record without a start
    stays behind to hold the room."""
    deps, svc = ctx.deps, ctx.deps.service
    released = False
    unlaunched = restore
    # The start under way (its nonce recorded, or an earlier start's server adopted):
    # a Ctrl-C anywhere after that gives the lease back with the attempt `interrupted`,
    # and the server's handle once the launcher has returned it. Before it, the record
    # keeps `starting` and the nonce, by which the next caller finds the server.
    began: float | None = None
    kind = ""
    known: Handle | None = None

    def release(update: RecordUpdate | None = None, event: Event | None = None) -> None:
        nonlocal released
        if released:
            return
        released = True  # once: a failed release is not retried (the lease expires by itself)
        if update is None and unlaunched is not None:
            update = unlaunched
        try:
            deps.store.release(svc.name, holder.id, update, event=event)
        except GpuctlError as e:
            ctx.notes.append(f"could not release the lease: {e.message} (it expires by itself)")

    try:
        # Re-check, then spawn, one service at a time on the host (the admission lock):
        # otherwise two services could each re-check before the other spawned, and both
        # start into the same memory.
        with admission(ctx):
            # Between our look and the lease, someone may have started it (their lease
            # released, the server loading), or another service may have taken the memory.
            health = deps.servers.health()
            if health.ok:
                found = found_server(ctx)
                release(
                    RecordUpdate(touch=True, phase=Phase.RUNNING, **_answered(health.url))
                    if found is None
                    else RecordUpdate(
                        touch=True,
                        phase=Phase.RUNNING,
                        handle=found.handle,
                        **_answered(health.url),
                    )
                )
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
                    adopted = deps.launchers.own(seen.snapshot).find(svc, own.start_nonce)
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
                launcher = deps.launchers.own(seen.snapshot)
                assert own is not None
                started_at = own.since
                handle = adopted
                unlaunched = None
                began, kind, known = started_at, launcher.kind, handle
                deps.store.update(svc.name, holder.id, RecordUpdate(handle=handle.to_dict()))
                ctx.notes.append(
                    f"found the server of an earlier start whose caller went ({describe_handle(handle)})"
                )
            else:
                waiting = None
                if ctx.req.join_only:
                    release()
                    no_start_on_a_join(ctx)
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
                # A Slurm job waits in Slurm's queue, not in this host's.
                held = (
                    None
                    if svc.launcher == "slurm"
                    else service_held_back(
                        deps.store.waiters(),
                        priority=svc.priority,
                        need_mib=svc.memory_mib,
                        verdict=verdict,
                        snapshot=seen.snapshot,
                        total_override_mib=deps.host.gpu_memory_mib,
                    )
                )
                if held is not None:
                    release()
                    return ctx.result(
                        Outcome.BUSY,
                        held,
                        Decision.BUSY,
                        hint=HELD_BACK_HINT,
                    )
                launcher = deps.launchers.own(seen.snapshot)
                started_at = deps.clock()
                nonce = secrets.token_hex(8)
                # `starting` under the admission lock: from now on the others count this
                # service at its budget, even before its server exists. The nonce goes
                # into the server's environment: if we die before recording the server,
                # the next caller finds it by the nonce.
                story.tell(deps.store, story.admitted(svc, ctx.req.entry, verdict, own))
                deps.store.update(
                    svc.name,
                    holder.id,
                    RecordUpdate(
                        phase=Phase.STARTING,
                        handle=None,
                        touch=True,
                        start_nonce=nonce,
                        # The agent polls it to move a start whose caller went (or
                        # did not wait) to `running` once the server answers. A
                        # Slurm job's `{node}` is not known yet: nothing to poll
                        # until its node answers (`_answered`).
                        health=None if names_node(svc.health) else svc.health,
                    ),
                    event=story.ev(
                        "launch",
                        svc.name,
                        ctx.req.entry,
                        before=own and own.phase,
                        after=Phase.STARTING,
                        budget_mib=story.mib(svc.memory_mib),
                        command=svc.command,
                    ),
                )
                # From here a start is under way (its nonce recorded): never put back.
                unlaunched = None
                began, kind = started_at, launcher.kind
                try:
                    handle = launcher.start(on_its_gpu(svc, verdict, seen.snapshot), nonce)
                except (GpuctlError, OSError) as e:
                    msg = e.message if isinstance(e, GpuctlError) else str(e)
                    attempt = _attempt(started_at, deps.clock(), launcher.kind, "failed", msg)
                    release(
                        RecordUpdate(attempt=attempt, failure=StartFailure(msg)),
                        story.ended(
                            svc,
                            ctx.req.entry,
                            Outcome.FAILED,
                            msg,
                            log_tail="",
                            started_at=started_at,
                            handle=None,
                        ),
                    )
                    hint = e.hint if isinstance(e, GpuctlError) and e.hint else None
                    return ctx.result(
                        Outcome.FAILED,
                        f"start failed: {msg}",
                        first,
                        launched=False,
                        attempt=attempt,
                        **({"hint": hint} if hint else {}),
                    )
                known = handle
                try:
                    # The window the nonce covers (a kill -9 here): spawned, not recorded.
                    failpoints.hit("ensure.after_spawn")
                finally:
                    # Recorded even on Ctrl-C, so the next caller need not look for it.
                    deps.store.update(svc.name, holder.id, RecordUpdate(handle=handle.to_dict()))
        if waiting is not None:
            return bystander(ctx, waiting.decision, waiting.reason, waiting.hint)
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
            release(RecordUpdate(attempt=attempt))
            return ctx.result(
                Outcome.STARTED,
                f"launched with {launcher.kind}; not waiting",
                first,
                launched=adopted is None,
                attempt=attempt,
                handle=handle.to_dict(),
            )
        watch = LauncherWatch(ctx, launcher, handle, holder, ttl)
        waited = wait_ready(ctx, watch)
        outcome = waited.outcome
        assert outcome is not None  # only a bystander is told to look again
        attempt = _attempt(
            started_at,
            deps.clock(),
            launcher.kind,
            outcome.value,
            waited.reason if outcome is not Outcome.READY else None,
        )
        update = RecordUpdate(attempt=attempt)
        if outcome is Outcome.READY:
            update = RecordUpdate(
                attempt=attempt,
                phase=Phase.RUNNING,
                failure=None,
                touch=True,
                **_answered(waited.url),
            )
        elif outcome is Outcome.FAILED:
            failure = StartFailure(waited.reason, waited.log_tail)
            update = RecordUpdate(attempt=attempt, failure=failure)
        release(
            update,
            story.ended(
                svc,
                ctx.req.entry,
                outcome,
                waited.reason,
                log_tail=waited.log_tail,
                started_at=started_at,
                handle=handle.to_dict(),
                now=deps.clock(),
                memory_mib=watch.memory_mib,
            ),
        )
        return ctx.from_wait(
            waited, first, launched=adopted is None, attempt=attempt, handle=handle.to_dict()
        )
    except KeyboardInterrupt:
        if began is None:
            raise
        if not released:
            attempt = _attempt(began, deps.clock(), kind, "interrupted")
            release(
                RecordUpdate(attempt=attempt)
                if known is None
                else RecordUpdate(attempt=attempt, handle=known.to_dict())
            )
        raise StartInterrupted from None  # the caller says its server keeps loading
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


def expected_left_s(record: Record | None, now: float) -> float | None:
    """What is left of a start, by the median of the recent ones: all of it for a start
    of our own; for one under way already (we wait for it), less what it has run."""
    expected = expected_start_s(record)
    if expected is None or record is None or record.phase is not Phase.STARTING:
        return expected
    return max(1.0, expected - max(0.0, now - record.since))
