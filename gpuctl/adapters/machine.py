"""This machine and this process, as the flows see them (``gpuctl.flows.ports.Machine``):
its identity, a lease holder for this process, and what a pid here is."""

from __future__ import annotations

from gpuctl.adapters import procinfo
from gpuctl.adapters.store.base import holder_here
from gpuctl.core.record import Holder
from gpuctl.core.snapshot import HostIdentity


class ThisMachine:
    """The machine this process runs on."""

    @property
    def here(self) -> HostIdentity:
        return procinfo.host_identity()

    def holder(self, entry: str) -> Holder:
        return holder_here(entry)

    def start_time(self, pid: int) -> float | None:
        return procinfo.start_time(pid)

    def is_same_process(self, pid: int, started: float | None) -> bool:
        return procinfo.is_same_process(pid, started)

    def command_of(self, pid: int) -> str | None:
        return procinfo.command_of(pid)
