"""The launcher a service names, built for its host; and how to tell cheaply whether the
server a record points to still runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import secret_names
from gpuctl.adapters.launchers.jupyter import JupyterLauncher
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.config.parse import launcher_list
from gpuctl.config.paths import default_state_dir
from gpuctl.config.values import host_address
from gpuctl.core.record import Record
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import GpuctlError, LauncherError, UsageError
from gpuctl.sim.settings import ENV_SIM_DIR as SIM_DIR_ENV
from gpuctl.sim.settings import ENV_SIM_HOST as SIM_HOST_ENV

if TYPE_CHECKING:
    # ``status`` wires no launcher: the base is imported where one is made or checked.
    from gpuctl.adapters.launchers.base import Launcher


def launcher_for(
    service: ServiceConfig, host: HostConfig, snapshot: Snapshot | None, config: Config
) -> Launcher:
    """The launcher ``service`` names on ``host``. Its servers inherit none of the secrets
    any part of ``config`` names (``environ.secret_names``): every host's, not only this one's."""

    secrets = secret_names(config)

    kind = service.launcher
    if kind is None:
        raise UsageError(
            f"service {service.name!r} has no launcher, so gpuctl cannot start it",
            hint=f"set services.{service.name}.launcher to one of {launcher_list()}",
        )
    if kind == "process":
        from gpuctl.adapters.launchers.process import ProcessLauncher

        here = procinfo.host_identity()
        if host.agent:
            # The process launcher runs commands on this machine only: refuse to start a
            # "remote" server on the laptop.
            there = snapshot.host if snapshot else None
            if there is None or (there.hostname, there.boot_id) != (here.hostname, here.boot_id):
                name = there.hostname if there else "unknown"
                raise LauncherError(
                    f"the process launcher starts commands on this machine ({here.hostname}), "
                    f"but host {host.name!r} is {name}",
                    hint=f"use launcher = 'jupyter' or 'docker' for services.{service.name}, "
                    "or run gpuctl on the GPU host",
                )
        state_dir = (
            Path(snapshot.state_dir) if snapshot and snapshot.state_dir else default_state_dir()
        )
        # A simulated host's servers claim memory on its own simulated GPU, and listen
        # on its address.
        sim_env = (
            {SIM_DIR_ENV: str(host.sim_dir), SIM_HOST_ENV: host_address(host)}
            if host.sim_dir is not None
            else None
        )
        return ProcessLauncher(log_dir=state_dir / "logs", secrets=secrets, sim_env=sim_env)
    if kind == "docker":
        from gpuctl.adapters.launchers.docker import DockerLauncher

        return DockerLauncher(host.docker, secrets=secrets)
    if kind == "ollama":
        from gpuctl.adapters.launchers.ollama import OllamaLauncher

        assert host.ollama is not None and service.model is not None  # checked at load
        # The loader runs on this machine (it is an HTTP client), so its log is here.
        return OllamaLauncher(
            host.ollama,
            service.model,
            keep_alive_s=service.idle_timeout_s,
            log_dir=default_state_dir() / "logs",
        )

    if kind == "slurm":
        from gpuctl.adapters.launchers.slurm import SlurmLauncher

        assert host.slurm is not None  # checked at load
        # sbatch runs here, on the cluster's login node; the log folder must be one the
        # compute nodes share (docs/how-to/slurm.md).
        return SlurmLauncher(
            host.slurm, log_dir=default_state_dir() / "logs", secrets=secrets, host=host.name
        )

    assert host.jupyter is not None
    return JupyterLauncher(host.jupyter, host.jupyter_token(), host_name=host.name, secrets=secrets)


def handle_checker(
    service: ServiceConfig, host: HostConfig, docker: Callable[[], Launcher]
) -> Callable[[Record], bool | None]:
    """How to tell whether the server a record points to still runs, where that is cheap.
    ``docker``: the service's own launcher (a Docker client, or Slurm's squeue)."""

    def check(record: Record) -> bool | None:
        if not record.handle:
            return None

        handle = Handle.from_dict(record.handle)
        if handle.kind == "process" and handle.pid and not host.agent:
            return procinfo.is_same_process(handle.pid, handle.pid_start)
        if handle.kind in ("docker", "slurm") and service.launcher == handle.kind:
            try:
                return docker().alive(handle)  # squeue for a Slurm job
            except GpuctlError:
                return None
        return None  # jupyter: asking costs a websocket round trip; the keywords tell

    return check


def on_node(service: ServiceConfig, host: HostConfig, url: str | None) -> str | None:
    """``url`` with ``{node}`` replaced by the node the service's Slurm job runs on; None
    while no job of it runs (nothing answers there). Any other URL comes back as it is.

    Raises:
        LauncherError: Slurm cannot be asked.
    """
    if url is None or "{node}" not in url or service.launcher != "slurm" or host.slurm is None:
        return url
    from gpuctl.adapters.launchers.slurm import SlurmLauncher

    node = SlurmLauncher(host.slurm, log_dir=default_state_dir() / "logs").node_of(service.name)
    return None if node is None else url.replace("{node}", node)
