"""What a start promises the host: the figures every client counts a service at.

A plain value, kept in the service's record (``core.record.Record.promise``) and written
with the start's lease; the rules that read it are in ``core.promised_specs``.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The highest GPU index a config or a promise may name.
MAX_DEVICE_INDEX = 1023


class Promise(msgspec.Struct, frozen=True):
    """What a start promises the host, written into the record with its lease.

    Admission on every client counts a service by these figures, whatever that client's
    own config says of it (or whether it names it at all): two laptops with different
    configs share one GPU, and the one truth of what a start will grow to is the record
    on the host, never a config elsewhere. ``memory_mib`` None: the service has no
    budget (anything else running makes it BUSY, and it counts as what it holds).
    ``devices`` None: any one GPU. ``kind``: ``server`` or ``batch`` (a batch answers no
    requests). ``resume``: it is brought back after a preemption. ``yield_after_s``: its
    ``yield_after`` (None: never), so whether it yields is its starter's word too.
    """

    memory_mib: int | None
    priority: int
    devices: tuple[int, ...] | None = None
    kind: str = "server"
    resume: bool = False
    health_timeout_s: float = 600.0
    # Unused this long, it yields to any start that preempts; None: never (and so for a
    # promise an older release wrote without it: nothing says it may be stopped).
    yield_after_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_mib": self.memory_mib,
            "priority": self.priority,
            "devices": list(self.devices) if self.devices is not None else None,
            "kind": self.kind,
            "resume": self.resume,
            "health_timeout_s": self.health_timeout_s,
            "yield_after_s": self.yield_after_s,
        }
