"""Load and validate the TOML configuration (DESIGN §6) into frozen dataclasses.

Everything is validated at load, and every error names its location
(``services.vllm.memory: expected a size like '80GiB' ...``). Secrets never live in
the file: a host names an environment variable (``token_env``) or a file
(``token_file``), read when a token is needed.

The key names are a contract; a rename needs a deprecation path.
"""

from __future__ import annotations

import difflib
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gpuctl.core.units import parse_duration_s, parse_size_mib
from gpuctl.errors import ConfigError, UsageError

LAUNCHERS = ("docker", "jupyter", "process")
PROBES = ("auto", "nvml", "nvidia-smi", "sim")

DEFAULT_IDLE_TIMEOUT_S = 30 * 60.0
# vLLM cold starts take 5-6 minutes on a DGX Spark; a 120 s timeout fails every one of them.
DEFAULT_HEALTH_TIMEOUT_S = 10 * 60.0
DEFAULT_AGENT_TIMEOUT_S = 3.0
DEFAULT_PRIORITY = 50


@dataclass(frozen=True, slots=True)
class Defaults:
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    priority: int = DEFAULT_PRIORITY


@dataclass(frozen=True, slots=True)
class HostConfig:
    """One GPU host. Without ``agent`` it is this machine, probed and stored directly."""

    name: str
    agent: str | None = None
    token_env: str | None = None
    token_file: Path | None = None
    jupyter: str | None = None
    jupyter_token_env: str | None = None
    jupyter_token_file: Path | None = None
    docker: str | None = None
    gpu_memory_mib: int | None = None
    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    probe: str = "auto"
    sim_dir: Path | None = None

    def token(self) -> str | None:
        """The agent token from ``token_env`` or ``token_file``; None when neither is set.

        Raises:
            ConfigError: the variable is unset/empty, or the file cannot be read.
        """
        return _read_secret(self.name, "token", self.token_env, self.token_file)

    def jupyter_token(self) -> str | None:
        return _read_secret(
            self.name, "jupyter_token", self.jupyter_token_env, self.jupyter_token_file
        )


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """One managed model server (or batch job)."""

    name: str
    host: str
    launcher: str | None = None
    image: str | None = None
    command: str | None = None
    health: str | None = None
    match: tuple[str, ...] = ()
    memory_mib: int | None = None
    priority: int = DEFAULT_PRIORITY
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    # Launcher details (see README "Configuration").
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log: str | None = None
    gpus: bool = True
    ipc_mode: str | None = None
    shm_size: str | None = None
    volumes: tuple[str, ...] = ()
    ports: Mapping[str, int] = field(default_factory=dict)
    network: str | None = None
    stop_timeout_s: float = 30.0
    terminal: str | None = None
    pid_mode: str | None = None

    @property
    def keywords(self) -> tuple[str, ...]:
        """What marks a host process as this service's: its match keywords, else its name."""
        return self.match or (self.name,)


@dataclass(frozen=True, slots=True)
class Config:
    path: Path | None
    defaults: Defaults = field(default_factory=Defaults)
    hosts: Mapping[str, HostConfig] = field(default_factory=dict)
    services: Mapping[str, ServiceConfig] = field(default_factory=dict)

    def host(self, name: str) -> HostConfig:
        try:
            return self.hosts[name]
        except KeyError:
            raise UsageError(
                f"unknown host {name!r}",
                hint=_known("hosts", name, self.hosts, self.path),
            ) from None

    def service(self, name: str) -> ServiceConfig:
        try:
            return self.services[name]
        except KeyError:
            raise UsageError(
                f"unknown service {name!r}",
                hint=_known("services", name, self.services, self.path),
            ) from None

    def services_on(self, host: str) -> list[ServiceConfig]:
        return [s for s in self.services.values() if s.host == host]


def _known(kind: str, name: str, table: Mapping[str, Any], path: Path | None) -> str:
    close = difflib.get_close_matches(name, list(table), n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    if table:
        return f"known {kind}: {', '.join(sorted(table))}"
    where = str(path) if path else "the config file"
    return f"no {kind} are configured; add [{kind}.{name}] to {where}"


def _read_secret(host: str, what: str, env: str | None, file: Path | None) -> str | None:
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(
                f"hosts.{host}.{what}_env: environment variable {env} is not set",
                hint=f"export {env}=<token>, or use {what}_file",
            )
        return value
    if file:
        try:
            return file.read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"hosts.{host}.{what}_file: cannot read {file}: {e.strerror or e}",
                hint="create the file (mode 600) or fix the path",
            ) from None
    return None


