"""``ensure`` on a SLEEPING service: wake it (vLLM sleep mode), as safely as a start.

A sleeping server gave its GPU memory back, and others may have taken it since. So a
wake is admitted like a start: under the service's lease and the host's admission lock,
it re-checks that the memory it needs (its budget, less what it still holds) is free,
and only then posts ``/wake_up`` (for level 2: the weights, ``reload_weights``, the KV
cache). A wake that would not fit is BUSY, naming who holds the memory; vLLM is never
asked to wake into an out-of-memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from gpuctl.core.decision import Decision, owns
from gpuctl.core.record import LEASE_MARGIN_S, Phase
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.units import format_mib
from gpuctl.errors import GpuctlError
from gpuctl.flows import story
from gpuctl.flows.ensure.context import Ctx
from gpuctl.flows.look import keywords
from gpuctl.flows.op_results import EnsureResult, Outcome
from gpuctl.flows.wait import BystanderWatch, wait_ready


def wake_fits(
    total_mib: int | None, used_mib: int | None, held_mib: int, budget_mib: int | None
) -> tuple[bool, str]:
    """Whether a sleeping service's budget fits back (pure). ``held_mib``: what its own
    process still holds (counted in ``used_mib``). Unknown figures never fit."""
    if budget_mib is None:
        return True, "no memory budget to check"
    if total_mib is None or used_mib is None:
        return False, "the GPU's memory is unknown, so a wake cannot be admitted"
    need = max(0, budget_mib - held_mib)
    free = total_mib - used_mib
    if need <= free:
        return True, f"needs {format_mib(need)} more, {format_mib(free)} free"
    return False, (
        f"waking needs {format_mib(need)} more but only {format_mib(max(free, 0))} of "
        f"{format_mib(total_mib)} is free"
    )


def wake(
    ctx: Ctx,
    wait: bool,
    admission: Callable[[], AbstractContextManager[None]],
    post_wake: Callable[[str, int], None],
) -> EnsureResult | None:
    """Wake the service; None means "look again" (it was no longer asleep).

    Args:
        ctx: the ``ensure`` call.
        wait: wait for health after the wake.
        admission: the host-wide admission lock.
        post_wake: ``(health URL, sleep level)`` → wakes the server (``ServerChecks.wake``).
    """
    deps, svc = ctx.deps, ctx.deps.service
    holder = deps.machine.holder(ctx.req.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    granted, _ = deps.store.acquire(svc.name, holder, ttl, svc.promise())
    if not granted:
        # Someone else is waking (or stopping) it: wait as a bystander.
        waited = wait_ready(ctx, BystanderWatch(ctx, "another caller holds the lease"))
        return None if waited.outcome is None else ctx.from_wait(waited, Decision.SLEEPING)
    update: RecordUpdate | None = None
    try:
        with admission():
            health = deps.servers.health()
            if health.ok:
                update = RecordUpdate(phase=Phase.RUNNING, touch=True)
                return ctx.result(Outcome.READY, f"{svc.name} answers its health check", "READY")
            if health.state != "sleeping":
                return None  # stopped or gone meanwhile: decide again
            snap = deps.probe.read(keywords([svc]), [])

            held = sum(p.memory_mib or 0 for p in snap.processes if owns(svc, p.command))
            total = snap.memory_total_mib or deps.host.gpu_memory_mib
            fits, why = wake_fits(total, snap.memory_used_mib, held, svc.memory_mib)
            if not fits:
                holders = ", ".join(
                    f"pid {p.pid} ({format_mib(p.memory_mib)})"
                    for p in snap.processes
                    if not owns(svc, p.command)
                )
                return ctx.result(
                    Outcome.BUSY, f"{why}; held by {holders or 'nothing we can name'}", "BUSY"
                )
            assert svc.health is not None  # a SLEEPING decision came from its health URL
            try:
                post_wake(svc.health, svc.sleep_level or 1)
            except GpuctlError as e:
                return ctx.result(
                    Outcome.FAILED, f"wake failed: {e.message}", Decision.SLEEPING, hint=e.hint
                )
            deps.store.update(
                svc.name,
                holder.id,
                RecordUpdate(phase=Phase.RUNNING, touch=True),
                event=story.ev(
                    "wake",
                    svc.name,
                    ctx.req.entry,
                    before="sleeping",
                    after=Phase.RUNNING,
                    reason=why,
                    budget_mib=story.mib(svc.memory_mib),
                ),
            )
            ctx.notes.append(f"woke it from sleep level {svc.sleep_level or 1} ({why})")
        if not wait:
            return ctx.result(Outcome.LOADING, "woken; not waiting", Decision.SLEEPING)
        waited = wait_ready(ctx, BystanderWatch(ctx, "waking from sleep"))
        if waited.outcome is None:
            return None
        if waited.outcome is Outcome.READY:
            update = RecordUpdate(touch=True)
        return ctx.from_wait(waited, Decision.SLEEPING)
    finally:
        with contextlib.suppress(GpuctlError):
            deps.store.release(svc.name, holder.id, update)
