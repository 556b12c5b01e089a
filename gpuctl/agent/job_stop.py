"""``POST /records/{service}/stop``: the agent stops a ``gpuctl run --preemptible`` job.

A preemption from another machine (``ensure --preempt --host dgx`` on a laptop) cannot
signal a job whose CMD runs on the GPU host; the agent there can. It signals a pid only
when every one of these holds, else it refuses and signals nothing:

- the record ``service`` is a run job's (``run.NAME``), running (or marked ``preempted``
  by the caller, under its lease), with its handle (404);
- the job was started with ``--preemptible`` (403: it is never stopped for other work);
- the request names the pid and the pid start time the record names (409), and CMD runs
  on this agent's machine in this boot (409);
- the caller holds the record's lease (409): a preemption takes it first, so two callers
  never stop one job, and a caller that only holds the token cannot stop a job it has
  not judged under the lease;
- the pid is really that job's CMD (403, ``adapters.job_cmd.verify_job``): its environment carries
  the record's ``run_nonce``, the job's name and the --preemptible mark ``gpuctl run``
  put there, and it leads its own session. The token can write any record, so without
  this a forged ``run.evil`` naming any pid would have it (and its group) signalled; an
  environment the agent cannot read is refused too.

Then: SIGTERM to the job's process group, the grace period, SIGKILL (``signal_job``); a
pid that now belongs to another process (its start time differs) is never signalled.
The caller writes the record's ``preempted`` phase, as it does for a job it stops itself.
"""

from __future__ import annotations

import os
from typing import Any

from gpuctl.adapters.job_cmd import signal_job
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent.http import HttpError
from gpuctl.core import record_shapes as shapes
from gpuctl.core.jobs import JOB_GRACE_S, PREFIX, is_job
from gpuctl.core.record import Phase
from gpuctl.core.snapshot import HostIdentity
from gpuctl.errors import LauncherError

# The longest grace period a job stop may ask for (the request waits for it).
MAX_GRACE_S = shapes.MAX_GRACE_S
_NOT_A_JOB_HINT = "only a running `gpuctl run --preemptible` job (record run.NAME) can be stopped"


def stop_job(
    store: DirectStore, service: str, args: dict[str, Any], here: HostIdentity
) -> dict[str, Any]:
    """Check the request against the record, then stop the job (blocks for the grace
    period at most: run it in a worker thread). Returns ``{"killed": bool}``.

    Raises:
        HttpError: 403, 404 or 409 as the module says; nothing was signalled.
    """
    if not is_job(service):
        raise HttpError(404, f"{service!r} is not a run job's record", _NOT_A_JOB_HINT)
    rec = store.get(service)
    h = rec.handle or {}
    # A preemption marks its victim `preempted` under the lease before the stop (so a
    # preemptor killed mid-way leaves no `running` record of a dead job): that phase
    # counts as live only for the lease holder.
    ours = rec.lease is not None and rec.lease.holder == args["holder"]
    live = rec.phase is Phase.RUNNING or (rec.phase is Phase.PREEMPTED and ours)
    if not live or h.get("kind") != "run":
        raise HttpError(
            404,
            f"no running job {service[len(PREFIX) :]!r} (its record is {rec.phase.value})",
            _NOT_A_JOB_HINT,
        )
    if h.get("preemptible") is not True:
        raise HttpError(
            403,
            f"{service} was not started with --preemptible: it is never stopped for other work",
            "wait for it to end, or ask who started it",
        )
    pid, start = args["pid"], args["pid_start"]
    if h.get("pid") != pid or h.get("pid_start") != start:
        raise HttpError(
            409,
            f"the record of {service} names pid {h.get('pid')} started at "
            f"{h.get('pid_start')}, not pid {pid} started at {start}",
            "read the record again: the job may have been restarted",
        )
    if (h.get("host"), h.get("boot_id")) != (here.hostname, here.boot_id):
        raise HttpError(
            409,
            f"{service}'s CMD runs on {h.get('host') or 'another machine'}, "
            f"not on this agent's ({here.hostname}, this boot)",
            "stop it from the machine it runs on",
        )
    if not ours:
        raise HttpError(
            409,
            f"the caller does not hold the lease of {service}",
            f"take it first (POST /records/{service}/lease), then ask again",
        )
    if pid <= 1 or pid in (os.getpid(), os.getpgrp()):
        # Only a tampered record names these: never init, never the agent itself.
        raise HttpError(409, f"pid {pid} is not a job's CMD", "a job's CMD is its own session")
    try:
        killed = signal_job(
            pid,
            float(start),
            args.get("grace_s", JOB_GRACE_S),
            job=service[len(PREFIX) :],
            nonce=h.get("run_nonce"),
        )
    except LauncherError as e:
        raise HttpError(403, e.message, e.hint) from None
    return {"killed": killed}
