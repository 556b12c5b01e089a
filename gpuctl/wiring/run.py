"""The real adapters for ``gpuctl run`` (``gpuctl.flows.run``): the host's store, its
fresh readings, and what a preemption needs (victims' launchers, their requests in
flight, the run-job stopper), as ``gpuctl.wiring.build`` builds them for ``ensure``."""

from __future__ import annotations

from collections.abc import Callable

from gpuctl.adapters.job_cmd import spawn_job
from gpuctl.adapters.machine import ThisMachine
from gpuctl.adapters.store import store_for
from gpuctl.config import Config
from gpuctl.errors import UsageError
from gpuctl.flows.resume import resume_preempted, to_resume
from gpuctl.flows.run.job import RunDeps
from gpuctl.wiring.build import (
    SharedHttp,
    deps_for,
    no_hosts,
    run_job_stopper,
    server_in_flight_reader,
    snapshot_reader,
    victim_launchers,
)


def run_deps(config: Config, host_name: str | None, tell: Callable[[str], None]) -> RunDeps:
    """The real adapters for ``gpuctl run`` on ``host_name`` (default: the only host).

    Raises:
        UsageError: no such host, or several and none named.
    """

    if host_name is None:
        if not config.hosts:
            raise no_hosts(config, "gpuctl run admits its job on a configured host")
        if len(config.hosts) != 1:
            raise UsageError(
                "gpuctl run needs --host when the config has several hosts",
                hint=f"known hosts: {', '.join(sorted(config.hosts)) or 'none'}",
            )
        host_name = next(iter(config.hosts))
    host = config.host(host_name)
    closers: list[Callable[[], None]] = []
    http = SharedHttp(closers)
    store = store_for(host, client=http() if host.agent else None)
    closers.append(store.close)

    def resume() -> list[str]:

        due = to_resume(config, host.name, store)
        done = resume_preempted(due, lambda s: deps_for(config, s.name), "run")
        return [r.service for r in done if r.started]

    return RunDeps(
        closers,
        config=config,
        host=host,
        store=store,
        read_snapshot=snapshot_reader(host, closers, http, fresh=True),
        machine=ThisMachine(),
        spawn=spawn_job,
        resume=resume,
        tell=tell,
        launcher_for=victim_launchers(config, host, closers),
        server_in_flight=server_in_flight_reader(http),
        stop_job=run_job_stopper(store),
    )
