"""The configuration as frozen Structs: what the rest of gpuctl reads.

Values here are already validated and converted (sizes in MiB, durations in seconds);
``parse`` builds them, ``load`` finds the file. Secrets are not values: a host names
where its tokens live, and ``secrets`` reads them when a request needs one.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgspec
from msgspec.structs import replace

from gpuctl.config.secrets import read_key_list, read_secret
from gpuctl.core.conn_limits import ConnectionLimits
from gpuctl.core.promise import Promise
from gpuctl.errors import ConfigError, UsageError


class ProbeName(StrEnum):
    """How a host without an agent (or the agent itself) reads the GPU.

    The one list of probe names: the config's ``probe``, ``gpuctl agent --probe``,
    ``gpuctl status --probe`` and the shell completions all take their choices from it.
    """

    auto = "auto"
    nvml = "nvml"
    nvidia_smi = "nvidia-smi"
    sim = "sim"


PROBES: tuple[str, ...] = tuple(p.value for p in ProbeName)
LAUNCHERS = ("docker", "jupyter", "process", "ollama", "slurm")
STOP_ACTIONS = ("stop", "sleep")
# A server answers requests; a batch works through its items and may be preempted and
# resumed (``resume = true``) without losing them.
SERVICE_KINDS = ("server", "batch")
SLEEP_LEVELS = (1, 2)

DEFAULT_IDLE_TIMEOUT_S = 30 * 60.0
# A server unused this long yields to any start or job that asks to preempt, whatever the
# priorities. 10 minutes: a chat's pauses between messages (reading, typing, a coffee)
# are minutes, so it is not torn down mid-conversation; and a third of the 30-minute
# idle timeout, so work that needs the memory waits 10 minutes at most, not 30. The
# price is the server's next cold start (5-6 minutes for vLLM on a DGX Spark).
DEFAULT_YIELD_AFTER_S = 10 * 60.0
# vLLM cold starts take 5-6 minutes on a DGX Spark; a 120 s timeout fails every one of them.
DEFAULT_HEALTH_TIMEOUT_S = 10 * 60.0
DEFAULT_AGENT_TIMEOUT_S = 3.0
DEFAULT_STOP_TIMEOUT_S = 30.0
DEFAULT_PRIORITY = 50
DEFAULT_PROXY_LISTEN = "127.0.0.1:9401"
# Whisper's uploads: OpenAI caps audio at 25 MB; leave room for the multipart framing.
DEFAULT_PROXY_MAX_BODY_MIB = 32
DEFAULT_PROXY_SSE_INTERVAL_S = 10.0
DEFAULT_PROXY_RETRY_AFTER_S = 30.0
# Where a service's URL names the host it runs on (``health``, ``url``, ``metrics``).
HOST_PLACEHOLDER = "{host}"
# The URL keys that may hold ``{host}``.
HOST_TEMPLATE_KEYS = ("health", "url", "metrics")


class Defaults(msgspec.Struct, frozen=True):
    """``[defaults]``. ``idle_timeout_s`` is None for ``idle_timeout = "never"``, and
    ``yield_after_s`` for ``yield_after = "never"``."""

    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    yield_after_s: float | None = DEFAULT_YIELD_AFTER_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    priority: int = DEFAULT_PRIORITY


class SlurmConfig(msgspec.Struct, frozen=True):
    """``[hosts.NAME.slurm]``: how the ``slurm`` launcher submits a host's servers.

    The host is the cluster (its login node, where ``sbatch`` answers); the node a job
    runs on is Slurm's choice. ``gpus`` is each job's GRES request (``--gres gpu:N``);
    ``time_limit_s`` its ``--time`` (None: the partition's default); ``nice`` and ``qos``
    its priority within Slurm, which alone decides who runs first and who is preempted.
    ``sbatch``/``squeue``/``scancel`` are the commands (default: found on PATH).
    """

    partition: str | None = None
    account: str | None = None
    time_limit_s: float | None = None
    gpus: int = 1
    nice: int | None = None
    qos: str | None = None
    sbatch: str = "sbatch"
    squeue: str = "squeue"
    scancel: str = "scancel"


class HostConfig(msgspec.Struct, frozen=True):
    """One GPU host. Without ``agent`` it is this machine, probed and stored directly.

    The agent token (``token_env`` / ``token_file``) may write: leases, records, stop.
    The read token (``read_token_env`` / ``read_token_file``) is good for GETs only
    (``/status``, ``/records``, ``/metrics``); a client that has no write token uses it.
    """

    name: str
    agent: str | None = None
    token_env: str | None = None
    token_file: Path | None = None
    read_token_env: str | None = None
    read_token_file: Path | None = None
    jupyter: str | None = None
    jupyter_token_env: str | None = None
    jupyter_token_file: Path | None = None
    docker: str | None = None
    ollama: str | None = None
    gpu_memory_mib: int | None = None
    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    probe: str = ProbeName.auto.value
    sim_dir: Path | None = None
    slurm: SlurmConfig | None = None

    def token(self) -> str | None:
        """The agent (write) token from ``token_env`` or ``token_file``; None when neither is set.

        Raises:
            ConfigError: the variable is unset/empty, or the file cannot be read.
        """
        return read_secret(self.name, "token", self.token_env, self.token_file)

    def read_token(self) -> str | None:
        """The read-only token from ``read_token_env`` / ``read_token_file``; None when unset.

        Raises:
            ConfigError: the variable is unset/empty, or the file cannot be read.
        """
        return read_secret(self.name, "read_token", self.read_token_env, self.read_token_file)

    def token_for_reads(self) -> str | None:
        """The token a GET should carry: the write token when one is configured, else the
        read-only one, else None.

        Raises:
            ConfigError: the configured source cannot be read.
        """
        if self.token_env or self.token_file:
            return self.token()
        return self.read_token()

    def jupyter_token(self) -> str | None:
        """The Jupyter server's token from ``jupyter_token_env`` / ``jupyter_token_file``."""
        return read_secret(
            self.name, "jupyter_token", self.jupyter_token_env, self.jupyter_token_file
        )

    def secret_problems(self) -> list[ConfigError]:
        """Every secret this host names that cannot be read now (``gpuctl config check``)."""
        problems: list[ConfigError] = []
        for read in (self.token, self.read_token, self.jupyter_token):
            try:
                read()
            except ConfigError as e:
                problems.append(e)
        return problems


class ServiceConfig(msgspec.Struct, frozen=True):
    """One managed model server (or batch job).

    ``devices`` are the GPU indexes the service may use (None: any one GPU); ``gpus`` is
    only the Docker GPU request. ``idle_timeout_s`` is None for ``idle_timeout = "never"``.
    ``yield_after_s``: unused this long, it is a victim for any start or job that asks to
    preempt, whatever the priorities (None: ``"never"``, and always for a batch, which
    answers no requests and so would look idle while it works).
    ``stop`` says how reclaim frees its memory: the launcher's stop, or vLLM sleep mode at
    ``sleep_level``. ``metrics`` overrides where the in-flight requests are read (default:
    ``/metrics`` at the origin of ``health``). ``model`` is the Ollama model name.
    """

    name: str
    host: str
    launcher: str | None = None
    image: str | None = None
    command: str | None = None
    health: str | None = None
    match: tuple[str, ...] = ()
    memory_mib: int | None = None
    priority: int = DEFAULT_PRIORITY
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    yield_after_s: float | None = DEFAULT_YIELD_AFTER_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    devices: tuple[int, ...] | None = None
    stop: str = "stop"
    sleep_level: int | None = None
    metrics: str | None = None
    model: str | None = None
    # Launcher details (docs/reference/configuration.md, "Launcher keys").
    cwd: str | None = None
    env: Mapping[str, str] = msgspec.field(default_factory=dict)
    log: str | None = None
    gpus: bool = True
    ipc_mode: str | None = None
    shm_size: str | None = None
    volumes: tuple[str, ...] = ()
    ports: Mapping[str, int] = msgspec.field(default_factory=dict)
    network: str | None = None
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    terminal: str | None = None
    pid_mode: str | None = None
    # The proxy (``gpuctl proxy``): the model names it routes here, the upstream origin
    # (default: the origin of ``health``), requests at once (None: no limit), and how
    # long a request waits for a start (None: ``health_timeout_s``).
    models: tuple[str, ...] = ()
    url: str | None = None
    max_concurrent: int | None = None
    queue_timeout_s: float | None = None
    # Priorities: ``preempt`` lets ``ensure`` stop services of strictly lower
    # priority, and servers idle past their ``yield_after``, to make room (as
    # ``ensure --preempt``); ``resume`` brings a preempted one
    # back once it fits (reclaim, the end of ``gpuctl run``, ``gpuctl resume``).
    preempt: bool = False
    resume: bool = False
    kind: str = "server"
    # The pool (``hosts = [...]``): every host it may run on, in the config's order;
    # ``host`` is the first. Empty for a service built in code: a pool of ``host`` alone.
    pool: tuple[str, ...] = ()
    # The URL keys written with ``{host}`` (``health``, ``url``, ``metrics``), as
    # written: ``health`` and the rest hold them expanded for ``host``, and ``on`` for
    # each other host of the pool.
    templates: Mapping[str, str] = msgspec.field(default_factory=dict)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts it may run on: its pool, else ``host`` alone."""
        return self.pool or (self.host,)

    @property
    def pooled(self) -> bool:
        """Whether it is a pool of more than one host (``ensure`` picks among them)."""
        return len(self.hosts) > 1

    def on(self, host: HostConfig) -> ServiceConfig:
        """This service placed on ``host`` (one of its pool): ``host`` set, and every URL
        written with ``{host}`` expanded to that host's address (``host_address``)."""
        if host.name == self.host and not self.templates:
            return self
        address = host_address(host)

        def url(key: str, current: str | None) -> str | None:
            t = self.templates.get(key)
            return current if t is None else t.replace(HOST_PLACEHOLDER, address)

        return replace(
            self,
            host=host.name,
            health=url("health", self.health),
            url=url("url", self.url),
            metrics=url("metrics", self.metrics),
        )

    def promise(self) -> Promise:
        """What a start of this service promises the host (``core.promise.Promise``),
        written into its record with the start's lease. The promise's fields are named
        as this config's, so each is read (and taken back) by its name."""
        return Promise(**{name: getattr(self, name) for name in Promise.__struct_fields__})

    def with_promise(self, p: Promise) -> ServiceConfig:
        """This service with the figures a record's promise gives (``core.promised_specs``)."""
        return replace(self, **{name: getattr(p, name) for name in Promise.__struct_fields__})

    @property
    def health_means_ready(self) -> bool:
        """Whether its health URL answering 200 means it is ready to serve: not for an
        Ollama model (the daemon answers whether or not the model is loaded: ``/api/ps``
        tells), nor for a vLLM in sleep mode (it answers ``/health`` asleep). Callers
        that skip the ensure flow on a 200 (``gpuctl.api``, the proxy) ask this."""
        return bool(self.health) and self.stop != "sleep" and self.launcher != "ollama"

    @property
    def keywords(self) -> tuple[str, ...]:
        """What marks a host process as this service's: its match keywords, else its name.

        An Ollama model has no process of its own (Ollama's runners carry no model name,
        and the daemon serves every model): only explicit ``match`` keywords, else none,
        so a service called "ollama" never takes the daemon for itself loading.
        """
        if self.launcher == "ollama":
            return self.match
        return self.match or (self.name,)

    @property
    def default_match(self) -> bool:
        """No ``match`` set: the keyword is the name, counted only as a whole word of a
        command line (``gpuctl.core.ownership.names``), never inside a path or a URL."""
        return not self.match


class ProxyConfig(msgspec.Struct, frozen=True):
    """``[proxy]``: how ``gpuctl proxy`` listens and answers.

    Client keys are not values: ``api_keys_file`` (one key a line) or ``api_keys_env``
    (keys separated by commas or spaces) say where they live, read by ``api_keys()``.
    """

    listen: str = DEFAULT_PROXY_LISTEN
    api_keys_file: Path | None = None
    api_keys_env: str | None = None
    max_body_mib: int = DEFAULT_PROXY_MAX_BODY_MIB
    sse_keepalive: bool = True
    sse_interval_s: float = DEFAULT_PROXY_SSE_INTERVAL_S
    retry_after_s: float = DEFAULT_PROXY_RETRY_AFTER_S
    access_log: bool = True
    connections: ConnectionLimits = msgspec.field(default_factory=ConnectionLimits)

    def api_keys(self) -> tuple[str, ...]:
        """The client keys (empty: none configured).

        Raises:
            ConfigError: the variable is unset or empty, or the file cannot be read or
                holds no key.
        """
        return read_key_list(self.api_keys_env, self.api_keys_file)


class Config(msgspec.Struct, frozen=True):
    """The whole configuration. ``warnings`` are what the loader noticed but accepted
    (a token file others can read); commands print them on stderr."""

    path: Path | None
    defaults: Defaults = msgspec.field(default_factory=Defaults)
    hosts: Mapping[str, HostConfig] = msgspec.field(default_factory=dict)
    services: Mapping[str, ServiceConfig] = msgspec.field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)

    def host(self, name: str) -> HostConfig:
        """The host called ``name``.

        Raises:
            UsageError: no such host (with a did-you-mean).
        """
        try:
            return self.hosts[name]
        except KeyError:
            raise UsageError(
                f"unknown host {name!r}",
                hint=known_hint("hosts", name, self.hosts, self.path),
            ) from None

    def service(self, name: str) -> ServiceConfig:
        """The service called ``name``.

        Raises:
            UsageError: no such service (with a did-you-mean).
        """
        try:
            return self.services[name]
        except KeyError:
            raise UsageError(
                f"unknown service {name!r}",
                hint=known_hint("services", name, self.services, self.path),
            ) from None

    def services_on(self, host: str) -> list[ServiceConfig]:
        """The services that may run on ``host``, each placed there (``ServiceConfig.on``):
        a pooled service is on every host of its pool."""
        h = self.hosts.get(host)
        if h is None:
            return [s for s in self.services.values() if s.host == host]
        return [s.on(h) for s in self.services.values() if host in s.hosts]

    def pools(self) -> dict[str, tuple[str, ...]]:
        """Each pooled service's hosts, in its pool's order (the views group its rows by
        them); a service on one host is in none."""
        return {s.name: s.hosts for s in self.services.values() if s.pooled}

    def placed(self, name: str, host: str | None = None) -> ServiceConfig:
        """The service called ``name`` on ``host`` (default: its first host).

        Raises:
            UsageError: no such service, or ``host`` is not one of its hosts.
        """
        svc = self.service(name)
        if host is None or host == svc.host:
            return svc
        self.host(host)  # an unknown host is a usage error before anything else
        if host not in svc.hosts:
            where = ", ".join(svc.hosts)
            raise UsageError(
                f"service {name!r} runs on host {where!r}, not {host!r}"
                if len(svc.hosts) == 1
                else f"service {name!r} runs on the hosts {where}, not {host!r}",
                hint=f"drop --host, or use --host {svc.host}",
            )
        return svc.on(self.hosts[host])


def host_address(host: HostConfig) -> str:
    """What ``{host}`` expands to for ``host``: the host part of its ``agent`` URL
    (bracketed for IPv6), or ``127.0.0.1`` for this machine (a host without an agent)."""
    if not host.agent:
        return "127.0.0.1"
    from urllib.parse import urlsplit

    name = urlsplit(host.agent).hostname or "127.0.0.1"
    return f"[{name}]" if ":" in name else name


def known_hint(kind: str, name: str, table: Mapping[str, Any], path: Path | None) -> str:
    """A hint for an unknown name: the closest known one, else the known ones, else how to add it."""
    import difflib  # only for a message

    close = difflib.get_close_matches(name, list(table), n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    if table:
        return f"known {kind}: {', '.join(sorted(table))}"
    where = str(path) if path else "the config file"
    return f"no {kind} are configured; add [{kind}.{name}] to {where}"
