"""The trial runner's invariants as pure checks over what a trial saw (tests/trials.py).

A trial's sampler records an ``Observation`` about every 50 ms (the live servers and
``gpuctl run`` CMDs, the records, the simulated GPU's claims); each caller is kept with
its spawn time, when it was seen gone, what it may preempt for and what it printed. Once
the callers are done, ``check_outcome`` judges the whole ``Outcome``:

- **one server per service**, in every sample;
- **no admitted memory over the total**, in every consistent sample: the budgets of what
  gpuctl admitted (a service whose record is starting/running/stopping while a server
  of it lives, a job whose record runs while its CMD lives) sum to at most the GPU; and
  the simulated GPU's claims never pass its total;
- **no out-of-memory line** in any log (the servers' logs, every caller's output, which
  a job's CMD shares);
- **nothing stopped that was not a permitted victim**: each record that turns
  ``preempted`` had a preemptor under way of strictly higher priority (and a job was
  ``--preemptible``), or of any priority where the victim had *yielded*: a server (not
  a batch, not a job) whose record, just before, said it had gone unused for its
  ``yield_after`` by the time it turned (docs/explanation/priorities.md, "An idle server
  yields"); each victim an
  ``ensure`` names in its own output ("preempted X to make room") is below that
  ensure's priority or yielded while it was under way, and preemptible if a job;
- **phases heal**: no live server under a record that says it is not running
  (``stopped``, ``preempted``, ``failed``, with no lease of a live holder on it: that
  holder is mid-way) for longer than ``HEAL_S`` after anyone looked: a gpuctl command that
  heals (``HEALERS``) spawned since the lie began, or at once where an agent runs
  (``Outcome.agent``: its loop looks every few seconds);
- **every stop explained**: a server that dies had a ``stop`` of it, a ``reclaim``, a
  start of it (a failed start ends its server) or a preemptor above it (or, where it
  had yielded, any preemptor) under way; a job's CMD that ends before its own duration
  was preempted.

It also counts what happened: preemptions (records turned ``preempted``), the victims
preemptors named, and resumes (a preempted service starting again). Pure: the unit test
(tests/test_trials_invariants.py) feeds it broken outcomes and sees each one caught.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JOB_PREFIX = "run."
# A stop's caller may return a moment before its victim's process is gone (a SIGKILL
# still being delivered), and the sampler sees a caller gone only at its next sample.
STOP_SLACK_S = 3.0
LIVE_PHASES = ("starting", "running", "stopping")
# The phases that say no server runs, and who heals a record that says one with a
# server alive (docs/explanation/starting-servers.md, "Phases heal"): within HEAL_S of
# looking, its command has read
# the records, judged and written (a health request of 1 s at most among them).
NOT_RUNNING = ("stopped", "preempted", "failed")
HEALERS = ("ensure", "reclaim", "status", "locks", "resume")
HEAL_S = 5.0
OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
PREEMPTED_NOTE = re.compile(r"^preempted (.+) to make room")
# ``gpuctl run --preempt`` says the same on its stderr (no JSON), one line per round.
RUN_PREEMPTED_LINE = re.compile(r"^gpuctl run: (preempted .+ to make room.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Service:
    """``yield_after_s``: None for "never"; a ``kind = "batch"`` service never yields."""

    name: str
    memory_mib: int
    priority: int
    yield_after_s: float | None = None
    kind: str = "server"


@dataclass(frozen=True)
class Job:
    """A ``gpuctl run`` job the trial started: CMD holds its memory for ``duration_s``."""

    name: str
    priority: int
    preemptible: bool
    memory_mib: int
    duration_s: float
    spawned: float


@dataclass(frozen=True)
class Observation:
    """One sample. ``records`` were read after the processes; ``consistent``: they had
    not changed while the processes were read (the admitted-memory check needs that;
    each record file on its own is always whole)."""

    at: float
    servers: Mapping[str, tuple[int, ...]]
    jobs: Mapping[str, tuple[int, ...]]
    records: Mapping[str, Mapping[str, Any]]
    consistent: bool = True
    claimed_mib: int | None = None


@dataclass(frozen=True)
class CallerFacts:
    """A caller: ``ended`` is when the sampler first saw it gone (None: never);
    ``preempts`` is the priority it may preempt for (None: it never preempts)."""

    action: str
    service: str
    spawned: float
    ended: float | None = None
    preempts: int | None = None
    output: str = ""
    pid: int | None = None  # the gpuctl process (a lease it takes names this pid)


@dataclass
class Outcome:
    services: Sequence[Service]
    total_mib: int
    observations: Sequence[Observation]
    callers: Sequence[CallerFacts]
    jobs: Mapping[str, Job] = field(default_factory=dict)
    logs: Mapping[str, str] = field(default_factory=dict)  # where -> text
    agent: bool = False  # the host had an agent (its loop heals without a caller)


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)  # invariant -> times judged
    counts: Counter[str] = field(default_factory=Counter)  # preemptions, resumes, ...


def check_outcome(o: Outcome) -> Verdict:
    v = Verdict()
    _one_server(o, v)
    _memory(o, v)
    _no_oom(o, v)
    _victims(o, v)
    _named_victims(o, v)
    _stops_explained(o, v)
    _phases_heal(o, v)
    return v


def _one_server(o: Outcome, v: Verdict) -> None:
    for obs in o.observations:
        v.checked["one server per service"] += 1
        for name, pids in obs.servers.items():
            if len(pids) > 1:
                v.violations.append(f"{len(pids)} servers of {name}: {sorted(pids)}")


def admitted_mib(o: Outcome, obs: Observation) -> dict[str, int]:
    """What gpuctl admitted at ``obs``: name -> budget (empty without a consistent view)."""
    out: dict[str, int] = {}
    if not obs.consistent:
        return out
    budgets = {s.name: s.memory_mib for s in o.services}
    for name, rec in obs.records.items():
        if rec.get("phase") not in LIVE_PHASES:
            continue
        handle = rec.get("handle") or {}
        if name.startswith(JOB_PREFIX):
            job = name[len(JOB_PREFIX) :]
            if rec.get("phase") == "running" and handle.get("pid") in obs.jobs.get(job, ()):
                out[name] = int(handle.get("memory_mib") or 0)
        elif name in budgets and obs.servers.get(name):
            pid = handle.get("pid")
            if pid is None or pid in obs.servers[name]:
                out[name] = budgets[name]
    return out


def _memory(o: Outcome, v: Verdict) -> None:
    for obs in o.observations:
        if obs.consistent:
            v.checked["admitted memory within the total"] += 1
            admitted = admitted_mib(o, obs)
            if sum(admitted.values()) > o.total_mib:
                v.violations.append(
                    f"admitted {sum(admitted.values())} MiB of {o.total_mib}: "
                    + ", ".join(f"{n} {m}" for n, m in sorted(admitted.items()))
                )
        if obs.claimed_mib is not None:
            v.checked["claimed memory within the total"] += 1
            if obs.claimed_mib > o.total_mib:
                v.violations.append(f"overcommit: {obs.claimed_mib} MiB claimed of {o.total_mib}")


def _no_oom(o: Outcome, v: Verdict) -> None:
    logs = dict(o.logs)
    for i, c in enumerate(o.callers):
        logs[f"output of {c.action} {c.service} (caller {i})"] = c.output
    for where, text in logs.items():
        v.checked["no out-of-memory line"] += 1
        m = OOM.search(text)
        if m:
            line = text[text.rfind("\n", 0, m.start()) + 1 :].split("\n", 1)[0]
            v.violations.append(f"out of memory in {where}: {line.strip()[:200]}")


def _priority(o: Outcome, name: str) -> tuple[int | None, Job | None]:
    if name.startswith(JOB_PREFIX):
        job = o.jobs.get(name[len(JOB_PREFIX) :])
        return (job.priority if job else None), job
    for s in o.services:
        if s.name == name:
            return s.priority, None
    return None, None


def _live_between(c: CallerFacts, start: float, end: float, slack: float = 0.0) -> bool:
    """Was ``c`` under way at some moment of [start, end] (its end noticed late by up
    to ``slack``)?"""
    return c.spawned <= end and (c.ended is None or c.ended + slack >= start)


def transitions(o: Outcome) -> list[tuple[str, str, str, float, float]]:
    """Each record's phase changes between samples: (name, from, to, after, by) -- the
    change happened in (after, by]."""
    out = []
    last: dict[str, tuple[str, float]] = {}
    for obs in o.observations:
        for name, rec in obs.records.items():
            phase = str(rec.get("phase", "stopped"))
            before = last.get(name)
            if before is not None and before[0] != phase:
                out.append((name, before[0], phase, before[1], obs.at))
            last[name] = (phase, obs.at)
    return out


# The store's times and the sampler's are the same machine's clock; this absorbs only
# the rounding of the record's JSON.
YIELD_SLACK_S = 0.05
# How long after its record turns ``preempted`` a yielded server's death is its stop's
# (the trials' stop_timeout is 3 s, then SIGKILL).
YIELD_STOP_WINDOW_S = 10.0


def _yielded(o: Outcome, name: str, after: float, by: float) -> bool:
    """Whether ``name`` had yielded when its record turned ``preempted`` in (after, by]:
    a server with a ``yield_after`` whose record at ``after`` (its last use, or when its
    phase began) says it was unused that long by ``by``. A use since only makes it
    later, so this is what any preemptor that stopped it must have seen at least."""
    svc = next((s for s in o.services if s.name == name), None)
    if svc is None or svc.kind == "batch" or svc.yield_after_s is None:
        return False
    rec = None
    for obs in o.observations:
        if obs.at > after:
            break
        rec = obs.records.get(name, rec)
    if rec is None or rec.get("phase") != "running":
        return False
    # Idle since the last use or since it began running, whichever is later
    # (docs/explanation/priorities.md).
    refs = [t for t in (rec.get("last_used"), rec.get("since")) if isinstance(t, int | float)]
    return bool(refs) and max(refs) + svc.yield_after_s <= by + YIELD_SLACK_S


def _yields(o: Outcome) -> list[tuple[str, float, float]]:
    """Each turn to ``preempted`` of a server that had yielded: (name, after, by)."""
    return [
        (name, after, by)
        for name, _old, new, after, by in transitions(o)
        if new == "preempted" and _yielded(o, name, after, by)
    ]


def _victims(o: Outcome, v: Verdict) -> None:
    for name, old, new, after, by in transitions(o):
        if new == "preempted":
            v.counts["preemptions"] += 1
            v.checked["only permitted victims preempted"] += 1
            prio, job = _priority(o, name)
            if job is not None and not job.preemptible:
                v.violations.append(f"job {job.name} was preempted, but it is not --preemptible")
            yielded = job is None and _yielded(o, name, after, by)
            if yielded:
                v.counts["idle servers yielded"] += 1
            by_whom = [
                c
                for c in o.callers
                if c.preempts is not None
                and prio is not None
                and (c.preempts > prio or yielded)
                and _live_between(c, after, by)
            ]
            if not by_whom:
                under_way = [
                    f"{c.action} {c.service} ({c.preempts})"
                    for c in o.callers
                    if c.preempts is not None and _live_between(c, after, by)
                ]
                v.violations.append(
                    f"{name} (priority {prio}) was preempted with no preemptor of higher "
                    f"priority under way, nor idle past its yield_after "
                    f"(preemptors then: {under_way or 'none'})"
                )
        elif old == "preempted" and new in LIVE_PHASES and not name.startswith(JOB_PREFIX):
            v.counts["resumes"] += 1


def _named_victims(o: Outcome, v: Verdict) -> None:
    """What each preemptor says it stopped ("preempted X, Y to make room": an ensure's
    JSON notes, a ``gpuctl run --preempt``'s lines), judged against its own priority: by
    whom, precisely. A victim of equal or higher priority is permitted only where it
    yielded while that preemptor was under way."""
    yields = _yields(o)
    for c in o.callers:
        doc = last_json(c.output)
        notes = list((doc or {}).get("notes") or [])
        notes += RUN_PREEMPTED_LINE.findall(c.output)
        for note in notes:
            m = PREEMPTED_NOTE.match(str(note))
            if not m:
                continue
            for victim in m.group(1).split(", "):
                v.counts["victims named by their preemptor"] += 1
                if c.action.startswith("run"):
                    v.counts["victims named by a run --preempt"] += 1
                v.checked["named victims below their preemptor"] += 1
                prio, job = _priority(o, victim)
                yielded = any(
                    n == victim and _live_between(c, after, by) for n, after, by in yields
                )
                if c.preempts is None or prio is None or (prio >= c.preempts and not yielded):
                    v.violations.append(
                        f"{c.action} {c.service} (priority {c.preempts}) preempted {victim} "
                        f"(priority {prio})"
                    )
                if job is not None and not job.preemptible:
                    v.violations.append(
                        f"{c.action} {c.service} preempted job {job.name}, not --preemptible"
                    )


def last_json(text: str) -> dict[str, Any] | None:
    """The JSON object a caller printed last (indented, after any lines on stderr)."""
    start = 0 if text.startswith("{") else text.rfind("\n{") + 1
    if start == 0 and not text.startswith("{"):
        return None
    try:
        doc = json.loads(text[start:])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def deaths(o: Outcome) -> list[tuple[str, int, float, float]]:
    """Each server or CMD that ended during the trial: (name, pid, after, by); jobs are
    named ``run.<job>``."""
    out = []
    for prev, cur in zip(o.observations, o.observations[1:], strict=False):
        for kind, before, now in (
            ("", prev.servers, cur.servers),
            (JOB_PREFIX, prev.jobs, cur.jobs),
        ):
            for name, pids in before.items():
                for pid in set(pids) - set(now.get(name, ())):
                    out.append((kind + name, pid, prev.at, cur.at))
    return out


def _stops_explained(o: Outcome, v: Verdict) -> None:
    changes = transitions(o)
    yields = _yields(o)
    for name, pid, after, by in deaths(o):
        v.checked["every stop explained"] += 1
        prio, job = _priority(o, name)
        if job is not None:
            if by >= job.spawned + job.duration_s:
                continue  # it may have run its course
            if not job.preemptible:
                v.violations.append(
                    f"job {job.name}'s CMD {pid} ended before its {job.duration_s:g}s "
                    "and it is not --preemptible"
                )
                continue
            stoppers = [
                c
                for c in o.callers
                if c.preempts is not None and c.preempts > job.priority
                and _live_between(c, after, by, STOP_SLACK_S)
            ]  # fmt: skip
        else:
            # A start that fails (its health timeout) ends its own server: the record
            # says ``failed`` then.
            failed_start = any(
                n == name and new == "failed" and b >= after - STOP_SLACK_S
                and a <= by + STOP_SLACK_S
                for n, _old, new, a, b in changes
            )  # fmt: skip
            # Its record turned preempted shortly before, when it had yielded.
            yielded = any(
                n == name and b <= by + STOP_SLACK_S and b >= after - YIELD_STOP_WINDOW_S
                for n, _a, b in yields
            )  # fmt: skip
            stoppers = [
                c
                for c in o.callers
                if _live_between(c, after, by, STOP_SLACK_S)
                and (
                    (c.action == "stop" and c.service == name)
                    or c.action == "reclaim"
                    or (c.service == name and failed_start)
                    or (
                        c.preempts is not None
                        and prio is not None
                        and (c.preempts > prio or yielded)
                    )
                )
            ]
        if not stoppers:
            v.violations.append(
                f"{name}'s {'CMD' if job else 'server'} {pid} ended between "
                f"{after:.2f} and {by:.2f} with no stop, reclaim, start or higher-priority "
                "preemptor of it under way"
            )


def _held(o: Outcome, rec: Mapping[str, Any], at: float) -> bool:
    """The record's lease is its holder's, mid-way: the file keeps a dead holder's lease
    until someone rewrites it, so only a caller alive then (by its pid) excuses it; a
    lease whose holder the trial did not spawn excuses it until it expires."""
    lease = rec.get("lease")
    if not isinstance(lease, Mapping):
        return False
    pid = lease.get("pid")
    mine = [c for c in o.callers if c.pid is not None and c.pid == pid]
    if not mine:
        return not isinstance(lease.get("expires"), int | float) or at < lease["expires"]
    return any(_live_between(c, at, at) for c in mine)


def _phases_heal(o: Outcome, v: Verdict) -> None:
    since: dict[str, float] = {}  # service -> when its record began to lie
    told: set[str] = set()
    for obs in o.observations:
        for name in sorted(set(obs.servers) | set(obs.records)):
            if name.startswith(JOB_PREFIX):
                continue
            rec = obs.records.get(name) or {}
            phase = rec.get("phase")
            if not obs.servers.get(name) or phase not in NOT_RUNNING or _held(o, rec, obs.at):
                since.pop(name, None)
                told.discard(name)
                continue
            v.checked["no live server under a not-running record"] += 1
            t0 = since.setdefault(name, obs.at)
            looks = [c.spawned for c in o.callers if c.action in HEALERS and c.spawned >= t0]
            if o.agent:
                looks.append(t0)
            if not looks or obs.at <= min(looks) + HEAL_S or name in told:
                continue
            told.add(name)
            who = "the agent" if o.agent and min(looks) == t0 else "a caller"
            v.violations.append(
                f"{name}: a live server under a {phase} record since {t0:.2f}, still at "
                f"{obs.at:.2f}, {obs.at - min(looks):.1f}s after {who} looked"
            )
