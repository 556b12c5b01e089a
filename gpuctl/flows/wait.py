"""The one wait loop: poll health until the service answers, dies, or time runs out.

Two kinds of caller wait, and they differ only in what they look at about once a
second (a ``Watch``):

- the launcher (``LauncherWatch``) knows its server's handle: it asks the launcher
  whether the server still runs, reads its log and renews its lease;
- a bystander (``BystanderWatch``) waits for someone else's start: it decides again
  from the records and the snapshot, and notices when that start ended with nothing
  running (then ``ensure`` goes round again and may start it itself).
"""

from __future__ import annotations

import random
from typing import Protocol

import msgspec

from gpuctl.adapters.launchers.base import Handle, Launcher, QueueReporter
from gpuctl.config import ServiceConfig
from gpuctl.core.decision import Decision, Health, Verdict, owns
from gpuctl.core.record import Holder, Record
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import GpuctlError
from gpuctl.flows.deps import EnsureDeps
from gpuctl.flows.look import keywords, look
from gpuctl.flows.op_results import Outcome
from gpuctl.flows.results import Progress

POLL_S = 0.2
LIVENESS_EVERY_S = 1.0
DEAD_503_IN_A_ROW = 4
NOT_READY = Health("refused", "not ready")


def poll_pause() -> float:
    """About POLL_S, spread a little: callers that started together would otherwise poll
    in lockstep, and all notice a ready server at the same late moment."""
    return POLL_S * random.uniform(0.75, 1.25)


class Waited(msgspec.Struct, frozen=True):
    """How a wait ended. ``AGAIN`` (outcome None) means: look again, it may start now."""

    outcome: Outcome | None
    reason: str = ""
    log_tail: str = ""
    decision: Decision | None = None  # a new decision the wait found (BUSY), if any
    verdict: Verdict | None = None  # and the verdict behind it (who holds the GPU)
    url: str | None = None  # READY: the health URL that answered, where not as written


AGAIN = Waited(None)


class Watch(Protocol):
    """What a waiter looks at besides health, and how it words the ends."""

    phase: str
    memory_mib: int | None
    log_line: str
    note: str
    # Whether a server gpuctl started is what loads (a record names it); False for a
    # process tied to the service only by a keyword.
    ours: bool

    def look(self, now: float) -> Waited | None:
        """About once a second: None to go on waiting, or how the wait ends."""
        ...

    def tail(self) -> str:
        """The server's last log lines, for a failure or a timeout."""
        ...

    def ready_reason(self, elapsed_s: float) -> str: ...

    def timeout_reason(self, limit_s: float) -> str: ...


class Clock(Protocol):
    """What the loop needs of the ``ensure`` context."""

    deps: EnsureDeps
    t0: float
    deadline: float

    def elapsed(self) -> float: ...

    def note_once(self, note: str) -> None: ...


def wait_ready(ctx: Clock, watch: Watch) -> Waited:
    """Poll health until ready, dead (503 a few times in a row), ended by the watch, or
    past the deadline. Never launches anything."""
    deps, svc = ctx.deps, ctx.deps.service
    next_look = 0.0
    dead = 0
    while True:
        health = deps.servers.health()
        if health.ok:
            return Waited(Outcome.READY, watch.ready_reason(ctx.elapsed()), url=health.url)
        # vLLM answers 503 only once its engine is dead; a few in a row end the wait.
        dead = dead + 1 if health.status_code == 503 else 0
        if dead >= DEAD_503_IN_A_ROW:
            return Waited(
                Outcome.FAILED, f"{svc.name}'s engine is dead ({health.detail})", watch.tail()
            )
        now = deps.clock()
        if now >= ctx.deadline:
            return Waited(
                Outcome.TIMEOUT, watch.timeout_reason(ctx.deadline - ctx.t0), watch.tail()
            )
        if now >= next_look:
            next_look = now + LIVENESS_EVERY_S
            end = watch.look(now)
            if end is not None:
                return end
        if deps.tell.progress is not None:
            deps.tell.progress(
                Progress(
                    watch.phase,
                    ctx.elapsed(),
                    watch.memory_mib,
                    watch.log_line,
                    watch.note,
                    getattr(ctx, "expected_s", None) if watch.ours else None,
                    ours=watch.ours,
                )
            )
        deps.sleep(poll_pause())


def own_memory(snapshot: Snapshot | None, svc: ServiceConfig, pid: int | None = None) -> int | None:
    """What the service's processes hold on the GPU (None: no snapshot): its server's
    ``pid``, the processes the agent names as the service's (its server's children, a
    vLLM's engine core holding the weights), and its keywords'."""
    if snapshot is None:
        return None
    named = {p for p, s in snapshot.servers if s == svc.name}
    return sum(
        p.memory_mib or 0
        for p in snapshot.processes
        if p.pid == pid or p.pid in named or owns(svc, p.command)
    )


