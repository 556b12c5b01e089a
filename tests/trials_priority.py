"""Preemption, ``gpuctl run`` and resume in the randomised trials.

Importing this module registers, beside ``tests/trials.py``'s actions (the trial's
services: chat 80 GiB priority 100 ``preempt = true``, batch 30 GiB priority 50
``resume = true``, peer 20 GiB priority 100):

- ``ensure --preempt``: may stop services of lower priority to make room;
- ``run`` and ``run --preemptible``: a ``gpuctl run`` job of 15 GiB at priority 40, 60
  or 100 whose CMD holds simulated GPU memory for a while (``gpuctl.sim.hold
  --duration``); the trial keeps each job (``Trial.jobs``) for the checks of
  tests/trials_invariants.py (a job preempted must have been preemptible and below its
  preemptor; a CMD that ends before its duration must have been preempted);
- ``run --preempt``: such a job at priority 60 or 100 that may stop the batch and
  preemptible jobs below it (the peer only once idle past its ``yield_after``, never a
  job that is not preemptible); the
  trial counts it as a preemptor of its priority;
- ``resume``: ``gpuctl resume`` of a service (never preempts);
- ``kill -9 mid-preemption``: an ``ensure --preempt`` of the top priority that lingers
  after each victim's stop (failpoint ``preempt.after_victim_stop``), killed there.

and these end-of-trial invariants, on the final records:

- **only preemptible jobs preempted**: a job whose record says ``preempted`` was
  ``--preemptible``;
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
import threading
import time

from tests.ensure_helpers import server_pids
from tests.trials import GIB, RESETS, Svc, Trial, action, check, preempts
from tests.trials_invariants import Job

JOB_GIB = 15


@action("ensure --preempt", 3)
def _ensure_preempt(t: Trial, s: Svc) -> None:
    top = max(t.services, key=lambda x: x.priority)
    if t.rng.random() < 0.8 and not server_pids(top.name):
        # Mostly the top priority while it is down: the one with victims to stop.
        s = top
    t.spawn(
        "ensure --preempt", s, "ensure", s.name, "--json", "--preempt", "--timeout", "20s",
        preempts=preempts(s, asked=True),
    )  # fmt: skip


@action("kill -9 mid-preemption", 1)
def _ensure_preempt_killed(t: Trial, s: Svc) -> None:
    """An ensure --preempt of the top priority that lingers after each victim's stop,
    killed there if it gets that far within a moment (otherwise it carries on)."""
    top = max(t.services, key=lambda x: x.priority)
    env = {"GPUCTL_FAILPOINTS": "preempt.after_victim_stop=sleep:1"}
    t.spawn(
        "ensure --preempt (killed)", top, "ensure", top.name, "--json", "--preempt",
        "--timeout", "20s", env=env, preempts=preempts(top, asked=True),
    )  # fmt: skip
    caller = t.callers[-1]
    pause = t.rng.uniform(0.3, 1.5)

    def later() -> None:
        time.sleep(pause)
        if caller.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                caller.proc.kill()
                t.counts["kills"] += 1

    threading.Thread(target=later, daemon=True).start()


def _run(t: Trial, s: Svc, preemptible: bool, preempt: bool = False) -> None:
    # The trial's prefix (its own processes carry it); now and then the service's name
    # too: its match keyword is then in CMD's command line, and gpuctl must still tell
    # CMD from that service's server by the job's record (a stop of the service once
    # stopped such a job).
    name = f"{t.prefix}job{len(t.jobs)}"
    if t.rng.random() < 0.3:
        name = f"{s.name}-job{len(t.jobs)}"
    # A preemptor at 60 may stop the batch (50) and preemptible jobs at 40; at 100, chat's
    # own rights (the peer, at 100 too, only once it has yielded).
    prio = t.rng.choice((60, 100) if preempt else (40, 60, 100))
    duration = round(t.rng.uniform(1.5, 5.0), 1)
    t.jobs[name] = Job(name, prio, preemptible, JOB_GIB * GIB, duration, time.time())
    hold = [sys.executable, "-m", "gpuctl.sim.hold", "--name", name]
    hold += ["--memory", f"{JOB_GIB}GiB", "--duration", f"{duration}s"]
    args = ["run", "--memory", f"{JOB_GIB}GiB", "--priority", str(prio), "--name", name]
    if preemptible:
        args.append("--preemptible")
    if preempt:
        args.append("--preempt")
    if t.rng.random() < 0.3:
        args += ["--wait", "--timeout", "5s"]
    what = "run --preempt" if preempt else "run --preemptible" if preemptible else "run"
    t.spawn(what, s, *args, "--", *hold, preempts=prio if preempt else None)


@action("run", 1.5)
def _run_plain(t: Trial, s: Svc) -> None:
    _run(t, s, preemptible=False)


@action("run --preemptible", 1.5)
def _run_preemptible(t: Trial, s: Svc) -> None:
    _run(t, s, preemptible=True)


@action("run --preempt", 3)
def _run_preempt(t: Trial, s: Svc) -> None:
    """A job that may stop lower-priority work to make its room (now and then itself
    preemptible, by work above it)."""
    _run(t, s, preemptible=t.rng.random() < 0.3, preempt=True)


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
def check_job_records(t: Trial) -> None:
    killed = any(c.action.startswith("run") and c.proc.returncode == -9 for c in t.callers)
    for name, job in t.jobs.items():
        t.checked["job records match their CMDs"] += 1
        rec = t.record(f"run.{name}")
        phase = rec.get("phase")
        if phase == "preempted" and not job.preemptible:
            t.violations.append(f"job {name} (priority {job.priority}) was preempted")
        pid = (rec.get("handle") or {}).get("pid")
        if phase == "running" and not _alive(pid) and not killed:
            t.violations.append(
                f"job {name}'s record runs, its CMD {pid} does not: {json.dumps(rec)}"
            )


def reset(t: Trial) -> None:
    """Stop the jobs' CMDs that outlived their killed gpuctl run, and forget the trial."""
    import psutil

    if not t.prefix:
        return  # never another run's processes
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        if "gpuctl.sim.hold" in argv and any(a.startswith(t.prefix) for a in argv):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.info["pid"], signal.SIGKILL)


RESETS.append(reset)
