"""Build the real adapters for a flow: a service's store, agent and launcher; the hosts
``status`` and ``locks`` ask.

A host with an agent is reached through its agent by every entry point; a host
without one is this machine, with the store used directly (one store per host: the
records live on the GPU host, so every caller sees the same truth).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from gpuctl.adapters import health, procinfo, vllm
from gpuctl.adapters.launchers.ollama import OllamaLauncher, check_ollama
from gpuctl.adapters.local import local_snapshot
from gpuctl.adapters.machine import ThisMachine
from gpuctl.adapters.recorded_servers import find_servers, server_children, truth_reader
from gpuctl.adapters.store import Store, store_for
from gpuctl.adapters.store.agent import AgentStore
from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.config.paths import default_state_dir
from gpuctl.core.decision import Health
from gpuctl.core.jobs import JOB_GRACE_S, PREFIX, job_route, unreachable
from gpuctl.core.snapshot import HostIdentity, Snapshot
from gpuctl.errors import LauncherError, UsageError
from gpuctl.flows.deps import (
    Closers,
    EnsureDeps,
    HostDeps,
    LocalProbeOptions,
    LocksDeps,
    StatusDeps,
)
from gpuctl.flows.heal import heal, health_timeouts, repair_lines
from gpuctl.flows.ports import (
    ChildFinder,
    JobStopper,
    Launchers,
    Machine,
    Probe,
    ServerChecks,
    ServerFinder,
    SnapshotReader,
    Tell,
)
from gpuctl.flows.status import StatusReport, status
from gpuctl.wiring.launchers import handle_checker, launcher_for, on_node

if TYPE_CHECKING:
    import httpx

    from gpuctl.adapters.launchers.base import Launcher
    from gpuctl.core.heal import ServerTruth
    from gpuctl.core.record import Listing, Record
    from gpuctl.flows.deps import EnsureRequest
    from gpuctl.flows.ensure.pool import PoolDeps
    from gpuctl.flows.op_results import EnsureResult

LOCAL_HOST = "local"


class SharedHttp:
    """The one keep-alive httpx client of a command, made on first use (thread-safe).

    Agent calls, record calls and health checks all go through it: each client costs a
    connection pool, and a TLS context when an ``https://`` URL is asked (see
    ``http_clients.http_client``). Closed with the command's other clients.
    """

    def __init__(self, closers: list[Callable[[], None]]) -> None:
        self._closers = closers
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def __call__(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                from gpuctl.adapters.http_clients import http_client

                self._client = http_client()
                self._closers.append(self._client.close)
            return self._client


def snapshot_reader(
    host: HostConfig,
    closers: list[Callable[[], None]],
    http: SharedHttp,
    *,
    lazy: bool = False,
    fresh: bool = False,
) -> SnapshotReader:
    """How to read the host: ``read(match_keywords, recorded_server_pids)``.

    With ``lazy`` the agent's client (and its token) is made on the first read, so a
    missing token is that host's error (``status`` shows the host UNKNOWN), not the
    command's. ``fresh``: never the agent's cached reading (a local probe always reads).
    """
    if host.agent:
        from gpuctl.adapters.agent_client import AgentClient

        agent = host.agent
        made: list[AgentClient] = []

        def client() -> AgentClient:
            if not made:
                token = host.token()
                made.append(
                    AgentClient(
                        agent,
                        token,
                        timeout_s=host.timeout_s,
                        host_name=host.name,
                        client=http(),
                        read_token=None if token else host.read_token(),
                    )
                )
            return made[0]

        if not lazy:
            client()
        return lambda kws, pids: client().status(match=kws, pids=pids, fresh=fresh)

    state_dir = str(default_state_dir())

    def read(kws: Sequence[str], pids: Sequence[int]) -> Snapshot:
        return local_snapshot(
            host.probe,
            kws,
            sim_dir=host.sim_dir,
            gpu_memory_mib=host.gpu_memory_mib,
            pids=pids,
            state_dir=state_dir,
        )

    return read


def server_finder(host: HostConfig) -> ServerFinder | None:
    """The records' servers found on this machine, for a host read without an agent (the
    agent finds them on its own host)."""
    if host.agent:
        return None

    return find_servers


def child_finder(host: HostConfig) -> ChildFinder | None:
    """The processes the records' servers forked, for a host read without an agent (the
    agent names them in its ``/status``)."""
    if host.agent:
        return None

    return server_children


def deps_for(
    config: Config,
    service_name: str,
    host_name: str | None = None,
    *,
    tell: Tell | None = None,
) -> EnsureDeps:
    """The real ports for one service's use cases (``ensure``, ``stop``, ``touch``,
    ``resume``); ``tell``: where the person waiting hears of it.

    Raises ``UsageError`` for an unknown service, or a host that is not the service's.
    """
    # A pooled service placed on the host named (default: its first), {host} expanded.
    service = config.placed(service_name, host_name)
    host = config.host(service.host)

    closers: list[Callable[[], None]] = []
    # One keep-alive client for the whole wait (agent and health checks): a new client
    # per poll costs a connection each time, and 32 waiters polling 4 times a second
    # would burn the CPU.
    http = SharedHttp(closers)
    store = store_for(host, client=http() if host.agent else None)
    closers.append(store.close)
    made: list[Launcher] = []

    def make_launcher(snapshot: Snapshot | None) -> Launcher:
        # One launcher (and one Docker client) per use case, closed with the deps.
        if not made:
            launcher = launcher_for(service, host, snapshot, config)
            made.append(launcher)
            closers.append(launcher.close)
        return made[0]

    others = victim_launchers(config, host, closers)

    def launcher_of(svc: ServiceConfig, snapshot: Snapshot | None) -> Launcher:
        return make_launcher(snapshot) if svc.name == service.name else others(svc, snapshot)

    def server_in_flight(svc: ServiceConfig) -> int | None:
        return _server_in_flight(svc, http, config.host(svc.host))

    return EnsureDeps(
        closers,
        config=config,
        service=service,
        host=host,
        store=store,
        probe=Probe(
            snapshot_reader(host, closers, http),
            snapshot_reader(host, closers, http, fresh=True),
            find_servers=server_finder(host),
            find_children=child_finder(host),
        ),
        launchers=Launchers(
            make_launcher,
            launcher_of,
            handle_alive=handle_checker(service, host, lambda: make_launcher(None)),
            stop_job=run_job_stopper(store),
        ),
        servers=ServerChecks(
            _service_health(service, host, http, lambda: make_launcher(None)),
            in_flight=server_in_flight,
            wake=lambda url, level: _wake(url, level, http),
            # Pids are looked up only on a host without an agent (its store is on this
            # machine); with one, its agent heals on the host and only health speaks here.
            truth=truth_reader(on_host=not host.agent, client=http),
        ),
        machine=ThisMachine(),
        tell=tell or Tell(),
    )


def pool_deps_for(
    config: Config, service_name: str, *, tell: Tell | None = None, only: str | None = None
) -> PoolDeps:
    """One ``deps_for`` per host of a pooled service, in the config's order; closed
    together. ``only``: a start goes to that host of the pool alone."""
    from gpuctl.flows.ensure.pool import PoolDeps  # only a pooled ensure loads the flow

    service = config.service(service_name)
    if only is not None:
        config.placed(service_name, only)  # one of its hosts, else a usage error
    members = [deps_for(config, service_name, h, tell=tell) for h in service.hosts]
    pd = PoolDeps(members=members, only=only)
    pd.closers.extend(m.close for m in members)
    return pd


def ensure_runner(
    config: Config, service_name: str, host_name: str | None = None, *, tell: Tell | None = None
) -> tuple[Closers, Callable[[EnsureRequest], EnsureResult]]:
    """The deps of ``ensure`` for a service (closed by the caller), and the call that
    runs it: over its pool for a pooled service (``flows.ensure.pool``; ``host_name``
    keeps a start to that host), else on its host. Every entry point that may start a
    service (the CLI, the API, the proxy) goes through this one, so a pool's copy is
    started only under the pool's lease."""
    service = config.service(service_name)
    if service.pooled:
        from gpuctl.flows.ensure.pool import ensure_pool

        pool = pool_deps_for(config, service_name, tell=tell, only=host_name)
        return pool, lambda req: ensure_pool(pool, req)
    from gpuctl.flows.ensure.rounds import ensure

    one = deps_for(config, service_name, host_name, tell=tell)
    return one, lambda req: ensure(one, req)


