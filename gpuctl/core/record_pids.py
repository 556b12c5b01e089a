"""Which pids the records name as their services' servers, on which machine.

Pure rules over records (``gpuctl.core.record``), kept apart so the record module stays
about the record itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuctl.core.record import Phase, Record


def pid_is_here(handle: dict[str, Any] | None, here: tuple[str, str] | None) -> bool:
    """Whether a handle's pid may be looked up on the machine ``here`` (hostname, boot
    id): a handle that names where its pid lives (a run job's does) must name ``here``;
    pid 1 of another machine, or of this one's last boot, is not this one's pid 1."""
    h = handle or {}
    if here is None or ("host" not in h and "boot_id" not in h):
        return True
    return (h.get("host"), h.get("boot_id")) == here


def recorded_servers(
    records: Iterable[Record], here: tuple[str, str] | None = None
) -> dict[int, str]:
    """``{pid: service}`` for every record that names its server's pid (its launcher's
    handle). Such a process is that service's whatever its command line says. With
    ``here`` (this machine's hostname and boot id), a handle written on another machine
    or boot names no pid here (``pid_is_here``)."""
    out: dict[int, str] = {}
    for r in records:
        pid = (r.handle or {}).get("pid")
        if not pid_is_here(r.handle, here):
            continue
        if isinstance(pid, int) and pid > 0 and r.phase is not Phase.STOPPED:
            out[pid] = r.service
    return out
