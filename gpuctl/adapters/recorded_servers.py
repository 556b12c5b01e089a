"""The servers a host's records name, on this machine: where they are (one finder for the
agent and for the direct path without one, so both report the same servers), and what
each is seen doing (``truth_reader``, for ``gpuctl.core.heal``).

A record names its server by the launcher's handle (``handle.pid``). A start whose caller
died between spawning and recording has no handle yet, only its ``start_nonce``: every
launcher puts ``GPUCTL_START_NONCE=<nonce>`` into the server's environment, so the server
is the process carrying it (``/proc/<pid>/environ``). Either way it is that service's,
whatever its command line says. So are the processes it forked (``server_children``):
a vLLM's engine core holds the GPU memory, not the API server the record names.

What a server is seen doing is its process and its health (``ps -o pid,lstart -p PID``
and ``curl -s -o /dev/null -w '%{http_code}' HEALTH``). A pid is looked up only where it
lives: by a caller on the GPU host (the agent, or a command on a host without an agent,
whose store is on this machine), and only for the ``process`` launcher's handle, the one
whose pid is the server itself on this machine (a Docker container's or a Jupyter
terminal's server is the engine's or Jupyter's to tell). Elsewhere the process is
"cannot tell" (None), and only the health URL speaks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import httpx

from gpuctl.adapters import health, procinfo
from gpuctl.adapters.launchers.environ import START_NONCE_ENV
from gpuctl.core.heal import ServerTruth
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_pids import pid_is_here, recorded_servers


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


# A server that answers does so at once; the heal pass must not hold a command up.
HEALTH_TIMEOUT_S = 1.0
# The kernel's initial PID namespace has this inode (PROC_PID_INIT_INO): a reader in it
# sees every process of the machine.
INIT_PID_NS = 0xEFFFFFFC


def can_tell_gone(recorded_ns: int | None) -> bool:
    """Whether "no such pid" here means the process of a handle counted in
    ``recorded_ns`` is gone: only in that very namespace (a handle from before the key:
    only from the machine's initial namespace, where every process shows). A reader in
    a container without ``--pid=host`` sees no host pid, alive or not."""
    mine = procinfo.pid_namespace()
    if mine is None:
        return False
    return mine == (recorded_ns if recorded_ns is not None else INIT_PID_NS)


def truth_reader(
    on_host: bool,
    client: Callable[[], httpx.Client] | None = None,
    may_fetch: Callable[[Record], bool] | None = None,
) -> Callable[[Record], ServerTruth]:
    """``record -> ServerTruth``; never raises. ``client``: the command's shared HTTP
    client, made only when a health URL is asked. ``may_fetch``: whether this record's
    health URL may be fetched at all (the agent's ``core.health_reach`` rule); a refused
    one is never fetched, and its answer stays "cannot tell", so it changes no phase."""
    here = None
    if on_host:
        me = procinfo.host_identity()
        here = (me.hostname, me.boot_id)

    def look(record: Record) -> ServerTruth:
        h = record.handle or {}
        pid, start = h.get("pid"), h.get("pid_start")
        alive: bool | None = None
        on_here = here is not None and pid_is_here(h, here)
        if on_here and h.get("kind") == "process" and isinstance(pid, int):
            started = float(start) if isinstance(start, int | float) else None
            alive = procinfo.is_same_process(pid, started)
            ns = h.get("pid_ns")
            if not alive and not can_tell_gone(ns if isinstance(ns, int) else None):
                # Not seen from here is not gone: another PID namespace hides it.
                alive = None
        answers: bool | None = None
        # Health is asked only where it can change the verdict: a start that may be
        # done, a victim whose process cannot be looked up here.
        if (
            record.health
            and (
                record.phase is Phase.STARTING
                or (record.phase is Phase.PREEMPTED and alive is None)
            )
            and (may_fetch is None or may_fetch(record))
        ):
            answers = health.check(record.health, HEALTH_TIMEOUT_S, client() if client else None).ok
        return ServerTruth(alive=alive, answers=answers)

    return look