def _service_health(
    service: ServiceConfig, host: HostConfig, http: SharedHttp, launcher: Callable[[], Launcher]
) -> Callable[[], Health]:
    """The service's health check: its ``health`` URL; for an Ollama model ``/api/ps``
    first (asked by its launcher, which also knows whether its own load is still
    running), since the daemon answers any URL of its own whether or not the model is
    loaded, then its ``health`` URL if it has one."""

    if service.launcher == "ollama":
        url = service.health

        def ollama() -> Health:
            lx = launcher()
            assert isinstance(lx, OllamaLauncher)
            loaded = lx.health()
            if not loaded.ok or url is None:
                return loaded
            return health.check(url, timeout_s=2.0, client=http())

        return ollama
    if service.stop == "sleep" and service.health:
        url = service.health

        def sleepy() -> Health:
            h = health.check(url, timeout_s=2.0, client=http())
            return health.check_sleeping(url, h, http())

        return sleepy
    if service.launcher == "slurm" and service.health and "{node}" in service.health:
        template = service.health

        def on_node() -> Health:
            # The node Slurm chose, asked each time: a requeued job may move.
            from gpuctl.adapters.launchers.slurm import SlurmLauncher

            lx = launcher()
            assert isinstance(lx, SlurmLauncher)
            try:
                node = lx.node_of(service.name)
            except LauncherError as e:
                return Health("error", f"cannot ask Slurm for its node: {e.message}")
            if node is None:
                return Health("refused", "no running Slurm job (queued, or none)")
            url = template.replace("{node}", node)
            return replace(health.check(url, timeout_s=2.0, client=http()), url=url)

        return on_node
    return lambda: health.check(service.health, timeout_s=2.0, client=http())


