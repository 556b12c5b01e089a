"""``gpuctl run``: an ad-hoc GPU job under the same budget as the services.

1. Admission, under the host-wide admission lock ``ensure`` uses: a fresh look at the
   host, and the job decided like a service of its budget and priority (IDLE, FITS:
   start; BUSY: exit 3 naming the holders, before CMD starts; UNKNOWN: exit 4).
   ``--wait`` joins the host's wait queue in the store and looks again until it is the
   head of the queue and fits (or the timeout): the queue is served by priority, then
   arrival, strictly from its head (``gpuctl.core.queue`` says why). A job that does not
   queue is admitted only when no waiter of its priority or higher is queued. A job
   larger than the GPU never queues (exit 3 at once). The entry is renewed on every look
   and removed once admitted, and on a timeout, Ctrl-C, SIGTERM or an error.
   PREEMPTABLE (it fits once lower-priority victims stop): with ``--preempt`` they are
   stopped as ``ensure --preempt`` stops them (``gpuctl.flows.ensure.preempt.make_room``) and
   it looks again; without, exit 3 naming them and how to ask.
2. CMD is started directly (never through a shell) in its own session, and recorded as
   ``run.<name>`` before the lock is released: its pid, start time, budget, priority and
   whether it may be preempted. From then on every decision counts it; once CMD dies its
   pid is no longer reported and it counts for nothing, even if ``gpuctl run`` was
   killed and never wrote that it ended.
3. Signals ``gpuctl run`` receives are passed to CMD; its exit code is returned (128+N
   for a signal N). CMD that cannot be started: 127 (not found) or 126 (not executable),
   as ``env`` does.
4. When CMD has ended: the record says so (``stopped``, or ``preempted`` when a
   higher-priority ensure stopped it), and preempted ``resume = true`` services that fit
   now are brought back.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec

from gpuctl import failpoints
from gpuctl.adapters.store.base import Store
from gpuctl.config import Config, HostConfig
from gpuctl.core.decision import NO_HEALTH, Decision, Verdict
from gpuctl.core.jobs import PREFIX, JobSpec, job_spec
from gpuctl.core.queue import Waiter, queued_reason
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.core.snapshot import Snapshot
from gpuctl.core.units import format_mib
from gpuctl.errors import GpuctlError
from gpuctl.flows import story
from gpuctl.flows.admission import AdmissionTimeout, admission
from gpuctl.flows.deps import Closers
from gpuctl.flows.look import decide, observe
from gpuctl.flows.ports import (
    InFlightReader,
    JobChild,
    JobSpawner,
    JobStopper,
    Machine,
    SnapshotReader,
    VictimLauncher,
)
from gpuctl.flows.run import room as rp
from gpuctl.flows.run.place import Place, QueuedAdmission, ahead_now

# Signals passed on to CMD (SIGKILL and SIGSTOP cannot be caught).
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
RECORD_TTL_S = 60.0
WAIT_POLL_S = 0.5
EXIT_BUSY, EXIT_UNKNOWN, EXIT_TIMEOUT = 3, 4, 5
EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 126, 127


class RunRequest(msgspec.Struct, frozen=True):
    argv: Sequence[str]
    memory_mib: int
    priority: int = 50
    name: str | None = None
    wait: bool = False
    preemptible: bool = False
    timeout_s: float | None = None
    preempt: bool = False


class RunDeps(Closers, kw_only=True):
    config: Config
    host: HostConfig
    store: Store
    read_snapshot: SnapshotReader  # fresh, never a cached reading
    machine: Machine
    # Forks CMD held before it runs, with the job's marks in its environment.
    spawn: JobSpawner
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # Brings back preempted `resume = true` services that fit (after CMD ends).
    resume: Callable[[], list[str]] | None = None
    # Told before CMD starts: what was decided (for a line on stderr).
    tell: Callable[[str], None] = lambda _line: None
    # Preemption (``--preempt``): how victims are stopped and their requests read.
    launcher_for: VictimLauncher | None = None
    server_in_flight: InFlightReader | None = None
    stop_job: JobStopper | None = None


class RunResult(msgspec.Struct):
    """How ``gpuctl run`` ended. ``started``: CMD ran (its exit code is ``exit_code``)."""

    name: str
    exit_code: int
    reason: str
    started: bool = False
    preempted: bool = False
    decision: str = ""
    hint: str = ""
    pid: int | None = None
    resumed: list[str] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)


class _Ctx:
    """What the admission lock needs: the deps (store, clock, sleep) and a deadline; a
    queued caller's naps there renew its entry."""

    def __init__(self, deps: RunDeps, deadline: float, place: Place | None = None) -> None:
        self.deps: RunDeps | QueuedAdmission = (
            deps
            if place is None
            else place.admission_deps(deps.store, deps.clock, deps.sleep, deps.machine)
        )
        self.deadline = deadline


