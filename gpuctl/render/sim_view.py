"""``gpuctl sim ls`` as text and as its JSON object (schema 1)::

{"schema": 1, "sim_dir": "…", "memory_total_mib": 131072, "memory_used_mib": 20480,
 "claims": [{"pid": 1, "name": "comfyui", "memory_mib": 20480, "gpu": 0,
             "command": "…"}]}
"""

from __future__ import annotations

from typing import Any

from gpuctl.core.units import format_mib
from gpuctl.flows.results import SimListing


def sim_ls_to_json(listing: SimListing) -> dict[str, Any]:
    return {
        "schema": 1,
        "sim_dir": listing.sim_dir,
        "memory_total_mib": listing.total_mib,
        "memory_used_mib": listing.used_mib,
        "claims": [
            {
                "pid": c.pid,
                "name": c.name,
                "memory_mib": c.memory_mib,
                "gpu": c.gpu,
                "command": c.command,
            }
            for c in listing.claims
        ],
    }


def sim_ls_text(listing: SimListing) -> list[str]:
    lines = [
        f"simulated GPU {listing.sim_dir}: {format_mib(listing.used_mib)} used of "
        f"{format_mib(listing.total_mib)}"
    ]
    if not listing.claims:
        return [*lines, "no claims: the GPU is idle"]
    table = [("PID", "NAME", "MEMORY", "COMMAND")]
    table += [
        (str(c.pid), c.name, format_mib(c.memory_mib), c.command or "-") for c in listing.claims
    ]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        lines.append(
            "  ".join(v.ljust(w) for v, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        )
    return lines