class LauncherWatch:
    """The launcher's view: its own server, by handle; renews its lease as it goes."""

    phase = "loading (launched)"
    ours = True

    def __init__(
        self, ctx: Clock, launcher: Launcher, handle: Handle, holder: Holder, ttl_s: float
    ) -> None:
        self.ctx, self.launcher, self.handle = ctx, launcher, handle
        self.holder, self.ttl_s = holder, ttl_s
        self.next_renew = ctx.deps.clock() + ttl_s / 3
        self.memory_mib: int | None = None
        self.log_line = ""
        self.note = ""

    def look(self, now: float) -> Waited | None:
        deps, svc = self.ctx.deps, self.ctx.deps.service
        try:
            alive = self.launcher.alive(self.handle)
        except GpuctlError:
            alive = None
        if alive is False:
            # It may have come up between the loop's health check and this look (Ollama's
            # loader exits as soon as its model is in): only a last refusal is a failure.
            if deps.servers.health().ok:
                return Waited(Outcome.READY, self.ready_reason(self.ctx.elapsed()))
            return Waited(Outcome.FAILED, f"{svc.name}'s server exited while loading", self.tail())
        queued = self.queued()
        if queued is not None:
            # Queued by a scheduler: nothing of it runs yet, no GPU memory to measure.
            self.phase, self.note = "queued", queued
            self.renew(now)
            return None
        self.phase = LauncherWatch.phase
        pid = self.handle.pid
        try:
            snap = deps.probe.read(keywords([svc]), [pid] if pid else [])
            self.memory_mib = own_memory(snap, svc, pid)
            self.note = ""
        except GpuctlError as e:
            self.note = f"agent unavailable ({e.message}); still polling health"
            self.ctx.note_once(self.note)
        try:
            last = self.launcher.log_tail(self.handle, 1)
            self.log_line = last.splitlines()[-1] if last else self.log_line
        except GpuctlError:
            pass
        self.renew(now)
        return None

    def renew(self, now: float) -> None:
        if now >= self.next_renew:
            self.next_renew = now + self.ttl_s / 3
            try:
                self.ctx.deps.store.renew(self.ctx.deps.service.name, self.holder.id, self.ttl_s)
            except GpuctlError as e:
                self.note = f"could not renew the lease: {e.message}"

    def queued(self) -> str | None:
        """Why a scheduler (Slurm) still queues the server; None when it runs or none tells."""
        if not isinstance(self.launcher, QueueReporter):
            return None
        try:
            return self.launcher.queue_state(self.handle)
        except GpuctlError:
            return None

    def tail(self) -> str:
        return self.launcher.log_tail(self.handle, 20)

    def ready_reason(self, elapsed_s: float) -> str:
        return f"{self.ctx.deps.service.name} answers its health check after {elapsed_s:.1f}s"

    def timeout_reason(self, limit_s: float) -> str:
        name = self.ctx.deps.service.name
        queued = self.queued()
        if queued is not None:
            return f"{name} did not answer within {limit_s:.0f}s: still {queued}"
        return f"{name} did not answer within {limit_s:.0f}s (it may still be loading)"


class BystanderWatch:
    """A bystander's view: decide again each look; never launch."""

    phase = "loading (waiting)"

    def __init__(self, ctx: Clock, reason: str, *, ours: bool = True) -> None:
        self.ctx, self.reason, self.ours = ctx, reason, ours
        self.memory_mib: int | None = None
        self.log_line = ""
        self.note = ""
        self.gone = 0
        self.record: Record | None = None

    def look(self, now: float) -> Waited | None:
        deps, svc = self.ctx.deps, self.ctx.deps.service
        verdict, seen = look(deps, NOT_READY)
        self.record = seen.records.get(svc.name)
        d = verdict.decision
        if d is Decision.UNKNOWN:
            self.note = f"agent unavailable; still polling health ({verdict.reason})"
            self.ctx.note_once(self.note)
        else:
            self.note = ""
            self.memory_mib = own_memory(seen.snapshot, svc)
        if d is Decision.FAILED:
            f = self.record.failure if self.record else None
            return Waited(Outcome.FAILED, verdict.reason, f.log_tail if f else "")
        if d in (Decision.IDLE, Decision.FITS, Decision.BUSY):
            # Nothing of it runs any more and nobody holds the lease. Twice in a row,
            # to ride out the moment between a holder's release and a record update.
            self.gone += 1
            if self.gone >= 2:
                if d is Decision.BUSY:
                    # The holder backed off: another service took the memory.
                    return Waited(Outcome.BUSY, verdict.reason, decision=d, verdict=verdict)
                return AGAIN
        else:
            self.gone = 0
        return None

    def tail(self) -> str:
        return ""

    def ready_reason(self, elapsed_s: float) -> str:
        name = self.ctx.deps.service.name
        return f"{name} answers its health check (waited {elapsed_s:.1f}s)"

    def timeout_reason(self, limit_s: float) -> str:
        name = self.ctx.deps.service.name
        return f"{name} did not answer within {limit_s:.0f}s; it was {self.reason}"
