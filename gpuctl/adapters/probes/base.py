"""The probe interface and the helpers every probe shares."""

from __future__ import annotations

from typing import Protocol

from gpuctl.core.snapshot import ProbeReading


class Probe(Protocol):
    """Reads the GPU(s) of this host.

    ``name`` is what ``/status`` reports as ``probe`` (``nvml``, ``nvidia-smi``, ``sim``).
    ``read`` raises ``gpuctl.errors.ProbeError`` when the GPU cannot be read; it never
    reports an unreadable GPU as idle.
    """

    name: str

    def read(self) -> ProbeReading: ...

    def close(self) -> None: ...