def _status_hosts(
    config: Config, host_names: Sequence[str] | None, local: LocalProbeOptions
) -> list[HostConfig]:
    if host_names:
        return [config.host(n) for n in host_names]
    if config.hosts:
        return list(config.hosts.values())
    return [
        HostConfig(
            name=LOCAL_HOST,
            probe=local.probe,
            sim_dir=local.sim_dir,
            gpu_memory_mib=local.gpu_memory_mib,
        )
    ]


def status_deps(
    config: Config,
    host_names: Sequence[str] | None = None,
    *,
    local: LocalProbeOptions | None = None,
    health_timeout_s: float = 2.0,
    notice: Callable[[str], None] | None = None,
) -> StatusDeps:
    """The hosts ``status`` asks (default: every configured host; with none, this machine).

    ``notice``: where a repair is said (``gpuctl.flows.heal``; the CLI's stderr). With
    it, ``status`` heals the records of a host without an agent before it reports them
    (its store is on this machine, so it may write there); a host with an agent is
    healed by its agent, whatever token ``status`` holds. Without it, status only reads.

    Raises ``UsageError`` for an unknown host name.
    """
    local = local or LocalProbeOptions()
    closers: list[Callable[[], None]] = []
    http = SharedHttp(closers)
    hosts: list[HostDeps] = []
    for configured in _status_hosts(config, host_names, local):
        h = configured
        if h.agent:
            source = h.agent
        else:
            probe = h.probe if local.probe == "auto" else local.probe
            source = f"local probe ({probe})"
            h = replace(
                h,
                probe=probe,
                sim_dir=local.sim_dir or h.sim_dir,
                gpu_memory_mib=h.gpu_memory_mib or local.gpu_memory_mib,
            )
        hosts.append(_host_deps(h, source, closers, http, notice=notice, config=config))
    return StatusDeps(
        closers,
        config=config,
        hosts=hosts,
        machine=ThisMachine(),
        server_in_flight=lambda svc: _server_in_flight(svc, http),
        check_health=lambda url, timeout_s: _check_health(url, timeout_s, http),
        check_ollama=lambda url, model, timeout_s, others: _check_ollama(
            url, model, timeout_s, others, http
        ),
        check_sleeping=lambda url, h, timeout_s: _check_sleeping(url, h, timeout_s, http),
        health_timeout_s=health_timeout_s,
    )