def job_name(
    argv: Sequence[str],
    wanted: str | None,
    records: Sequence[Record],
    alive: Callable[[int, float | None], bool],
) -> str:
    """The job's name: ``--name``, else CMD's program name, made a valid name, with a
    suffix (``-2``, ``-3``…) when another live job already has it (``alive``: whether a
    pid still runs the process that started then, ``Machine.is_same_process``)."""
    base = wanted or os.path.basename(argv[0]) or "job"
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", base).lstrip(".-")[:80] or "job"
    live = set()
    for r in records:
        j = job_spec(r)
        if j is not None and j.pid is not None and alive(j.pid, j.pid_start):
            live.add(j.job)
    name, n = base, 1
    while name in live:
        n += 1
        name = f"{base}-{n}"
    return name


def run(deps: RunDeps, req: RunRequest) -> RunResult:
    """Admit the job, run CMD, and return how it ended (never raises for a refusal)."""
    deadline = deps.clock() + (req.timeout_s if req.timeout_s is not None else float("inf"))
    try:
        records = deps.store.records()
    except GpuctlError as e:
        # The records cannot be read, so no suffix is known: CMD's program name stands.
        name = job_name(req.argv, req.name, (), deps.machine.is_same_process)
        return RunResult(name, EXIT_UNKNOWN, e.message, hint=e.hint)
    name = job_name(req.argv, req.name, records, deps.machine.is_same_process)
    notes: list[str] = []
    spec = JobSpec(PREFIX + name, req.memory_mib, req.priority, preemptible=req.preemptible)
    told = False
    command = os.path.basename(req.argv[0])[:200]
    pre = rp.Preemption(deps, spec, notes, command) if req.preempt else None
    place = Place(deps.store, spec, deps.machine.holder("run")) if req.wait else None
    largest: int | None = None  # the GPU's largest device, once looked at (None: unknown)
    try:
        while True:
            before = place.refresh(largest) if place is not None and place.joined else []
            if not before:
                try:
                    with admission(_Ctx(deps, deadline, place)):
                        verdict, largest, snapshot = _look(deps, spec, victims=True, pre=pre)
                        before = ahead_now(deps.store, spec, place, largest)  # only the head goes
                        if not before and verdict.decision in (Decision.IDLE, Decision.FITS):
                            started = _start(deps, spec, req, verdict, name, pre=pre)
                            if place is not None:
                                place.leave()  # admitted: recorded, out of the queue
                            if isinstance(started, RunResult):
                                return started
                            proc = started
                            break
                except AdmissionTimeout as e:
                    return RunResult(
                        name, EXIT_TIMEOUT, f"the timeout ran out in the admission ({e.who})"
                    )
                except GpuctlError as e:
                    return RunResult(name, EXIT_UNKNOWN, e.message, hint=e.hint)
                if pre is not None and not before:  # never for waiters ahead of it
                    again = lambda: _look(deps, spec, pre=pre)[0]  # noqa: E731
                    made = pre.make_room(verdict, snapshot, deadline, again)
                    if made is None:
                        continue  # look again under the admission lock: start once it fits
                    if made is not False:  # a stop failed, no memory in time, host unread
                        return RunResult(
                            name, made[0], made[1], decision="PREEMPTABLE", hint=made[2]
                        )
                refusal = _refusal(name, verdict, largest)
                if refusal.exit_code == EXIT_UNKNOWN or _never_fits(verdict, largest):
                    return refusal  # waiting would not help (and would hold up the queue)
            if before:
                refusal = _queued(name, before)
            if place is None:
                return refusal
            if deps.clock() + WAIT_POLL_S > deadline:
                refusal.exit_code = EXIT_TIMEOUT
                refusal.reason = f"still waiting at the timeout: {refusal.reason}"
                refusal.hint = "a longer --timeout waits longer; `gpuctl locks` shows the queue"
                return refusal
            if not place.joined:
                place.refresh(largest)  # it does not fit, or others are ahead: it joins the queue
            if not told:
                deps.tell(f"waiting for room: {refusal.reason} (queued: `gpuctl locks`)")
                told = True
            signum = place.nap(deps.sleep, WAIT_POLL_S)
            if signum:
                return RunResult(name, 128 + signum, "interrupted while waiting in the queue")
    except GpuctlError as e:
        return RunResult(name, EXIT_UNKNOWN, e.message, hint=e.hint)
    finally:
        if place is not None:
            place.leave()  # timeout, Ctrl-C, an error: out of the queue in every case
        if pre is not None:
            pre.give_back()  # the room it kept, if CMD never started
    if place is not None and place.signum:  # it came during the start: CMD gets it
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, place.signum)
    code = _wait(proc)
    result = RunResult(
        spec.job, code, f"{name} exited with {code}", started=True, pid=proc.pid, notes=notes
    )
    result.preempted = _ended(deps, spec.name)
    if result.preempted:
        result.reason = f"{name} was preempted for higher-priority work (exit {code})"
    if deps.resume is not None:
        with contextlib.suppress(GpuctlError):
            result.resumed = deps.resume()
    return result


