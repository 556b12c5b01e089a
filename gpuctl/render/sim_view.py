"""``gpuctl sim ls`` as text and as its JSON object (schema 1)::

{"schema": 1, "sim_dir": "…", "sim_dir_from": "hosts.box.sim_dir", "memory_total_mib": 131072, "memory_used_mib": 20480,
 "gpus": [{"index": 0, "memory_total_mib": 131072, "memory_used_mib": 20480}],
 "claims": [{"pid": 1, "name": "comfyui", "memory_mib": 20480, "gpu": 0,
             "command": "…"}]}
"""

from __future__ import annotations

from typing import Any

from gpuctl.core.units import format_mib
from gpuctl.flows.op_results import SimListing


def sim_ls_to_json(listing: SimListing) -> dict[str, Any]:
    return {
        "schema": 1,
        "sim_dir": listing.sim_dir,
        "sim_dir_from": listing.source or None,
        "memory_total_mib": listing.total_mib,
        "memory_used_mib": listing.used_mib,
        "gpus": [
            {"index": i, "memory_total_mib": t, "memory_used_mib": listing.gpu_used_mib(i)}
            for i, t in enumerate(listing.totals_mib)
        ],
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
    # A folder taken from the config says so: it is not the one the sim commands default to.
    key = f" ({listing.source})" if listing.source.startswith("hosts.") else ""
    lines = [
        f"simulated GPU {listing.sim_dir}{key}: {format_mib(listing.used_mib)} used of "
        f"{format_mib(listing.total_mib)}"
    ]
    many = len(listing.totals_mib) > 1
    if many:
        lines += [
            f"  GPU {i}: {format_mib(listing.gpu_used_mib(i))} used of {format_mib(t)}"
            for i, t in enumerate(listing.totals_mib)
        ]
    if not listing.claims:
        return [*lines, "no claims: the GPU is idle"]
    table = (
        [("PID", "NAME", "GPU", "MEMORY", "COMMAND")]
        if many
        else [("PID", "NAME", "MEMORY", "COMMAND")]
    )
    for c in listing.claims:
        row = (
            (str(c.pid), c.name, str(c.gpu), format_mib(c.memory_mib))
            if many
            else (str(c.pid), c.name, format_mib(c.memory_mib))
        )
        table.append((*row, c.command or "-"))
    n = len(table[0]) - 1
    widths = [max(len(r[i]) for r in table) for i in range(n)]
    for r in table:
        lines.append(
            "  ".join(v.ljust(w) for v, w in zip(r[:n], widths, strict=True)) + "  " + r[n]
        )
    return lines
