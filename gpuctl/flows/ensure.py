"""``ensure``: make a service ready, starting it only when that is safe, exactly once.

The flow of the original design, made safe (DESIGN §3-§4):

1. health check; if it answers: touch, done (READY);
2. otherwise ask the agent and the store, and classify;
3. IDLE / FITS: take the lease, re-check under it, launch, record the handle, wait;
4. LOADING: wait, never launch; BUSY: exit 3, naming who holds the GPU;
   UNKNOWN: exit 4, never start blind; FAILED: exit 1 with the failure.

Everything it touches comes in through ``EnsureDeps``, so a test can hand it a real
agent, a real store and a real launcher, or fakes for pure units.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpuctl.adapters.launchers.base import Handle, Launcher
from gpuctl.adapters.store import Holder, Store
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.decision import Decision, Health, Verdict, classify
from gpuctl.core.model import Snapshot
from gpuctl.core.record import (
    LEASE_MARGIN_S,
    Phase,
    Record,
    recorded_servers,
    starting_services,
)
from gpuctl.errors import ExitCode, GpuctlError, StoreError

POLL_S = 0.2


def _poll_pause() -> float:
    """About POLL_S, spread a little: callers that started together would otherwise poll
    in lockstep, and all notice a ready server at the same late moment."""
    return POLL_S * random.uniform(0.75, 1.25)


LIVENESS_EVERY_S = 1.0
DEAD_503_IN_A_ROW = 4

OUTCOME_EXIT = {
    "ready": ExitCode.OK,
    "started": ExitCode.OK,
    "loading": ExitCode.OK,
    "busy": ExitCode.BUSY,
    "unknown": ExitCode.UNKNOWN,
    "failed": ExitCode.FAILED,
    "timeout": ExitCode.TIMEOUT,
    "interrupted": 130,
}


@dataclass(frozen=True, slots=True)
class Progress:
    """One tick of the wait, for the status line."""

    phase: str
    elapsed_s: float
    memory_mib: int | None = None
    log_line: str = ""
    note: str = ""


@dataclass
class EnsureDeps:
    """The adapters ``ensure`` works with (see ``gpuctl.flows.wiring.deps_for``)."""

    config: Config
    service: ServiceConfig
    host: HostConfig
    store: Store
    # (match keywords, recorded server pids) -> the host's snapshot
    read_snapshot: Callable[[Sequence[str], Sequence[int]], Snapshot]
    check_health: Callable[[], Health]
    make_launcher: Callable[[Snapshot | None], Launcher]
    handle_alive: Callable[[Record], bool | None] = lambda r: None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    progress: Callable[[Progress], None] | None = None
    entry: str = "ensure"
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the clients the adapters opened (agent connections)."""
        for c in self.closers:
            c()
        self.closers.clear()


@dataclass
class EnsureResult:
    service: str
    host: str
    outcome: str
    reason: str
    decision: str
    launched: bool = False
    waited_s: float = 0.0
    attempt: dict[str, Any] | None = None
    log_tail: str = ""
    handle: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return OUTCOME_EXIT[self.outcome]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "service": self.service,
            "host": self.host,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "decision": self.decision,
            "launched": self.launched,
            "waited_s": round(self.waited_s, 3),
            "attempt": self.attempt,
            "log_tail": self.log_tail,
            "handle": self.handle,
            "notes": self.notes,
        }


class _Ctx:
    def __init__(self, deps: EnsureDeps, timeout_s: float) -> None:
        self.d = deps
        self.t0 = deps.clock()
        self.deadline = self.t0 + timeout_s
        self.notes: list[str] = []

    def elapsed(self) -> float:
        return self.d.clock() - self.t0

    def result(
        self, outcome: str, reason: str, decision: Decision | str, **kw: Any
    ) -> EnsureResult:
        return EnsureResult(
            service=self.d.service.name,
            host=self.d.host.name,
            outcome=outcome,
            reason=reason,
            decision=str(decision),
            waited_s=self.elapsed(),
            notes=self.notes,
            **kw,
        )

    def tell(self, p: Progress) -> None:
        if self.d.progress is not None:
            self.d.progress(p)


