"""``gpuctl sim ls``: what the simulated GPU holds, and which processes hold it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpuctl.errors import UsageError
from gpuctl.flows.op_results import SimClaim, SimListing
from gpuctl.sim.gpu import SimGpu

if TYPE_CHECKING:
    from gpuctl.config import Config


def configured_sim_dir(conf: Config) -> tuple[Path | None, str]:
    """The folder of the config's simulated host (``probe = "sim"``, no agent), and the
    key that names it (``hosts.box.sim_dir``): what ``gpuctl status`` reads for that host,
    so ``sim ls`` lists the same GPU. ``(None, "default")`` when no host is simulated, or
    its folder is the default one.

    Raises:
        UsageError: simulated hosts in different folders: which one is meant is not known.
    """

    sims = [h for h in conf.hosts.values() if h.probe == "sim" and not h.agent]
    folders = {h.sim_dir for h in sims}
    if len(folders) > 1:
        named = ", ".join(f"{h.name} ({h.sim_dir or 'the default folder'})" for h in sims)
        raise UsageError(
            f"the config simulates its hosts in different folders: {named}",
            hint="name the one to list: gpuctl sim ls --sim-dir DIR",
        )
    if not sims or sims[0].sim_dir is None:
        return None, "default"
    return sims[0].sim_dir, f"hosts.{sims[0].name}.sim_dir"


def list_claims(
    sim_dir: Path | None,
    total_mib: int | None,
    source: str = "",
    *,
    command_of: Callable[[int], str | None],
) -> SimListing:
    """The simulated GPU's claims, each with its process's command line (``command_of``:
    ``Machine.command_of``)."""

    sim = SimGpu(sim_dir, total_mib, define=False)  # a listing never changes the GPUs
    claims = tuple(
        SimClaim(c.pid, c.name, c.memory_mib, c.gpu, command_of(c.pid)) for c in sim.claims()
    )
    return SimListing(
        str(sim.sim_dir),
        sim.total_mib,
        claims,
        sim.totals_mib,
        sim.totals_mismatch() or None,
        source,
    )
