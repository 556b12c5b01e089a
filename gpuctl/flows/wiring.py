"""Build the real adapters for a service: its store path, its agent, its launcher.

A host with an agent is reached through its agent by every entry point; a host
without one is this machine, with the store used directly (DESIGN §3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from gpuctl.adapters.launchers.base import Handle, Launcher
from gpuctl.adapters.store import store_for
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.model import Snapshot
from gpuctl.core.record import Record
from gpuctl.errors import GpuctlError, LauncherError, UsageError
from gpuctl.flows.ensure import EnsureDeps, Progress


def snapshot_reader(
    host: HostConfig, closers: list[Callable[[], None]] | None = None
) -> Callable[[Sequence[str], Sequence[int]], Snapshot]:
    """How to read the host: ``read(match_keywords, recorded_server_pids)``."""
    if host.agent:
        from gpuctl.adapters.agent_client import AgentClient

        client = AgentClient(
            host.agent, host.token(), timeout_s=host.timeout_s, host_name=host.name
        )
        if closers is not None:
            closers.append(client.close)
        return lambda kws, pids: client.status(match=kws, pids=pids)

    from gpuctl.adapters.local import local_snapshot
    from gpuctl.adapters.paths import default_state_dir

    state_dir = str(default_state_dir())

    def read(kws: Sequence[str], pids: Sequence[int]) -> Snapshot:
        from dataclasses import replace

        snap = local_snapshot(
            host.probe, kws, sim_dir=host.sim_dir, gpu_memory_mib=host.gpu_memory_mib, pids=pids
        )
        return replace(snap, state_dir=state_dir)

    return read


def launcher_for(service: ServiceConfig, host: HostConfig, snapshot: Snapshot | None) -> Launcher:
    kind = service.launcher
    if kind is None:
        raise UsageError(
            f"service {service.name!r} has no launcher, so gpuctl cannot start it",
            hint=f"set services.{service.name}.launcher to docker, jupyter or process",
        )
    if kind == "process":
        from gpuctl.adapters import procinfo
        from gpuctl.adapters.launchers.process import ProcessLauncher
        from gpuctl.adapters.paths import default_state_dir

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
        return ProcessLauncher(log_dir=state_dir / "logs")
    if kind == "docker":
        from gpuctl.adapters.launchers.docker import DockerLauncher

        return DockerLauncher(host.docker)
    from gpuctl.adapters.launchers.jupyter import JupyterLauncher

    assert host.jupyter is not None
    return JupyterLauncher(host.jupyter, host.jupyter_token(), host_name=host.name)


def handle_checker(
    service: ServiceConfig, host: HostConfig, docker: Callable[[], Launcher]
) -> Callable[[Record], bool | None]:
    """How to tell whether the server a record points to still runs, where that is cheap."""

    def check(record: Record) -> bool | None:
        if not record.handle:
            return None
        handle = Handle.from_dict(record.handle)
        if handle.kind == "process" and handle.pid and not host.agent:
            from gpuctl.adapters import procinfo

            return procinfo.is_same_process(handle.pid, handle.pid_start)
        if handle.kind == "docker" and service.launcher == "docker":
            try:
                return docker().alive(handle)
            except GpuctlError:
                return None
        return None  # jupyter: asking costs a websocket round trip; the keywords tell

    return check


def deps_for(
    config: Config,
    service_name: str,
    host_name: str | None = None,
    *,
    entry: str = "ensure",
    progress: Callable[[Progress], None] | None = None,
) -> EnsureDeps:
    service = config.service(service_name)
    if host_name is not None and host_name != service.host:
        config.host(host_name)  # an unknown host is a usage error before anything else
        raise UsageError(
            f"service {service_name!r} runs on host {service.host!r}, not {host_name!r}",
            hint=f"drop --host, or use --host {service.host}",
        )
    host = config.host(service.host)

    import httpx

    from gpuctl.adapters import health

    closers: list[Callable[[], None]] = []
    # One keep-alive client for the whole wait: a new client per poll costs a TLS
    # context each time, and 32 waiters polling 4 times a second would burn the CPU.
    health_client = httpx.Client(timeout=2.0)
    closers.append(health_client.close)
    store = store_for(host)
    close_store = getattr(store, "close", None)
    if close_store is not None:
        closers.append(close_store)
    made: list[Launcher] = []

    def make_launcher(snapshot: Snapshot | None) -> Launcher:
        # One launcher (and one Docker client) per use case, closed with the deps.
        if not made:
            launcher = launcher_for(service, host, snapshot)
            made.append(launcher)
            close = getattr(launcher, "close", None)
            if close is not None:
                closers.append(close)
        return made[0]

    return EnsureDeps(
        config=config,
        service=service,
        host=host,
        store=store,
        closers=closers,
        read_snapshot=snapshot_reader(host, closers),
        check_health=lambda: health.check(service.health, timeout_s=2.0, client=health_client),
        make_launcher=make_launcher,
        handle_alive=handle_checker(service, host, lambda: make_launcher(None)),
        progress=progress,
        entry=entry,
    )