def _host_deps(
    h: HostConfig,
    source: str,
    closers: list[Callable[[], None]],
    http: SharedHttp,
    *,
    notice: Callable[[str], None] | None = None,
    config: Config | None = None,
) -> HostDeps:
    store = _host_store(h, closers, http)

    def listing() -> Listing:
        out = store().listing()
        if notice is None or h.agent:
            return out

        look = truth_reader(on_host=True, client=http)
        timeouts = health_timeouts(config) if config is not None else None
        repairs = heal(
            store(),
            out.records,
            look,
            "status",
            new_holder=ThisMachine().holder,
            abandoned_after=timeouts,
        )
        for line in repair_lines(h.name, repairs):
            notice(line)
        return store().listing() if repairs else out

    return HostDeps(
        h,
        source,
        listing,
        snapshot_reader(h, closers, http, lazy=True),
        server_finder(h),
        child_finder(h),
        read_inflight=lambda: store().inflight(),
        read_waiters=lambda: store().waiters(),
    )


def _host_store(
    host: HostConfig, closers: list[Callable[[], None]], http: SharedHttp
) -> Callable[[], Store]:
    """The host's store (its records, set-aside files and in-flight counts), through its
    agent (within the host's own timeout) or directly; opened on first use."""
    opened: list[Store] = []

    def store() -> Store:
        if not opened:
            opened.append(store_for(host, timeout_s=host.timeout_s, client=http()))
            closers.append(opened[0].close)
        return opened[0]

    return store


# (job's record name, lease holder id, pid, pid start time, grace) -> the agent stops it
# (``AgentStore.stop_job``); True when it had to be killed.
AgentJobStop = Callable[[str, str, int, float, float], bool]
# (the job's handle, its name without ``run.``) -> stops its CMD on this machine
# (``adapters.job_cmd.stop_job``); True when it had to be killed.
LocalJobStop = Callable[[dict[str, Any], str], bool]


def run_job_stopper(store: Store) -> JobStopper:
    """How a preempted ``gpuctl run`` job is stopped: from this machine when its CMD runs
    here, else through the host's agent (the store's ``stop_job``) when it runs there."""

    # Here, not at the top: ``status`` imports this module and never stops a job.
    from gpuctl.adapters.job_cmd import stop_job

    agent_stop = store.stop_job if isinstance(store, AgentStore) else None
    return job_stopper(procinfo.host_identity(), stop_job, agent_stop)


def job_stopper(
    here: HostIdentity, stop_here: LocalJobStop, agent_stop: AgentJobStop | None
) -> JobStopper:
    """Stop a run job where its CMD runs: from this machine (``stop_here``), or through the
    host's agent when CMD runs on the agent's machine (``agent_stop``; None: the host has
    no agent). The route is ``core.jobs.job_route``, the planner's own rule: a job neither
    can signal was never planned as a victim, and is refused here too."""

    def stop(name: str, handle: dict[str, Any], holder_id: str, snap: Snapshot | None) -> bool:
        agent = snap.host if snap is not None and agent_stop is not None else None
        route = job_route(handle, here, agent)
        if route == "here":
            return stop_here(handle, name.removeprefix(PREFIX))
        pid, start = handle.get("pid"), handle.get("pid_start")
        if route == "agent" and agent_stop is not None:
            if not isinstance(pid, int) or not isinstance(start, int | float):
                raise LauncherError(f"the record of {name} names no pid and start time")
            return agent_stop(name, holder_id, pid, float(start), JOB_GRACE_S)
        raise LauncherError(
            f"cannot stop {name}: {unreachable(handle, here, agent)}",
            hint="run the preempting command where the job runs",
        )

    return stop


