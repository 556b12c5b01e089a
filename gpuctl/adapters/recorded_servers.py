"""The servers a host's records name, found on this machine: one finder for the agent and
for the direct path (no agent), so both report the same servers.

A record names its server by the launcher's handle (``handle.pid``). A start whose caller
died between spawning and recording has no handle yet, only its ``start_nonce``: every
launcher puts ``GPUCTL_START_NONCE=<nonce>`` into the server's environment, so the server
is the process carrying it (``/proc/<pid>/environ``). Either way it is that service's,
whatever its command line says. So are the processes it forked (``server_children``):
a vLLM's engine core holds the GPU memory, not the API server the record names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.environ import START_NONCE_ENV
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_pids import recorded_servers


def find_servers(records: Iterable[Record]) -> dict[int, str]:
    """``{pid: service}``: the handles' pids (``core.record.recorded_servers``) and, for a
    start whose server was not recorded (starting, or running since it answered), the
    process that carries its start nonce."""
    records = list(records)
    # Only pids written on this machine, in this boot, are looked up here: another
    # host's `run` record naming pid 1 must not show this machine's pid 1 as its job.
    me = procinfo.host_identity()
    out = recorded_servers(records, (me.hostname, me.boot_id))
    named = set(out.values())
    for r in records:
        # A start whose server was never recorded stays known by its nonce after the
        # agent (or a touch) saw it answer and made it `running`.
        if r.phase in (Phase.STARTING, Phase.RUNNING) and r.start_nonce and r.service not in named:
            found = procinfo.find_by_env(START_NONCE_ENV, r.start_nonce)
            if found is not None:
                out.setdefault(found, r.service)
    return out


def server_children(records: Iterable[Record], servers: Mapping[int, str]) -> dict[int, str]:
    """``{pid: service}`` of the live processes below the ``servers`` (children and
    their children). A handle's pid whose start time is not the recorded one is a pid
    reused by someone else: its children are not the service's."""
    handles = {
        pid: (r.handle or {}).get("pid_start")
        for r in records
        if isinstance(pid := (r.handle or {}).get("pid"), int)
    }
    roots = [
        pid
        for pid in servers
        if pid not in handles
        or not isinstance(start := handles[pid], int | float)
        or procinfo.is_same_process(pid, float(start))
    ]
    return {child: servers[root] for child, root in procinfo.descendants(roots).items()}
