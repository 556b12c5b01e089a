"""Words for a service that only another config names (``flows.results.OtherService``),
shared by the text and JSON views of ``gpuctl status``."""

from __future__ import annotations

from gpuctl.core.units import format_mib
from gpuctl.flows.results import OtherService


def other_reason(o: OtherService) -> str:
    """Why it is listed, and what admission counts it at."""
    p = o.promise
    if p is None:
        return (
            f"not in this config; {o.phase} by a record an older gpuctl wrote, which does "
            f"not say what it promised: nothing beside it can be called free until "
            f"`gpuctl touch {o.name}` runs from a config that names it"
        )
    budget = format_mib(p.memory_mib) if p.memory_mib is not None else "no budget"
    where = "" if p.devices is None else f" on GPU {', '.join(str(d) for d in p.devices)}"
    return (
        f"not in this config; {o.phase}, counted at its record's promise: {budget}{where}, "
        f"priority {p.priority}{', batch' if p.kind == 'batch' else ''}"
    )