def this_machine() -> Machine:
    """This machine and process, as the flows' ``Machine`` port."""
    return ThisMachine()


def victim_launchers(
    config: Config, host: HostConfig, closers: list[Callable[[], None]]
) -> Callable[[ServiceConfig, Snapshot | None], Launcher]:
    """(a victim service, snapshot) -> its launcher, made once each, closed with the deps."""
    made: dict[str, Launcher] = {}

    def launcher_of(svc: ServiceConfig, snapshot: Snapshot | None) -> Launcher:
        if svc.name not in made:
            made[svc.name] = launcher_for(svc, host, snapshot, config)
            closers.append(made[svc.name].close)
        return made[svc.name]

    return launcher_of


def server_in_flight_reader(http: SharedHttp) -> Callable[[ServiceConfig], int | None]:
    """(a service) -> its server's requests in flight (vLLM's /metrics); None: none to read."""
    return lambda svc: _server_in_flight(svc, http)


def _server_in_flight(
    svc: ServiceConfig, http: SharedHttp, host: HostConfig | None = None
) -> int | None:
    """A running service's requests in flight from its server's metrics (vLLM's
    ``/metrics``; a Slurm job's ``{node}`` expanded when ``host`` is given); None where it
    has none. Raises GpuctlError when they cannot be read."""

    url = vllm.metrics_url(svc.health, svc.metrics)
    if host is not None:
        url = on_node(svc, host, url)
    return vllm.in_flight(url, http()) if url else None


def _check_health(url: str, timeout_s: float, http: SharedHttp) -> Health:

    return health.check(url, timeout_s, client=http())


def _check_sleeping(url: str, h: Health, timeout_s: float, http: SharedHttp) -> Health:

    return health.check_sleeping(url, h, http(), timeout_s)


def _wake(health_url: str, level: int, http: SharedHttp) -> None:

    vllm.wake(vllm.origin(health_url), level, http())


def _check_ollama(
    url: str, model: str, timeout_s: float, others: frozenset[str] | None, http: SharedHttp
) -> Health:

    return check_ollama(url, model, timeout_s, http(), others)


def no_hosts(config: Config, what: str) -> UsageError:
    """The error of a command that needs a configured host where the config has none
    (often: no config file at all), naming the file and how to get one."""
    if config.path is None or not config.path.exists():
        where = f"at {config.path}" if config.path else "given"
        return UsageError(
            f"no config file {where}, so no host: {what}",
            hint="`gpuctl config init` writes one (or point --config / GPUCTL_CONFIG at yours)",
        )
    return UsageError(
        f"{config.path} configures no host: {what}",
        hint=f"add a [hosts.NAME] table to {config.path}",
    )


def locks_deps(config: Config, host_names: Sequence[str] | None = None) -> LocksDeps:
    """Every host's store (or the named hosts')."""
    if not config.hosts:
        # Silence here read as "no records" (exit 0) where nothing was looked at.
        raise no_hosts(config, "gpuctl locks lists the records each configured host keeps")
    hosts = [config.host(h) for h in host_names] if host_names else list(config.hosts.values())
    closers: list[Callable[[], None]] = []
    http = SharedHttp(closers)

    def store_of(h: HostConfig) -> Store:
        store = store_for(h, client=http() if h.agent else None)
        closers.append(store.close)
        return store

    def look_of(h: HostConfig) -> Callable[[Record], ServerTruth]:

        # As ensure: pids only where the store is on this machine (no agent).
        return truth_reader(on_host=not h.agent, client=http)

    return LocksDeps(
        closers,
        config=config,
        hosts=hosts,
        store_of=store_of,
        machine=ThisMachine(),
        look_of=look_of,
    )


def gather_status(
    config: Config,
    host_names: Sequence[str] | None = None,
    *,
    local: LocalProbeOptions | None = None,
    health_timeout_s: float = 2.0,
) -> StatusReport:
    """``status`` once with the real adapters, closed after (for callers without deps)."""
    deps = status_deps(config, host_names, local=local, health_timeout_s=health_timeout_s)
    try:
        return status(deps)
    finally:
        deps.close()
