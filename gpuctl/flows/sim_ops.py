"""``gpuctl sim ls``: what the simulated GPU holds, and which processes hold it."""

from __future__ import annotations

from pathlib import Path

from gpuctl.flows.results import SimClaim, SimListing


def list_claims(sim_dir: Path | None, total_mib: int | None) -> SimListing:
    from gpuctl.adapters.procinfo import command_of
    from gpuctl.sim.gpu import SimGpu

    sim = SimGpu(sim_dir, total_mib, define=False)  # a listing never changes the GPUs
    claims = tuple(
        SimClaim(c.pid, c.name, c.memory_mib, c.gpu, command_of(c.pid)) for c in sim.claims()
    )
    return SimListing(
        str(sim.sim_dir), sim.total_mib, claims, sim.totals_mib, sim.totals_mismatch() or None
    )
