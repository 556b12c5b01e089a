"""Two configs and the agentless path in the randomised trials (tests/trials.py).

Importing this module registers, beside the runner's own actions:

- ``ensure (laptop B)``: an ensure from a second laptop whose config names ``chat`` and
  ``guest``, a service the first laptop's config does not know (each counts the other's
  starts by their records' promises alone);
- ``ensure (no agent)``, ``stop (no agent)``, ``reclaim (no agent)``: the first laptop's
  services driven on the host itself without the agent (the direct store on the same
  files, under the same locks), mixed with every caller that goes through the agent.

The runner's invariants judge them like any other caller: a stop or reclaim without the
agent is a stop or reclaim (its caller is labelled so), an ensure that may preempt
carries its priority.
"""

from __future__ import annotations

import subprocess
import time

import tests.trials_reclaim as reclaim_trials
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import cli_env
from tests.trials import Caller, Svc, Trial, action, preempts


def _laptop_b(t: Trial) -> list[Svc]:
    return [s for s in t.services if s.only_b or s.preempt]


@action("ensure (laptop B)", 1.5)
def _ensure_b(t: Trial, s: Svc) -> None:
    svc = s if s in _laptop_b(t) else t.rng.choice(_laptop_b(t))
    args = ["ensure", svc.name, "--json", "--timeout", "20s"]
    if t.rng.random() < 0.4:
        args.append("--no-wait")
    t.spawn("ensure", svc, *args, preempts=preempts(svc), cfg=t.cfg_b)


def _direct(t: Trial, s: Svc) -> Svc:
    """``s``, or one the direct config names when only laptop B's does."""
    return t.rng.choice([x for x in t.services if not x.only_b]) if s.only_b else s


@action("ensure (no agent)", 1.5)
def _ensure_direct(t: Trial, s: Svc) -> None:
    svc = _direct(t, s)
    args = ["ensure", svc.name, "--json", "--timeout", "20s"]
    if t.rng.random() < 0.4:
        args.append("--no-wait")
    t.spawn("ensure", svc, *args, preempts=preempts(svc), cfg=t.cfg_direct)


@action("stop (no agent)", 0.7)
def _stop_direct(t: Trial, s: Svc) -> None:
    svc = _direct(t, s)
    t.spawn("stop", svc, "stop", svc.name, "--json", cfg=t.cfg_direct)


@action("reclaim (no agent)", 0.7)
def _reclaim_direct(t: Trial, s: Svc) -> None:
    """Kept with the agent's reclaims (tests/trials_reclaim.py), so the invariant on
    touches judges it too."""
    assert t.cfg_direct is not None
    entry = reclaim_trials.Timed(s.name, time.time())
    env = {**cli_env(t.cfg_direct), **t.host.env(), "GPUCTL_CONFIG": str(t.cfg_direct)}
    proc = subprocess.Popen(
        [gpuctl_exe(), "reclaim", "--json"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    entry.proc = proc
    t.callers.append(Caller("reclaim", s.name, proc))
    reclaim_trials._follow(entry, proc)
    with reclaim_trials.log_of(t).lock:
        reclaim_trials.log_of(t).reclaims.append(entry)


# A stop without the agent may cut a request as any manual stop may: kept with the stops.
reclaim_trials._timed("stop (no agent)", "stops")