def _queued(name: str, before: list[Waiter]) -> RunResult:
    return RunResult(
        name,
        EXIT_BUSY,
        queued_reason(before),
        decision=Decision.BUSY.value,
        hint="wait your turn with --wait; `gpuctl locks` shows the queue",
    )


def _look(
    deps: RunDeps, spec: JobSpec, victims: bool = False, pre: rp.Preemption | None = None
) -> tuple[Verdict, int | None, Snapshot | None]:
    """The job's verdict, the largest GPU's total (None: unknown), and the snapshot.
    ``victims``: when it does not fit, ask whether stopping lower-priority work would
    make room (PREEMPTABLE, with the plan), as ``ensure`` asks."""
    services = deps.config.services_on(deps.host.name)
    seen = observe(deps.store.listing, deps.read_snapshot, services)
    totals = [
        d.memory_total_mib if d.memory_total_mib is not None else deps.host.gpu_memory_mib
        for d in (seen.snapshot.device_list() if seen.snapshot else ())
    ]
    known = [t for t in totals if t is not None]
    judge = partial(
        decide,
        spec,
        NO_HEALTH,
        seen,
        others=services,
        now=deps.clock(),
        total_override_mib=deps.host.gpu_memory_mib,
        orphan_is_loading=False,
        own_holder=pre.holder_id if pre is not None else None,  # its own promise
    )
    verdict = judge()
    if victims:
        verdict = rp.with_job_victims(deps, seen, services, spec, verdict, judge=judge)
    return verdict, (max(known) if known else None), seen.snapshot


def _never_fits(verdict: Verdict, largest: int | None) -> bool:
    """Larger than the largest GPU: no wait can help."""
    return largest is not None and verdict.need_mib is not None and verdict.need_mib > largest


def _refusal(name: str, verdict: Verdict, largest: int | None) -> RunResult:
    if verdict.decision is Decision.UNKNOWN:
        return RunResult(
            name,
            EXIT_UNKNOWN,
            verdict.reason,
            decision=verdict.decision.value,
            hint="check the host's agent (`gpuctl status`); nothing was started",
        )
    reason = verdict.reason
    hint = rp.preempt_hint(verdict) or (
        "wait for room with --wait; `gpuctl status` shows who holds the GPU"
    )
    if _never_fits(verdict, largest):
        assert verdict.need_mib is not None and largest is not None
        reason = (
            f"needs {format_mib(verdict.need_mib)}, more than the GPU has "
            f"({format_mib(largest)}): it can never fit"
        )
        # No wait (given or not) can help: only a smaller --memory can.
        hint = f"ask for at most {format_mib(largest)} with --memory; waiting cannot help"
    return RunResult(name, EXIT_BUSY, reason, decision=verdict.decision.value, hint=hint)