def token_file_warning(path: Path) -> str | None:
    """A warning when a secret file is readable by group or others, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
    return None


# --------------------------------------------------------------------------- loading


class _Table:
    """A TOML table being validated: typed getters that name the location, and unknown keys."""

    def __init__(self, where: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table, got {_tname(data)}")
        self.where = where
        self.data: dict[str, Any] = data
        self.used: set[str] = set()

    def loc(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def str_(self, key: str) -> str | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(f"{self.loc(key)}: expected a non-empty string, got {v!r}")
        return v.strip()

    def url(self, key: str, schemes: tuple[str, ...]) -> str | None:
        v = self.str_(key)
        if v is None:
            return None
        u = urlparse(v)
        if u.scheme not in schemes or not (u.netloc or u.path):
            raise ConfigError(
                f"{self.loc(key)}: expected a URL starting with {' or '.join(s + '://' for s in schemes)}, got {v!r}"
            )
        return v.rstrip("/")

    def int_(self, key: str, default: int) -> int:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{self.loc(key)}: expected an integer, got {v!r}")
        return v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.loc(key)}: expected true or false, got {v!r}")
        return v

    def size(self, key: str) -> int | None:
        v = self.get(key)
        if v is None:
            return None
        try:
            return parse_size_mib(v)
        except ValueError as e:
            raise ConfigError(f"{self.loc(key)}: {e}") from None

    def duration(self, key: str, default: float) -> float:
        v = self.get(key)
        if v is None:
            return default
        try:
            return parse_duration_s(v)
        except ValueError as e:
            raise ConfigError(f"{self.loc(key)}: {e}") from None

    def path(self, key: str, base: Path | None) -> Path | None:
        v = self.str_(key)
        if v is None:
            return None
        p = Path(v).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        return p

    def str_list(self, key: str) -> tuple[str, ...]:
        v = self.get(key)
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise ConfigError(f"{self.loc(key)}: expected a list of strings, got {v!r}")
        return tuple(v)

    def str_map(self, key: str) -> dict[str, str]:
        v = self.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict) or not all(isinstance(x, str | int | float) for x in v.values()):
            raise ConfigError(f"{self.loc(key)}: expected a table of strings, got {v!r}")
        return {str(k): str(x) for k, x in v.items()}

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> str | None:
        v = self.str_(key)
        if v is None:
            return default
        if v not in choices:
            raise ConfigError(f"{self.loc(key)}: expected one of {', '.join(choices)}, got {v!r}")
        return v

    def done(self) -> None:
        """Reject keys nobody read: a typo must not silently fall back to a default."""
        for key in self.data:
            if key not in self.used:
                close = difflib.get_close_matches(key, sorted(self.used), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see README 'Configuration'"
                raise ConfigError(f"{self.loc(key)}: unknown key", hint=hint)


def _tname(v: Any) -> str:
    names: dict[type, str] = {dict: "a table", list: "a list", str: "a string"}
    return names.get(type(v), type(v).__name__)


def load_config(path: Path | None, *, explicit: bool = False) -> Config:
    """Read and validate the config at ``path``.

    A missing file is an empty config (no hosts, no services) unless the user named it
    explicitly (``--config`` / ``GPUCTL_CONFIG``); then it is an error.

    Raises:
        ConfigError: the file cannot be read or parsed, or a value is wrong.
    """
    if path is None:
        return Config(path=None)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(
                f"config file {path} does not exist",
                hint="create it (see README 'Configuration'), or drop --config / GPUCTL_CONFIG",
            ) from None
        return Config(path=path)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}", hint="fix the line it names") from None
    return parse_config(data, path)


# Keys a user might put a secret under, and where the secret belongs instead.
_SECRET_KEYS = {"token": "token", "jupyter_token": "jupyter_token", "password": "token"}


def parse_config(data: dict[str, Any], path: Path | None = None) -> Config:
    """Validate parsed TOML. Separate from ``load_config`` so tests need no files."""
    base = path.parent if path else None
    root = _Table("", data)

    d = _Table("defaults", root.get("defaults") or {})
    defaults = Defaults(
        idle_timeout_s=d.duration("idle_timeout", DEFAULT_IDLE_TIMEOUT_S),
        health_timeout_s=d.duration("health_timeout", DEFAULT_HEALTH_TIMEOUT_S),
        agent_timeout_s=d.duration("agent_timeout", DEFAULT_AGENT_TIMEOUT_S),
        priority=d.int_("priority", DEFAULT_PRIORITY),
    )
    d.done()

    hosts: dict[str, HostConfig] = {}
    for name, raw in _Table("hosts", root.get("hosts") or {}).data.items():
        _check_name("hosts", name)
        h = _Table(f"hosts.{name}", raw)
        token_env, token_file = h.str_("token_env"), h.path("token_file", base)
        if token_env and token_file:
            raise ConfigError(f"hosts.{name}: set token_env or token_file, not both")
        jt_env, jt_file = h.str_("jupyter_token_env"), h.path("jupyter_token_file", base)
        if jt_env and jt_file:
            raise ConfigError(
                f"hosts.{name}: set jupyter_token_env or jupyter_token_file, not both"
            )
        for secret, instead in _SECRET_KEYS.items():
            if secret in h.data:
                raise ConfigError(
                    f"hosts.{name}.{secret}: secrets do not belong in the config file",
                    hint=f"use {instead}_env or {instead}_file",
                )
        hosts[name] = HostConfig(
            name=name,
            agent=h.url("agent", ("http", "https")),
            token_env=token_env,
            token_file=token_file,
            jupyter=h.url("jupyter", ("http", "https")),
            jupyter_token_env=jt_env,
            jupyter_token_file=jt_file,
            docker=h.url("docker", ("unix", "tcp", "ssh", "http", "https", "npipe")),
            gpu_memory_mib=h.size("gpu_memory"),
            timeout_s=h.duration("timeout", defaults.agent_timeout_s),
            probe=h.choice("probe", PROBES, "auto") or "auto",
            sim_dir=h.path("sim_dir", base),
        )
        h.done()

    services: dict[str, ServiceConfig] = {}
    for name, raw in _Table("services", root.get("services") or {}).data.items():
        _check_name("services", name)
        s = _Table(f"services.{name}", raw)
        host = s.str_("host")
        if host is None:
            if len(hosts) == 1:
                host = next(iter(hosts))
            else:
                raise ConfigError(
                    f"services.{name}.host: missing",
                    hint="name the [hosts.X] table this service runs on",
                )
        elif host not in hosts:
            raise ConfigError(
                f"services.{name}.host: unknown host {host!r}",
                hint=_known("hosts", host, hosts, path),
            )
        launcher = s.choice("launcher", LAUNCHERS, None)
        svc = ServiceConfig(
            name=name,
            host=host,
            launcher=launcher,
            image=s.str_("image"),
            command=s.str_("command"),
            health=s.url("health", ("http", "https")),
            match=s.str_list("match"),
            memory_mib=s.size("memory"),
            priority=s.int_("priority", defaults.priority),
            idle_timeout_s=s.duration("idle_timeout", defaults.idle_timeout_s),
            health_timeout_s=s.duration("health_timeout", defaults.health_timeout_s),
            cwd=s.str_("cwd"),
            env=s.str_map("env"),
            log=s.str_("log"),
            gpus=s.bool_("gpus", True),
            ipc_mode=s.str_("ipc_mode"),
            shm_size=s.str_("shm_size"),
            volumes=s.str_list("volumes"),
            ports={k: int(v) for k, v in _ports(s).items()},
            network=s.str_("network"),
            stop_timeout_s=s.duration("stop_timeout", 30.0),
            terminal=s.str_("terminal"),
            pid_mode=s.str_("pid_mode"),
        )
        s.done()
        _check_service(svc, hosts[host])
        services[name] = svc

    root.done()
    return Config(path=path, defaults=defaults, hosts=hosts, services=services)


def _ports(s: _Table) -> dict[str, int]:
    raw = s.str_map("ports")
    out: dict[str, int] = {}
    for k, v in raw.items():
        try:
            out[k] = int(v)
        except ValueError:
            raise ConfigError(f"{s.loc('ports')}.{k}: expected a port number, got {v!r}") from None
    return out


def _check_name(kind: str, name: str) -> None:
    if not name.replace("-", "_").isidentifier():
        raise ConfigError(
            f"{kind}.{name}: names may hold letters, digits, '_' and '-' only",
        )


def _check_service(svc: ServiceConfig, host: HostConfig) -> None:
    where = f"services.{svc.name}"
    if svc.launcher == "docker" and not svc.image:
        raise ConfigError(f"{where}.image: missing (the docker launcher needs an image)")
    if svc.launcher in ("jupyter", "process") and not svc.command:
        raise ConfigError(f"{where}.command: missing (the {svc.launcher} launcher needs a command)")
    if svc.launcher == "jupyter" and not host.jupyter:
        raise ConfigError(
            f"{where}.launcher: 'jupyter' needs hosts.{host.name}.jupyter (the JupyterLab URL)"
        )
    if svc.terminal is not None and not svc.terminal.replace("_", "a").isalnum():
        raise ConfigError(
            f"{where}.terminal: Jupyter terminal names may hold letters, digits and '_' only"
        )


def config_path(explicit: Path | None) -> tuple[Path, bool]:
    """Where the config is read from, and whether the user named it explicitly."""
    if explicit is not None:
        return explicit.expanduser(), True
    env = os.environ.get("GPUCTL_CONFIG")
    if env:
        return Path(env).expanduser(), True
    from gpuctl.adapters.paths import default_config_path

    return default_config_path(), False


def load(explicit: Path | None) -> Config:
    """Find and load the config the way every command does (DESIGN §6)."""
    path, named = config_path(explicit)
    return load_config(path, explicit=named)