def decide(
    deps: EnsureDeps, health: Health, own_holder: str | None = None
) -> tuple[Verdict, Snapshot | None, Record | None]:
    """Ask the agent and the store, and classify. Never raises for an unreachable agent."""
    svc = deps.service
    others = deps.config.services_on(svc.host)
    snapshot: Snapshot | None = None
    record: Record | None = None
    error = None
    leased: list[str] = []
    servers: dict[int, str] = {}
    try:
        # Records first: the servers they name are asked for by pid, whatever their
        # command line (a `vllm serve` under a service called "chat").
        records = {r.service: r for r in deps.store.records()}
        record = records.get(svc.name) or deps.store.get(svc.name)
        leased = starting_services(records.values(), exclude=svc.name)
        servers = recorded_servers(records.values())
        snapshot = deps.read_snapshot(_keywords(others or [svc]), sorted(servers))
    except GpuctlError as e:
        error = f"{e.message} (hint: {e.hint})" if e.hint else e.message
        snapshot = None
    alive = deps.handle_alive(record) if record is not None and record.handle else None
    verdict = classify(
        svc,
        health,
        snapshot,
        others=others,
        agent_error=error,
        total_override_mib=deps.host.gpu_memory_mib,
        record=record,
        handle_alive=alive,
        now=deps.clock(),
        own_holder=own_holder,
        leased=leased,
        servers=servers,
    )
    return verdict, snapshot, record


def _keywords(services: Sequence[ServiceConfig]) -> list[str]:
    out: dict[str, None] = {}
    for s in services:
        for k in s.keywords:
            out.setdefault(k, None)
    return list(out)


MAX_ROUNDS = 3


def ensure(deps: EnsureDeps, *, timeout_s: float | None = None, wait: bool = True) -> EnsureResult:
    """Make ``deps.service`` ready. Returns a result; raises only for misuse.

    Ctrl-C (KeyboardInterrupt) stops waiting and never kills the server: the lease is
    released, the record keeps the server's handle, and the next caller waits for it.
    """
    svc = deps.service
    ctx = _Ctx(deps, timeout_s if timeout_s is not None else svc.health_timeout_s)
    for _ in range(MAX_ROUNDS):
        result = _ensure_round(ctx, wait)
        if result is not None:
            return result
    return ctx.result(
        "failed",
        f"the starts under way ended {MAX_ROUNDS} times without a running server",
        Decision.LOADING,
    )


def _ensure_round(ctx: _Ctx, wait: bool) -> EnsureResult | None:
    """One look and what follows from it; None means "look again" (see ``_wait``)."""
    deps, svc = ctx.d, ctx.d.service
    health = deps.check_health()
    if health.ok:
        _touch(deps, ctx, ready=True)
        return ctx.result("ready", f"{svc.name} answers its health check", Decision.READY)

    verdict, _snapshot, record = decide(deps, health)
    first = verdict.decision
    if first is Decision.UNKNOWN:
        return ctx.result("unknown", verdict.reason, first)
    if first is Decision.BUSY:
        return ctx.result("busy", verdict.reason, first)
    if first is Decision.FAILED:
        f = record.failure if record else None
        return ctx.result("failed", verdict.reason, first, log_tail=f.log_tail if f else "")
    if first in (Decision.LOADING, Decision.SLEEPING, Decision.PREEMPTABLE):
        ctx.notes.append(f"found it {first.value}: {verdict.reason}")
        _touch(deps, ctx)
        if not wait:
            return ctx.result("loading", verdict.reason, first)
        return _wait(ctx, first, verdict.reason)
    # IDLE or FITS: take the lease; whoever holds it is the only one who launches.
    holder = Holder.here(deps.entry)
    ttl = svc.health_timeout_s + LEASE_MARGIN_S
    granted, _ = deps.store.acquire(svc.name, holder, ttl)
    if not granted:
        if not wait:
            return ctx.result("loading", "another caller is starting it", Decision.LOADING)
        return _wait(ctx, Decision.LOADING, "another caller holds the lease")
    return _launch_under_lease(ctx, holder, ttl, first, wait)


ADMISSION = "_admission"
ADMISSION_TTL_S = 60.0


@contextmanager
def _admission(ctx: _Ctx) -> Iterator[None]:
    """The host-wide admission lock: a lease on the pseudo-service ``_admission``, held
    only from the re-check to the recorded spawn (milliseconds to seconds). A holder that
    dies loses it at once on its own host, else at expiry."""
    deps = ctx.d
    holder = Holder.here("admission")
    deadline = deps.clock() + ADMISSION_TTL_S
    while True:
        granted, rec = deps.store.acquire(ADMISSION, holder, ADMISSION_TTL_S)
        if granted:
            break
        if deps.clock() >= deadline:
            who = f"{rec.lease.entry} pid {rec.lease.pid} on {rec.lease.host}" if rec.lease else "?"
            raise StoreError(
                f"another start on this host has held the admission lock too long ({who})",
                hint="see `gpuctl locks`; the lock expires by itself",
            )
        deps.sleep(0.05)
    try:
        yield
    finally:
        with contextlib.suppress(GpuctlError):
            deps.store.release(ADMISSION, holder.id)


