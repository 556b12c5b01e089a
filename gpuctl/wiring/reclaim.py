"""Build the real adapters for ``gpuctl reclaim``: per host its store, its snapshot, the
servers' in-flight metrics, launchers and vLLM's sleep (one HTTP client for all)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuctl.adapters import vllm
from gpuctl.adapters.launchers.base import Launcher
from gpuctl.adapters.launchers.logfile import rotate_all
from gpuctl.adapters.machine import ThisMachine
from gpuctl.adapters.recorded_servers import truth_reader
from gpuctl.adapters.store import Store, store_for
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.config.paths import default_state_dir
from gpuctl.core.snapshot import Snapshot
from gpuctl.errors import ConfigError
from gpuctl.flows.reclaim import ReclaimDeps, ReclaimHost
from gpuctl.flows.resume import Resumed, resume_preempted, to_resume
from gpuctl.wiring.build import SharedHttp, deps_for, no_hosts, snapshot_reader
from gpuctl.wiring.launchers import launcher_for, on_node


def reclaim_deps(config: Config, host_names: Sequence[str] | None = None) -> ReclaimDeps:
    """Every configured host (or the named ones). Raises ``UsageError`` for an unknown one,
    and when no host is configured: silence would read as "nothing idle" (exit 0) where
    nothing was looked at."""
    if not config.hosts:
        raise no_hosts(config, "gpuctl reclaim stops what is idle on each configured host")

    hosts = [config.host(n) for n in host_names] if host_names else list(config.hosts.values())
    closers: list[Callable[[], None]] = []
    http = SharedHttp(closers)
    return ReclaimDeps(
        closers,
        config=config,
        hosts=[_host(config, h, closers, http) for h in hosts],
        machine=ThisMachine(),
        rotate_logs=_rotate_logs,
        resume=lambda host, store, dry_run: _resume(config, host, store, dry_run),
    )


def _resume(config: Config, host: HostConfig, store: Store, dry_run: bool) -> list[Resumed]:

    due = to_resume(config, host.name, store)
    if dry_run:
        return [Resumed(s.name, would=True) for s in due]
    return resume_preempted(due, lambda s: deps_for(config, s.name), "reclaim")


def _rotate_logs() -> list[str]:

    return rotate_all(default_state_dir() / "logs")


def _host(
    config: Config, host: HostConfig, closers: list[Callable[[], None]], http: SharedHttp
) -> ReclaimHost:

    store = store_for(host)
    closers.append(store.close)
    launchers: dict[str, Launcher] = {}

    def make_launcher(svc: ServiceConfig, snap: Snapshot | None) -> Launcher:
        if svc.name not in launchers:
            launchers[svc.name] = launcher_for(svc, host, snap, config)
            closers.append(launchers[svc.name].close)
        return launchers[svc.name]

    def server_in_flight(svc: ServiceConfig) -> int | None:
        url = on_node(svc, host, vllm.metrics_url(svc.health, svc.metrics))
        return vllm.in_flight(url, http()) if url else None

    def sleep_server(svc: ServiceConfig) -> None:
        if not svc.health:
            raise ConfigError(
                f'services.{svc.name}.stop = "sleep" needs services.{svc.name}.health '
                "(vLLM's sleep endpoints are at its origin)"
            )
        vllm.sleep(vllm.origin(svc.health), svc.sleep_level or 1, http())

    return ReclaimHost(
        host=host,
        store=store,
        read_snapshot=snapshot_reader(host, closers, http),
        server_in_flight=server_in_flight,
        make_launcher=make_launcher,
        sleep_server=sleep_server,
        # Pids are looked up only on a host without an agent (its store is on this
        # machine); with one, the agent heals on its host and health alone speaks here.
        look=truth_reader(on_host=not host.agent, client=http),
    )