def _start(
    deps: RunDeps,
    spec: JobSpec,
    req: RunRequest,
    verdict: Verdict,
    name: str,
    *,
    pre: rp.Preemption | None = None,
) -> JobChild | RunResult:
    """Spawn CMD and record it (under the admission lock, by the caller)."""
    env = dict(os.environ)
    if verdict.gpu is not None and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = str(verdict.gpu)
    if os.sep not in req.argv[0] and shutil.which(req.argv[0], path=env.get("PATH")) is None:
        return RunResult(name, EXIT_NOT_FOUND, f"{req.argv[0]}: command not found")
    # Its own session: a kill -9 of gpuctl run leaves CMD running (and recorded), and a
    # preemption signals its whole process group. It execs only once recorded.
    proc = deps.spawn(list(req.argv), env, name, spec.preemptible)
    handle: dict[str, Any] = {
        "kind": "run",
        "pid": proc.pid,
        "pid_start": deps.machine.start_time(proc.pid),
        "memory_mib": spec.memory_mib,
        "priority": spec.priority,
        "preemptible": spec.preemptible,
        "run_nonce": proc.nonce,
        "host": deps.machine.here.hostname,
        "boot_id": deps.machine.here.boot_id,
        "command": os.path.basename(req.argv[0])[:200],
    }
    # A --preempt job takes the lease of its promise again (a holder may).
    holder = pre.holder if pre is not None and pre.holder else deps.machine.holder("run")
    try:
        granted, _ = deps.store.acquire(spec.name, holder, RECORD_TTL_S)
        if not granted:
            raise GpuctlError(f"the record {spec.name} is held by another caller")
        deps.store.release(
            spec.name,
            holder.id,
            RecordUpdate(phase=Phase.RUNNING, handle=handle, touch=True, failure=None),
            event=story.ev(
                "launch",
                spec.name,
                "run",
                job=True,
                after=Phase.RUNNING,
                budget_mib=story.mib(spec.memory_mib),
                priority=spec.priority,
                command=" ".join(req.argv)[:500],
            ),
        )
    except GpuctlError:
        # Unrecorded, it would hold memory nobody counts: it does not run.
        proc.abandon()
        raise
    # From the moment CMD may run until ``_wait`` passes them on, the signals it should
    # get are held (blocked, left pending), not left to their defaults: a SIGTERM in
    # between would otherwise end gpuctl run and leave CMD running unwatched.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        proc.go()
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        _ended(deps, spec.name)
        code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_CANNOT_EXECUTE
        return RunResult(name, code, f"{req.argv[0]}: {e.strerror or e}")
    failpoints.hit("run.after_go")
    return proc


def _wait(proc: JobChild) -> int:
    """Wait for CMD, passing on the signals we get; its exit code (128+N for signal N)."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        # What came since CMD was let run (``_start`` held it) is passed on now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code


def _ended(deps: RunDeps, name: str) -> bool:
    """Write that CMD ended; True when it had been preempted (the record says so)."""
    holder = deps.machine.holder("run")
    give_up = deps.clock() + 30.0
    while True:
        # A preemption holds the job's lease while it stops CMD: wait for it to write
        # ``preempted`` (its stop takes the grace period at most).
        try:
            granted, rec = deps.store.acquire(name, holder, RECORD_TTL_S)
        except GpuctlError:
            return False
        if granted or deps.clock() > give_up:
            break
        deps.sleep(0.1)
    preempted = rec.phase is Phase.PREEMPTED
    if granted:
        update = RecordUpdate(handle=None)
        if not preempted:
            update = RecordUpdate(handle=None, phase=Phase.STOPPED)
        end = (
            None
            if preempted
            else story.ev(
                "stop",
                name,
                "run",
                job=True,
                before=rec.phase,
                after=Phase.STOPPED,
                reason="the job ended",
            )
        )
        with contextlib.suppress(GpuctlError):
            deps.store.release(name, holder.id, update, event=end)
    return preempted