def _launch_under_lease(
    ctx: _Ctx, holder: Holder, ttl: float, first: Decision, wait: bool
) -> EnsureResult | None:
    deps, svc = ctx.d, ctx.d.service
    released = False

    def release(update: dict[str, Any] | None = None) -> None:
        nonlocal released
        if released:
            return
        released = True  # once: a failed release is not retried (the lease expires by itself)
        try:
            deps.store.release(svc.name, holder.id, update)
        except GpuctlError as e:
            ctx.notes.append(f"could not release the lease: {e.message} (it expires by itself)")

    try:
        # Re-check, then spawn, one service at a time on the host (the admission lock):
        # otherwise two services could each re-check before the other spawned, and both
        # start into the same memory.
        with _admission(ctx):
            # Between our look and the lease, someone may have started it (their lease
            # released, the server loading), or another service may have taken the memory.
            health = deps.check_health()
            if health.ok:
                release({"touch": True, "phase": Phase.RUNNING.value})
                return ctx.result("ready", f"{svc.name} answers its health check", Decision.READY)
            verdict, snapshot, _ = decide(deps, health, own_holder=holder.id)
            if verdict.decision not in (Decision.IDLE, Decision.FITS):
                release()
                if verdict.decision is Decision.LOADING:
                    if not wait:
                        return ctx.result("loading", verdict.reason, verdict.decision)
                    waiting = verdict
                else:
                    outcome = {"BUSY": "busy", "UNKNOWN": "unknown"}.get(
                        verdict.decision.value, "failed"
                    )
                    return ctx.result(outcome, verdict.reason, verdict.decision)
            else:
                waiting = None
                launcher = deps.make_launcher(snapshot)
                started_at = deps.clock()
                # `starting` under the admission lock: from now on the others count this
                # service at its budget, even before its server exists.
                deps.store.update(
                    svc.name,
                    holder.id,
                    {"phase": Phase.STARTING.value, "handle": None, "touch": True},
                )
                try:
                    handle = launcher.start(svc)
                except (GpuctlError, OSError) as e:
                    msg = e.message if isinstance(e, GpuctlError) else str(e)
                    attempt = _attempt(started_at, deps.clock(), launcher.kind, "failed", msg)
                    release({"attempt": attempt, "failure": {"error": msg, "log_tail": ""}})
                    r = ctx.result(
                        "failed", f"start failed: {msg}", first, launched=False, attempt=attempt
                    )
                    if isinstance(e, GpuctlError) and e.hint:
                        r.notes.append(f"hint: {e.hint}")
                    return r
                deps.store.update(svc.name, holder.id, {"handle": handle.to_dict()})
        if waiting is not None:
            return _wait(ctx, waiting.decision, waiting.reason)
        if not wait:
            attempt = _attempt(started_at, deps.clock(), launcher.kind, "started")
            release({"attempt": attempt})
            return ctx.result(
                "started",
                f"launched with {launcher.kind}; not waiting",
                first,
                launched=True,
                attempt=attempt,
                handle=handle.to_dict(),
            )
        try:
            outcome, reason, tail = _wait_launched(ctx, launcher, handle, holder, ttl)
        except KeyboardInterrupt:
            attempt = _attempt(started_at, deps.clock(), launcher.kind, "interrupted")
            release({"attempt": attempt})
            raise
        attempt = _attempt(
            started_at, deps.clock(), launcher.kind, outcome, reason if outcome != "ready" else None
        )
        update: dict[str, Any] = {"attempt": attempt}
        if outcome == "ready":
            update.update({"phase": Phase.RUNNING.value, "failure": None, "touch": True})
        elif outcome == "failed":
            update["failure"] = {"error": reason, "log_tail": tail}
        release(update)
        return ctx.result(
            outcome,
            reason,
            first,
            launched=True,
            attempt=attempt,
            log_tail=tail,
            handle=handle.to_dict(),
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


def _touch(deps: EnsureDeps, ctx: _Ctx, ready: bool = False) -> None:
    try:
        deps.store.touch(deps.service.name, ready=ready)
    except GpuctlError as e:
        ctx.notes.append(f"could not mark it used: {e.message}")


def _own_memory(
    snapshot: Snapshot | None, svc: ServiceConfig, pid: int | None = None
) -> int | None:
    if snapshot is None:
        return None
    from gpuctl.core.decision import owns

    return sum(
        p.memory_mib or 0 for p in snapshot.processes if p.pid == pid or owns(svc, p.command)
    )


def _wait_launched(
    ctx: _Ctx, launcher: Launcher, handle: Handle, holder: Holder, ttl: float
) -> tuple[str, str, str]:
    """Wait as the launcher: poll health; stop early when our server dies."""
    deps, svc = ctx.d, ctx.d.service
    next_check = 0.0
    next_renew = deps.clock() + ttl / 3
    memory: int | None = None
    log_line = ""
    note = ""
    dead = 0
    while True:
        health = deps.check_health()
        if health.ok:
            return "ready", f"{svc.name} answers its health check after {ctx.elapsed():.1f}s", ""
        # vLLM answers 503 only once its engine is dead; a few in a row end the wait.
        dead = dead + 1 if health.status_code == 503 else 0
        if dead >= DEAD_503_IN_A_ROW:
            return (
                "failed",
                f"{svc.name}'s engine is dead ({health.detail})",
                launcher.log_tail(handle, 20),
            )
        now = deps.clock()
        if now >= ctx.deadline:
            return (
                "timeout",
                f"{svc.name} did not answer within {ctx.deadline - ctx.t0:.0f}s (it may still be loading)",
                launcher.log_tail(handle, 20),
            )
        if now >= next_check:
            next_check = now + LIVENESS_EVERY_S
            try:
                alive = launcher.alive(handle)
            except GpuctlError:
                alive = None
            if alive is False:
                tail = launcher.log_tail(handle, 20)
                return "failed", f"{svc.name}'s server exited while loading", tail
            try:
                snap = deps.read_snapshot(_keywords([svc]), [handle.pid] if handle.pid else [])
                memory = _own_memory(snap, svc, handle.pid)
                note = ""
            except GpuctlError as e:
                note = f"agent unavailable ({e.message}); still polling health"
                if not any(n.startswith("agent unavailable") for n in ctx.notes):
                    ctx.notes.append(note)
            try:
                last = launcher.log_tail(handle, 1)
                log_line = last.splitlines()[-1] if last else log_line
            except GpuctlError:
                pass
        if now >= next_renew:
            next_renew = now + ttl / 3
            try:
                deps.store.renew(svc.name, holder.id, ttl)
            except (StoreError, GpuctlError) as e:
                note = f"could not renew the lease: {e.message}"
        ctx.tell(Progress("loading (launched)", ctx.elapsed(), memory, log_line, note))
        deps.sleep(_poll_pause())


def _wait(ctx: _Ctx, decision: Decision, reason: str) -> EnsureResult | None:
    """Wait as a bystander: someone else's start is under way. Never launch.

    Returns None when that start ended with nothing running and the service may start
    now (IDLE or FITS): ``ensure`` then goes round again and may take the lease itself.
    """
    deps, svc = ctx.d, ctx.d.service
    next_check = 0.0
    memory: int | None = None
    note = ""
    gone = 0
    dead = 0
    while True:
        health = deps.check_health()
        dead = dead + 1 if health.status_code == 503 else 0
        if dead >= DEAD_503_IN_A_ROW:
            return ctx.result("failed", f"{svc.name}'s engine is dead ({health.detail})", decision)
        if health.ok:
            _touch(deps, ctx, ready=True)
            return ctx.result(
                "ready",
                f"{svc.name} answers its health check (waited {ctx.elapsed():.1f}s)",
                decision,
            )
        now = deps.clock()
        if now >= ctx.deadline:
            return ctx.result(
                "timeout",
                f"{svc.name} did not answer within {ctx.deadline - ctx.t0:.0f}s; it was {reason}",
                decision,
            )
        if now >= next_check:
            next_check = now + LIVENESS_EVERY_S
            verdict, snap, record = decide(deps, _NOT_READY)
            d = verdict.decision
            if d is Decision.UNKNOWN:
                note = f"agent unavailable; still polling health ({verdict.reason})"
                if not any(n.startswith("agent unavailable") for n in ctx.notes):
                    ctx.notes.append(note)
            else:
                note = ""
                memory = _own_memory(snap, svc)
            if d is Decision.FAILED:
                f = record.failure if record else None
                return ctx.result(
                    "failed", verdict.reason, decision, log_tail=f.log_tail if f else ""
                )
            if d in (Decision.IDLE, Decision.FITS, Decision.BUSY):
                # Nothing of it runs any more and nobody holds the lease. Twice in a row,
                # to ride out the moment between a holder's release and a record update.
                gone += 1
                if gone >= 2:
                    if d is Decision.BUSY:
                        # The holder backed off: another service took the memory.
                        return ctx.result("busy", verdict.reason, d)
                    return None  # it may start now: the caller goes round again

            else:
                gone = 0
        ctx.tell(Progress("loading (waiting)", ctx.elapsed(), memory, "", note))
        deps.sleep(_poll_pause())


_NOT_READY = Health("refused", "not ready")
