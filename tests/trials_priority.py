"""Preemption, ``gpuctl run`` and resume in the randomised trials.

Importing this module registers, beside ``tests/trials.py``'s actions (the trial's
services have priorities: big 100, rival 60, small 40 with ``resume = true``):

- ``ensure --preempt``: may stop services of lower priority to make room;
- ``run`` and ``run --preemptible``: a ``gpuctl run`` job of 20 GiB at a random priority
  whose CMD holds simulated GPU memory for a moment (``gpuctl sim hold --duration``);
- ``resume``: ``gpuctl resume`` of a service (never preempts).

and these end-of-trial invariants (the sampler already checks one server per service,
no two services that do not fit together, no claims over the total, and the records
check no out-of-memory):

- **nothing stopped that was not a permitted victim**: a service whose record says
  ``preempted`` has a lower priority than some service an ``ensure --preempt`` asked
  for in the trial; a job whose record says ``preempted`` was ``--preemptible`` and of
  lower priority than that;
- **job records match their processes**: once the callers are done, a job's record is
  ``running`` only while its CMD lives (or its ``gpuctl run`` was killed, leaving the
  record void by its dead pid), and a ``gpuctl run`` that exited left its record ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field

from tests.ensure_helpers import server_pids
from tests.trials import RESETS, Svc, Trial, action, check

JOB_GIB = 20


@dataclass
class Log:
    preempting: list[int] = field(default_factory=list)  # priorities asked with --preempt
    jobs: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name -> (prio, preemptible)


_logs: dict[int, Log] = {}


def log_of(t: Trial) -> Log:
    return _logs.setdefault(id(t), Log())


@action("ensure --preempt", 3)
def _ensure_preempt(t: Trial, s: Svc) -> None:
    top = max(t.services, key=lambda x: x.priority)
    if t.rng.random() < 0.8 and not server_pids(top.name):
        # Mostly the top priority while it is down: the one with victims to stop.
        s = top
    log_of(t).preempting.append(s.priority)
    t.spawn("ensure --preempt", s, "ensure", s.name, "--json", "--preempt", "--timeout", "20s")


def _run(t: Trial, s: Svc, preemptible: bool) -> None:
    log = log_of(t)
    name = f"{s.name}job{len(log.jobs)}"
    prio = t.rng.choice((30, 50, 70))
    log.jobs[name] = (prio, preemptible)
    hold = [sys.executable, "-m", "gpuctl.sim.hold", "--name", name]
    hold += ["--memory", f"{JOB_GIB}GiB", "--duration", f"{t.rng.uniform(0.5, 2.5):.1f}s"]
    args = ["run", "--memory", f"{JOB_GIB}GiB", "--priority", str(prio), "--name", name]
    if preemptible:
        args.append("--preemptible")
    if t.rng.random() < 0.3:
        args += ["--wait", "--timeout", "5s"]
    t.spawn("run --preemptible" if preemptible else "run", s, *args, "--", *hold)


@action("run", 1.5)
def _run_plain(t: Trial, s: Svc) -> None:
    _run(t, s, preemptible=False)


@action("run --preemptible", 1.5)
def _run_preemptible(t: Trial, s: Svc) -> None:
    _run(t, s, preemptible=True)


@action("resume", 1)
def _resume(t: Trial, s: Svc) -> None:
    t.spawn("resume", s, "resume", s.name, "--json", "--timeout", "20s")


def _alive(pid: object) -> bool:
    import psutil

    if not isinstance(pid, int):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@check
def check_priorities(t: Trial) -> None:
    log = log_of(t)
    top = max(log.preempting, default=None)
    for s in t.services:
        if t.record(s.name).get("phase") == "preempted" and (top is None or s.priority >= top):
            t.violations.append(
                f"{s.name} (priority {s.priority}) was preempted, but no ensure --preempt of "
                f"higher priority ran (asked: {log.preempting})"
            )
    killed = any(c.action.startswith("run") and c.proc.returncode == -9 for c in t.callers)
    for name, (prio, preemptible) in log.jobs.items():
        rec = t.record(f"run.{name}")
        phase = rec.get("phase")
        if phase == "preempted" and (not preemptible or top is None or prio >= top):
            t.violations.append(
                f"job {name} (priority {prio}, preemptible {preemptible}) was preempted "
                f"(asked with --preempt: {log.preempting})"
            )
        pid = (rec.get("handle") or {}).get("pid")
        if phase == "running" and not _alive(pid) and not killed:
            t.violations.append(
                f"job {name}'s record runs, its CMD {pid} does not: {json.dumps(rec)}"
            )


def reset(t: Trial) -> None:
    """Stop the jobs' CMDs that outlived their killed gpuctl run, and forget the trial."""
    import psutil

    names = set(log_of(t).jobs)
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        if "gpuctl.sim.hold" in argv and any(n in argv for n in names):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.info["pid"], signal.SIGKILL)
    _logs.pop(id(t), None)


RESETS.append(reset)
