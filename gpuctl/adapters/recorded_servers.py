"""The servers a host's records name, found on this machine: one finder for the agent and
for the direct path (no agent), so both report the same servers.

A record names its server by the launcher's handle (``handle.pid``). A start whose caller
died between spawning and recording has no handle yet, only its ``start_nonce``: every
launcher puts ``GPUCTL_START_NONCE=<nonce>`` into the server's environment, so the server
is the process carrying it (``/proc/<pid>/environ``). Either way it is that service's,
whatever its command line says.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.environ import START_NONCE_ENV
from gpuctl.core.record import Phase, Record, recorded_servers


def find_servers(records: Iterable[Record]) -> dict[int, str]:
    """``{pid: service}``: the handles' pids (``core.record.recorded_servers``) and, for a
    start not yet recorded, the process that carries its start nonce."""
    records = list(records)
    out = recorded_servers(records)
    named = set(out.values())
    for r in records:
        if r.phase is Phase.STARTING and r.start_nonce and r.service not in named:
            found = procinfo.find_by_env(START_NONCE_ENV, r.start_nonce)
            if found is not None:
                out.setdefault(found, r.service)
    return out
