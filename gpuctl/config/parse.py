"""Validate parsed TOML into the config's values (``gpuctl.config.values``), naming the
location of every error.

Each table declares its keys (``Table`` refuses unknown ones before anything else is
looked at): a typo (``[host.dgx]``, ``hots = "dgx"``) is reported as the typo, with a
"did you mean", not as the missing key it hides. Then every value is checked for what
its user will do with it: names the store accepts, URLs that parse (with a host where
one is needed), sizes and durations that are finite and positive, Docker and Jupyter
fields the launchers would otherwise refuse only at launch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpuctl.config.docker_fields import container_ref, ipc_mode, ports, shm_size, volumes
from gpuctl.config.priority_fields import yield_after
from gpuctl.config.proxy_fields import check_models, max_concurrent, models, parse_proxy
from gpuctl.config.slurm_fields import NODE, check_slurm_service, node_url, parse_slurm
from gpuctl.config.table import ENV_NAME, Table, check_url, key_text, show, tname
from gpuctl.config.values import (
    DEFAULT_AGENT_TIMEOUT_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_PRIORITY,
    DEFAULT_STOP_TIMEOUT_S,
    DEFAULT_YIELD_AFTER_S,
    HOST_PLACEHOLDER,
    HOST_TEMPLATE_KEYS,
    LAUNCHERS,
    PROBES,
    SERVICE_KINDS,
    SLEEP_LEVELS,
    STOP_ACTIONS,
    Config,
    Defaults,
    HostConfig,
    ServiceConfig,
    host_address,
    known_hint,
)
from gpuctl.core.jobs import PREFIX as JOB_PREFIX
from gpuctl.core.jobs import PRIORITY_MAX, is_job
from gpuctl.core.names import NAME_RULE, is_service_name, is_valid_name
from gpuctl.core.pool import POOL_RECORD_PREFIX
from gpuctl.core.promise import MAX_DEVICE_INDEX
from gpuctl.errors import ConfigError

ROOT_KEYS = ("defaults", "hosts", "services", "proxy")
DEFAULTS_KEYS = ("idle_timeout", "yield_after", "health_timeout", "agent_timeout", "priority")
HOST_KEYS = (
    "agent",
    "token_env",
    "token_file",
    "read_token_env",
    "read_token_file",
    "jupyter",
    "jupyter_token_env",
    "jupyter_token_file",
    "docker",
    "ollama",
    "gpu_memory",
    "timeout",
    "probe",
    "sim_dir",
    "slurm",
)
SERVICE_KEYS = (
    "host",
    "hosts",
    "launcher",
    "image",
    "command",
    "health",
    "match",
    "memory",
    "priority",
    "idle_timeout",
    "yield_after",
    "health_timeout",
    "devices",
    "stop",
    "sleep_level",
    "metrics",
    "model",
    "cwd",
    "env",
    "log",
    "gpus",
    "ipc_mode",
    "shm_size",
    "volumes",
    "ports",
    "network",
    "stop_timeout",
    "terminal",
    "pid_mode",
    "models",
    "url",
    "max_concurrent",
    "queue_timeout",
    "preempt",
    "resume",
    "kind",
)
# Keys a user might put a secret under, and where the secret belongs instead.
_SECRET_KEYS = {
    "token": "token",
    "read_token": "read_token",
    "jupyter_token": "jupyter_token",
    "password": "token",
}

HTTP = ("http", "https")
DOCKER_SCHEMES = ("unix", "tcp", "ssh", "http", "https", "npipe")

MAX_PRIORITY = PRIORITY_MAX  # one range for services, jobs and waiters
# NVML indexes GPUs from 0; no machine has anywhere near this many.

_TERMINAL = re.compile(r"\w{1,100}", re.ASCII)
_IMAGE = re.compile(r"[^\s\x00-\x1f]+")


def parse_config(data: dict[str, Any], path: Path | None = None) -> Config:
    """Validate parsed TOML (``tomllib.loads``'s answer). Separate from loading so tests
    need no files.

    Raises:
        ConfigError: the first problem, with its location (``services.vllm.memory: …``).
    """
    base = path.parent if path else None
    root = Table("", data, ROOT_KEYS)

    d = Table("defaults", root.get("defaults") or {}, DEFAULTS_KEYS)
    defaults = Defaults(
        idle_timeout_s=d.timeout_or_never("idle_timeout", DEFAULT_IDLE_TIMEOUT_S),
        yield_after_s=d.timeout_or_never("yield_after", DEFAULT_YIELD_AFTER_S),
        health_timeout_s=d.duration("health_timeout", DEFAULT_HEALTH_TIMEOUT_S),
        agent_timeout_s=d.duration("agent_timeout", DEFAULT_AGENT_TIMEOUT_S),
        priority=d.int_("priority", DEFAULT_PRIORITY, -MAX_PRIORITY, MAX_PRIORITY),
    )

    hosts_table = root.get("hosts") or {}
    services_table = root.get("services") or {}
    for kind, table in (("hosts", hosts_table), ("services", services_table)):
        if not isinstance(table, dict):
            raise ConfigError(f"{kind}: expected a table of tables, got {tname(table)}")
    hosts = {name: _host(name, raw, defaults, base) for name, raw in hosts_table.items()}
    services: dict[str, ServiceConfig] = {}
    for name, raw in services_table.items():
        services[name] = _service(name, raw, defaults, hosts, path)
    check_models(services)
    proxy = parse_proxy(root.get("proxy"), base)
    return Config(
        path=path,
        defaults=defaults,
        hosts=hosts,
        services=services,
        proxy=proxy,
    )


def _check_name(kind: str, name: str) -> None:
    if not is_valid_name(name):
        raise ConfigError(f"{kind}.{key_text(name)}: a name may hold {NAME_RULE}")
    if kind == "services" and not is_service_name(name):
        raise ConfigError(
            f"{kind}.{key_text(name)}: a service name may not start with '_' "
            "(gpuctl's own store entries, such as _admission, are named so)",
            hint=f"rename it, e.g. {name.lstrip('_') or 'svc'}",
        )
    if kind == "services" and is_job(name):
        # `gpuctl run --name X` keeps its record as run.X: a service of that name would
        # share the job's record and lock, and a stop of one would reach the other.
        raise ConfigError(
            f"{kind}.{key_text(name)}: a service name may not start with {JOB_PREFIX!r} "
            "(the records of `gpuctl run` jobs are named so)",
            hint=f"rename it, e.g. {name[len(JOB_PREFIX) :] or 'svc'}",
        )


def _host(name: str, raw: Any, defaults: Defaults, base: Path | None) -> HostConfig:
    _check_name("hosts", name)
    if isinstance(raw, dict):
        for secret, instead in _SECRET_KEYS.items():
            if secret in raw:
                raise ConfigError(
                    f"hosts.{name}.{secret}: secrets do not belong in the config file",
                    hint=f"use {instead}_env or {instead}_file",
                )
    h = Table(f"hosts.{name}", raw, HOST_KEYS)
    pairs = {}
    for what in ("token", "read_token", "jupyter_token"):
        env = h.pattern(f"{what}_env", ENV_NAME, "an environment variable name")
        file = h.path(f"{what}_file", base)
        if env and file:
            raise ConfigError(f"hosts.{name}: set {what}_env or {what}_file, not both")
        pairs[what] = (env, file)
    return HostConfig(
        name=name,
        agent=h.url("agent", HTTP),
        token_env=pairs["token"][0],
        token_file=pairs["token"][1],
        read_token_env=pairs["read_token"][0],
        read_token_file=pairs["read_token"][1],
        jupyter=h.url("jupyter", HTTP),
        jupyter_token_env=pairs["jupyter_token"][0],
        jupyter_token_file=pairs["jupyter_token"][1],
        docker=h.url("docker", DOCKER_SCHEMES),
        ollama=h.url("ollama", HTTP),
        gpu_memory_mib=h.size("gpu_memory"),
        timeout_s=h.duration("timeout", defaults.agent_timeout_s),
        probe=h.choice("probe", PROBES, "auto") or "auto",
        sim_dir=h.path("sim_dir", base),
        slurm=parse_slurm(f"hosts.{name}.slurm", h.get("slurm")),
    )


def _service(
    name: str, raw: Any, defaults: Defaults, hosts: dict[str, HostConfig], path: Path | None
) -> ServiceConfig:
    _check_name("services", name)
    s = Table(f"services.{name}", raw, SERVICE_KEYS)
    pool = _pool(s, hosts, path)
    host = pool[0]
    stop = s.choice("stop", STOP_ACTIONS, "stop") or "stop"
    kind = s.choice("kind", SERVICE_KINDS, "server") or "server"
    sleep_level = _sleep_level(s)
    if sleep_level is not None and stop != "sleep":
        raise s.fail("sleep_level", 'only with stop = "sleep"', hint='add stop = "sleep"')
    launcher = s.choice("launcher", LAUNCHERS, None)
    templates = host_templates(s, launcher)
    svc = ServiceConfig(
        name=name,
        host=host,
        launcher=launcher,
        image=s.pattern("image", _IMAGE, "an image name like 'vllm/vllm-openai:latest'"),
        command=s.str_("command"),
        health=_url_on(s, "health", launcher, templates, hosts[host]),
        match=_match(s),
        memory_mib=s.size("memory"),
        priority=s.int_("priority", defaults.priority, -MAX_PRIORITY, MAX_PRIORITY),
        idle_timeout_s=s.timeout_or_never("idle_timeout", defaults.idle_timeout_s),
        yield_after_s=yield_after(s, kind, defaults.yield_after_s),
        health_timeout_s=s.duration("health_timeout", defaults.health_timeout_s),
        devices=_devices(s),
        stop=stop,
        sleep_level=(sleep_level or 1) if stop == "sleep" else None,
        metrics=_url_on(s, "metrics", launcher, templates, hosts[host]),
        model=s.str_("model"),
        cwd=s.str_("cwd"),
        env=s.str_map("env"),
        log=s.str_("log"),
        gpus=s.bool_("gpus", True),
        ipc_mode=ipc_mode(s),
        shm_size=shm_size(s),
        volumes=volumes(s),
        ports=ports(s),
        network=container_ref(s, "network", ("host", "bridge", "none")),
        stop_timeout_s=s.duration("stop_timeout", DEFAULT_STOP_TIMEOUT_S),
        terminal=s.pattern("terminal", _TERMINAL, "a terminal name of letters, digits and '_'"),
        pid_mode=container_ref(s, "pid_mode", ("host",), containers_only=True),
        models=models(s),
        url=_url_on(s, "url", launcher, templates, hosts[host]),
        max_concurrent=max_concurrent(s),
        queue_timeout_s=(
            s.duration("queue_timeout", 0.0) if s.get("queue_timeout") is not None else None
        ),
        preempt=s.bool_("preempt", False),
        resume=s.bool_("resume", False),
        kind=kind,
        pool=pool,
        templates=templates,
    )
    # The pool's own rules first: a host's table a pool could never use (a slurm
    # service's [hosts.X.slurm]) is not worth asking for.
    _check_pool(svc, hosts)
    for h in pool:
        _check_service(svc.on(hosts[h]), hosts[h])
    if svc.resume and svc.launcher is None:
        # Only a service gpuctl starts can be brought back.
        raise s.fail("resume", "needs a launcher", hint="add launcher = ..., or drop resume")
    return svc


# A pool's record on its coordinator is ``_pool.<service>`` (``core.pool``): a valid
# store name, so a pooled service's name leaves room for the prefix.
_POOL_NAME_MAX = 101 - len(POOL_RECORD_PREFIX)


def _pool(s: Table, hosts: dict[str, HostConfig], path: Path | None) -> tuple[str, ...]:
    """``host = "x"`` (a pool of one) or ``hosts = ["x", "y"]``; neither: the one host
    configured."""
    one, many = s.get("host"), s.get("hosts")
    if one is not None and many is not None:
        raise s.fail(
            "hosts",
            "set host or hosts, not both",
            hint=f"hosts = [{show(one)}, ...] for a pool, or host = {show(one)} alone",
        )
    if many is not None:
        if (
            not isinstance(many, list)
            or not many
            or not all(isinstance(h, str) and h.strip() for h in many)
        ):
            raise s.fail(
                "hosts",
                f"expected a non-empty list of host names, got {show(many)}",
                hint='hosts = ["dgx1", "dgx2"]; or host = "dgx1" for one',
            )
        names = s.str_list("hosts")
        key = "hosts"
    else:
        single = s.str_("host")
        if single is None:
            if len(hosts) != 1:
                raise s.fail(
                    "host",
                    "missing" if hosts else "missing, and no [hosts] are configured",
                    hint="name the [hosts.X] table this service runs on (or hosts = [...])",
                )
            return (next(iter(hosts)),)
        names, key = (single,), "host"
    seen: set[str] = set()
    for h in names:
        if h not in hosts:
            raise s.fail(key, f"unknown host {h!r}", hint=known_hint("hosts", h, hosts, path))
        if h in seen:
            raise s.fail(key, f"host {h!r} is listed twice", hint="list each host once")
        seen.add(h)
    return tuple(names)


def host_templates(s: Table, launcher: str | None) -> dict[str, str]:
    """The URL keys written with ``{host}``, as written; any other ``{...}`` in a URL
    key is refused (only ``{node}``, in a Slurm service's ``health``, is another)."""
    out: dict[str, str] = {}
    for key in HOST_TEMPLATE_KEYS:
        v = s.get(key)
        if not isinstance(v, str):
            continue  # the getter names what is wrong with it
        for m in _PLACEHOLDER.finditer(v):
            word = m.group(0)
            if word == HOST_PLACEHOLDER or (word == NODE and key != "metrics"):
                continue  # node_url says where {node} works (health, with slurm)
            raise s.fail(
                key,
                f"unknown placeholder {word}: only {HOST_PLACEHOLDER} (the host it runs "
                f"on) works here"
                + (f", and {NODE} with the slurm launcher" if key == "health" else ""),
                hint=f"write {HOST_PLACEHOLDER}, or the host's name",
            )
        if HOST_PLACEHOLDER in v:
            if launcher == "slurm" and key == "health" and NODE in v:
                raise s.fail(
                    key,
                    f"name {HOST_PLACEHOLDER} or {NODE}, not both",
                    hint=f"a Slurm job's server runs on the node Slurm chose: {NODE}",
                )
            out[key] = v.strip()
    return out


_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


def _url_on(
    s: Table, key: str, launcher: str | None, templates: dict[str, str], host: HostConfig
) -> str | None:
    """A URL key: as written, or with ``{host}`` expanded for ``host``; checked as a
    URL either way."""
    if key not in templates:
        if key == "metrics":
            return s.url(key, HTTP)
        return node_url(s, key, HTTP, launcher)
    expanded = templates[key].replace(HOST_PLACEHOLDER, host_address(host))
    return check_url(s.loc(key), expanded, HTTP)


def _check_pool(svc: ServiceConfig, hosts: dict[str, HostConfig]) -> None:
    """What a pool of more than one host needs: every host reached through an agent
    (the pool's coordinator is chosen by the identity its agent reports), no launcher
    that places servers itself, and a name that leaves room for the pool's record."""
    if not svc.pooled:
        return
    where = f"services.{svc.name}"
    for h in svc.hosts:
        if not hosts[h].agent:
            raise ConfigError(
                f"{where}.hosts: host {h!r} has no agent; every host of a pool needs one",
                hint=f"set hosts.{h}.agent (run `gpuctl agent` there), or drop {h!r} from hosts",
            )
    if svc.launcher == "slurm":
        raise ConfigError(
            f"{where}.hosts: a slurm service runs on one host (Slurm places its jobs itself)",
            hint='use host = "NAME" with the cluster\'s login host',
        )
    if len(svc.name) > _POOL_NAME_MAX:
        raise ConfigError(
            f"{where}: a pooled service's name is at most {_POOL_NAME_MAX} characters",
            hint="shorten the name",
        )


def _match(s: Table) -> tuple[str, ...]:
    if s.get("match") == []:
        # An empty list reads like "match nothing" but left the service with no way to
        # be found by keyword: leave the key out for that, or name a keyword.
        raise s.fail(
            "match",
            "an empty list: name at least one keyword, or leave match out",
            hint='match = ["vllm"]',
        )
    words = s.str_list("match")
    for w in words:
        # The agent's ?match= is comma-separated: a comma would split the keyword.
        if "," in w:
            raise s.fail(
                "match",
                f"a keyword cannot contain ',', got {w!r}",
                hint='list them: match = ["a", "b"]',
            )
    return tuple(w.strip() for w in words)


def _devices(s: Table) -> tuple[int, ...] | None:
    v = s.get("devices")
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    ok = (
        isinstance(v, list)
        and v
        and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_DEVICE_INDEX for i in v
        )
    )
    if not ok:
        raise s.fail(
            "devices",
            f"expected a list of GPU indexes (0-{MAX_DEVICE_INDEX}), got {show(v)}",
            hint="e.g. devices = [0] or [0, 1]; leave it out for any one GPU",
        )
    if len(set(v)) != len(v):
        raise s.fail("devices", f"a GPU is listed twice: {v}")
    return tuple(v)


def _sleep_level(s: Table) -> int | None:
    v = s.get("sleep_level")
    if v is None:
        return None
    if isinstance(v, bool) or v not in SLEEP_LEVELS:
        raise s.fail("sleep_level", f"expected 1 or 2, got {show(v)}")
    return int(v)


def launcher_list() -> str:
    """Every launcher, for a hint: ``"docker", "jupyter", "process", "ollama", "slurm"``."""
    return ", ".join(f'"{name}"' for name in LAUNCHERS)


def _check_service(svc: ServiceConfig, host: HostConfig) -> None:
    where = f"services.{svc.name}"
    launcher = svc.launcher
    if launcher is None and (svc.command or svc.image):
        # Without a launcher nothing runs the command: `ensure` would only refuse later.
        key = "command" if svc.command else "image"
        raise ConfigError(
            f"{where}.{key}: set, but no launcher runs it",
            hint=f"add launcher = one of {launcher_list()}, or drop {key}",
        )
    if launcher == "docker" and not svc.image:
        raise ConfigError(f"{where}.image: missing (the docker launcher needs an image)")
    check_slurm_service(svc, host.slurm, host.name)
    if launcher in ("jupyter", "process") and not svc.command:
        raise ConfigError(f"{where}.command: missing (the {launcher} launcher needs a command)")
    if launcher == "jupyter" and not host.jupyter:
        raise ConfigError(
            f"{where}.launcher: 'jupyter' needs hosts.{host.name}.jupyter (the JupyterLab URL)"
        )
    if launcher == "ollama":
        if not svc.model:
            raise ConfigError(
                f"{where}.model: missing (the ollama launcher loads a model, e.g. 'qwen3:32b')"
            )
        if not host.ollama:
            raise ConfigError(
                f"{where}.launcher: 'ollama' needs hosts.{host.name}.ollama (e.g. http://127.0.0.1:11434)"
            )
        if svc.stop == "sleep":
            raise ConfigError(
                f"{where}.stop: 'sleep' is vLLM's sleep mode; an Ollama model is unloaded instead",
                hint='drop stop, or use stop = "stop"',
            )
    elif svc.model is not None:
        raise ConfigError(
            f"{where}.model: only the ollama launcher takes a model",
            hint='set launcher = "ollama", or put the model in command',
        )
    if (svc.models or svc.max_concurrent) and not (svc.url or svc.health or launcher == "ollama"):
        raise ConfigError(
            f"{where}.url: missing (the proxy forwards to url, else to the origin of health)",
            hint='add url = "http://127.0.0.1:8000" or a health URL',
        )
    if svc.stop == "sleep" and not svc.health:
        raise ConfigError(
            f"{where}.stop: 'sleep' needs health (sleep mode is asked at the server's origin)"
        )
    # Jupyter writes `export NAME=value` into a bash script; the other launchers hand
    # the environment over as a mapping, where only '=' cannot be in a name.
    for key in svc.env:
        if launcher == "jupyter" and not ENV_NAME.fullmatch(key):
            raise ConfigError(
                f"{where}.env.{key_text(key)}: not a shell variable name",
                hint="use letters, digits and '_' only, not starting with a digit",
            )
        if not key or "=" in key:
            raise ConfigError(f"{where}.env.{key_text(key)}: an environment name cannot hold '='")
