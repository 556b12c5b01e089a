"""Services as their records promise them: one host, any number of configs.

Admission counts every record it finds at the host at the record's own figures (its
``Promise``), whatever the asking client's config says or leaves out: laptop A's config
names ``vllm``, laptop B's names ``chat``, and both count both. A record in a phase that
holds or promises memory but carries no promise (an older release wrote it) is unknown
memory: a client whose config names that service counts it by its config, as before,
and heals the record at its next ``ensure`` or ``touch``; any other client cannot say
what fits beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, Self, TypeVar

import msgspec

from gpuctl.core.jobs import is_job
from gpuctl.core.names import is_service_name
from gpuctl.core.promise import Promise
from gpuctl.core.record import Phase, Record

# The phases in which a service holds memory, or has promised it: a record in one of
# them whose promise is unknown (an older release wrote it) is unknown memory.
HOLDING_PHASES = frozenset(
    {Phase.STARTING, Phase.RUNNING, Phase.SLEEPING, Phase.STOPPING, Phase.PREEMPTED}
)


class PromisedSpec(msgspec.Struct, frozen=True):
    """A service no config of this client names, as its record's promise describes it
    (a ``ServiceSpec`` for the decision). Its processes are known by the pids the
    records name (handle, start nonce), never by keywords: this client knows none."""

    name: str
    memory_mib: int | None
    priority: int
    devices: tuple[int, ...] | None
    health_timeout_s: float
    kind: str = "server"
    resume: bool = False

    @property
    def keywords(self) -> tuple[str, ...]:
        return ()

    @property
    def default_match(self) -> bool:
        return False

    @classmethod
    def of(cls, name: str, p: Promise) -> PromisedSpec:
        return cls(name, p.memory_mib, p.priority, p.devices, p.health_timeout_s, p.kind, p.resume)


class Promisable(Protocol):
    """A service that can take on a record's figures (``config.ServiceConfig``)."""

    @property
    def name(self) -> str: ...
    def with_promise(self, promise: Promise) -> Self: ...


P = TypeVar("P", bound=Promisable)


def as_promised(services: Sequence[P], records: Mapping[str, Record]) -> list[P]:
    """Each configured service with the figures its record promises, where the record
    holds memory and says what it promised: the start that made it may have come from
    another config, and the host's record is the one truth of what it will grow to."""
    out = []
    for s in services:
        r = records.get(s.name)
        out.append(s.with_promise(r.promise) if r and r.promise and holds_memory(r) else s)
    return out


def holds_memory(record: Record) -> bool:
    """Whether the record says its service holds or has promised memory: a start under
    way (a lease, or phase ``starting``), a server running, asleep or being stopped, or
    one preempted whose server is still recorded (its stop may not have landed)."""
    if record.lease is not None:
        return True
    if record.phase is Phase.PREEMPTED:
        return bool(record.handle)
    return record.phase in HOLDING_PHASES


def strangers(
    records: Iterable[Record], configured: Iterable[str], exclude: str = ""
) -> tuple[list[PromisedSpec], list[str]]:
    """The services the records name that ``configured`` does not: (those that say what
    they promise, as specs; those that hold memory without saying how much). ``gpuctl
    run`` jobs are left out: their handle is their spec (``core.jobs``)."""
    known = set(configured)
    specs: list[PromisedSpec] = []
    unknown: list[str] = []
    for r in records:
        if (
            r.service == exclude
            or r.service in known
            or is_job(r.service)
            or not is_service_name(r.service)  # the store's own entries (_admission, …)
        ):
            continue
        if r.promise is not None:
            specs.append(PromisedSpec.of(r.service, r.promise))
        elif holds_memory(r):
            unknown.append(r.service)
    return specs, unknown
