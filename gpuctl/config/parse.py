"""Validate parsed TOML into the config model, naming the location of every error.

Each table declares its keys, and unknown keys are refused before anything else is
looked at: a typo (``[host.dgx]``, ``hots = "dgx"``) is reported as the typo, with a
"did you mean", not as the missing key it hides. Then every value is checked for what
its user will do with it: names the store accepts, URLs that parse (with a host where
one is needed), sizes and durations that are finite and positive, Docker and Jupyter
fields the launchers would otherwise refuse only at launch.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuctl.config.model import (
    DEFAULT_AGENT_TIMEOUT_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_PRIORITY,
    DEFAULT_STOP_TIMEOUT_S,
    LAUNCHERS,
    PROBES,
    SLEEP_LEVELS,
    STOP_ACTIONS,
    Config,
    Defaults,
    HostConfig,
    ServiceConfig,
    known_hint,
)
from gpuctl.core.names import NAME_RULE, is_valid_name
from gpuctl.core.units import parse_duration_s, parse_size_mib
from gpuctl.errors import ConfigError

ROOT_KEYS = ("defaults", "hosts", "services")
DEFAULTS_KEYS = ("idle_timeout", "health_timeout", "agent_timeout", "priority")
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
)
SERVICE_KEYS = (
    "host",
    "launcher",
    "image",
    "command",
    "health",
    "match",
    "memory",
    "priority",
    "idle_timeout",
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
# Schemes whose address is a local path (unix:///var/run/docker.sock), not a host.
_PATH_SCHEMES = ("unix", "npipe")

MAX_PRIORITY = 1_000_000
# NVML indexes GPUs from 0; no machine has anywhere near this many.
MAX_DEVICE_INDEX = 1023

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_TERMINAL = re.compile(r"\w{1,100}", re.ASCII)
_DOCKER_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)
_IMAGE = re.compile(r"[^\s\x00-\x1f]+")
_IPC_MODES = ("none", "private", "shareable", "host")
_VOLUME_MODES = frozenset(
    [
        "ro",
        "rw",
        "z",
        "Z",
        "shared",
        "rshared",
        "slave",
        "rslave",
        "private",
        "rprivate",
        "nocopy",
        "consistent",
        "cached",
        "delegated",
    ]
)


class _Table:
    """A TOML table being validated: typed getters that name the location of each value."""

    def __init__(self, where: str, data: Any, keys: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table, got {_tname(data)}")
        self.where = where
        self.data: dict[str, Any] = data
        for key in data:
            if key not in keys:
                # A huge key would make difflib slow; nothing that long is a typo of ours.
                close = difflib.get_close_matches(key, keys, n=1) if len(key) <= 100 else []
                hint = f"did you mean {close[0]!r}?" if close else "see README 'Configuration'"
                raise ConfigError(f"{self.loc(_key(key))}: unknown key", hint=hint)

    def loc(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def fail(self, key: str, message: str, hint: str = "") -> ConfigError:
        return ConfigError(f"{self.loc(key)}: {message}", hint=hint)

    def str_(self, key: str) -> str | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise self.fail(key, f"expected a non-empty string, got {_show(v)}")
        if "\x00" in v:
            raise self.fail(key, "must not contain a NUL character")
        return v.strip()

    def pattern(self, key: str, rx: re.Pattern[str], what: str) -> str | None:
        v = self.str_(key)
        if v is not None and not rx.fullmatch(v):
            raise self.fail(key, f"expected {what}, got {v!r}")
        return v

    def url(self, key: str, schemes: tuple[str, ...]) -> str | None:
        v = self.str_(key)
        if v is None:
            return None
        return check_url(self.loc(key), v, schemes)

    def int_(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(key, f"expected an integer, got {_show(v)}")
        if not lo <= v <= hi:
            raise self.fail(key, f"expected an integer from {lo} to {hi}, got {v}")
        return v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, f"expected true or false, got {_show(v)}")
        return v

    def size(self, key: str) -> int | None:
        v = self.get(key)
        if v is None:
            return None
        try:
            return parse_size_mib(v)
        except ValueError as e:
            raise self.fail(key, str(e)) from None

    def duration(self, key: str, default: float) -> float:
        v = self.get(key)
        if v is None:
            return default
        try:
            return parse_duration_s(v)
        except ValueError as e:
            raise self.fail(key, str(e)) from None

    def timeout_or_never(self, key: str, default: float | None) -> float | None:
        v = self.get(key)
        if isinstance(v, str) and v.strip().lower() == "never":
            return None
        if v is None:
            return default
        try:
            return parse_duration_s(v)
        except ValueError as e:
            raise self.fail(key, f'{e}, or "never"') from None

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
        if not isinstance(v, list) or not all(
            isinstance(x, str) and x.strip() and "\x00" not in x for x in v
        ):
            raise self.fail(key, f"expected a list of non-empty strings, got {_show(v)}")
        return tuple(v)

    def str_map(self, key: str) -> dict[str, str]:
        v = self.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self.fail(key, f"expected a table, got {_show(v)}")
        out: dict[str, str] = {}
        for k, x in v.items():
            if isinstance(x, bool) or not isinstance(x, str | int | float):
                raise ConfigError(f"{self.loc(key)}.{_key(k)}: expected a string, got {_show(x)}")
            text = str(x)
            if "\x00" in text or "\x00" in k:
                raise ConfigError(f"{self.loc(key)}.{_key(k)}: must not contain a NUL character")
            out[k] = text
        return out

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> str | None:
        v = self.str_(key)
        if v is None:
            return default
        if v not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {v!r}")
        return v


def check_url(where: str, value: str, schemes: tuple[str, ...]) -> str:
    """``value`` as a URL with one of ``schemes`` and a host (a path for ``unix://``),
    without its trailing ``/``.

    Raises:
        ConfigError: it does not parse, or lacks the scheme, host or a valid port.
    """
    want = " or ".join(s + "://" for s in schemes)
    if any(c.isspace() or ord(c) < 0x20 for c in value):
        raise ConfigError(f"{where}: a URL has no spaces or control characters, got {value!r}")
    try:
        u = urlsplit(value)
        port = u.port  # raises ValueError for a port that is not a number in 0-65535
        host = u.hostname
    except ValueError as e:
        raise ConfigError(f"{where}: not a valid URL ({e}): {value!r}") from None
    if u.scheme not in schemes:
        raise ConfigError(f"{where}: expected a URL starting with {want}, got {value!r}")
    if u.scheme in _PATH_SCHEMES:
        if not (u.path or u.netloc):
            raise ConfigError(f"{where}: expected a socket path, e.g. unix:///var/run/docker.sock")
    elif not host:
        raise ConfigError(
            f"{where}: the URL names no host: {value!r}", hint=f"e.g. {schemes[0]}://127.0.0.1:9400"
        )
    if port == 0:
        raise ConfigError(f"{where}: port 0 is not a port to connect to: {value!r}")
    return value.rstrip("/")


def _tname(v: Any) -> str:
    names: dict[type, str] = {dict: "a table", list: "a list", str: "a string"}
    return names.get(type(v), type(v).__name__)


def _key(k: str) -> str:
    """A table key for a location: as written when it is plain, else quoted and cut short."""
    return k if k and k.isprintable() and len(k) <= 80 else _show(k)


def _show(v: Any) -> str:
    """A value for an error message, cut short: a config can hold a huge string."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_config(data: dict[str, Any], path: Path | None = None) -> Config:
    """Validate parsed TOML (``tomllib.loads``'s answer). Separate from loading so tests
    need no files.

    Raises:
        ConfigError: the first problem, with its location (``services.vllm.memory: …``).
    """
    base = path.parent if path else None
    root = _Table("", data, ROOT_KEYS)

    d = _Table("defaults", root.get("defaults") or {}, DEFAULTS_KEYS)
    defaults = Defaults(
        idle_timeout_s=d.timeout_or_never("idle_timeout", DEFAULT_IDLE_TIMEOUT_S),
        health_timeout_s=d.duration("health_timeout", DEFAULT_HEALTH_TIMEOUT_S),
        agent_timeout_s=d.duration("agent_timeout", DEFAULT_AGENT_TIMEOUT_S),
        priority=d.int_("priority", DEFAULT_PRIORITY, -MAX_PRIORITY, MAX_PRIORITY),
    )

    hosts_table = root.get("hosts") or {}
    services_table = root.get("services") or {}
    for kind, table in (("hosts", hosts_table), ("services", services_table)):
        if not isinstance(table, dict):
            raise ConfigError(f"{kind}: expected a table of tables, got {_tname(table)}")
    hosts = {name: _host(name, raw, defaults, base) for name, raw in hosts_table.items()}
    services: dict[str, ServiceConfig] = {}
    for name, raw in services_table.items():
        services[name] = _service(name, raw, defaults, hosts, path)
    return Config(path=path, defaults=defaults, hosts=hosts, services=services)


def _check_name(kind: str, name: str) -> None:
    if not is_valid_name(name):
        raise ConfigError(f"{kind}.{_key(name)}: a name may hold {NAME_RULE}")


def _host(name: str, raw: Any, defaults: Defaults, base: Path | None) -> HostConfig:
    _check_name("hosts", name)
    if isinstance(raw, dict):
        for secret, instead in _SECRET_KEYS.items():
            if secret in raw:
                raise ConfigError(
                    f"hosts.{name}.{secret}: secrets do not belong in the config file",
                    hint=f"use {instead}_env or {instead}_file",
                )
    h = _Table(f"hosts.{name}", raw, HOST_KEYS)
    pairs = {}
    for what in ("token", "read_token", "jupyter_token"):
        env = h.pattern(f"{what}_env", _ENV_NAME, "an environment variable name")
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
    )


def _service(
    name: str, raw: Any, defaults: Defaults, hosts: dict[str, HostConfig], path: Path | None
) -> ServiceConfig:
    _check_name("services", name)
    s = _Table(f"services.{name}", raw, SERVICE_KEYS)
    host = s.str_("host")
    if host is None:
        if len(hosts) != 1:
            raise s.fail(
                "host",
                "missing" if hosts else "missing, and no [hosts] are configured",
                hint="name the [hosts.X] table this service runs on",
            )
        host = next(iter(hosts))
    elif host not in hosts:
        raise s.fail("host", f"unknown host {host!r}", hint=known_hint("hosts", host, hosts, path))
    stop = s.choice("stop", STOP_ACTIONS, "stop") or "stop"
    sleep_level = _sleep_level(s)
    if sleep_level is not None and stop != "sleep":
        raise s.fail("sleep_level", 'only with stop = "sleep"', hint='add stop = "sleep"')
    svc = ServiceConfig(
        name=name,
        host=host,
        launcher=s.choice("launcher", LAUNCHERS, None),
        image=s.pattern("image", _IMAGE, "an image name like 'vllm/vllm-openai:latest'"),
        command=s.str_("command"),
        health=s.url("health", HTTP),
        match=_match(s),
        memory_mib=s.size("memory"),
        priority=s.int_("priority", defaults.priority, -MAX_PRIORITY, MAX_PRIORITY),
        idle_timeout_s=s.timeout_or_never("idle_timeout", defaults.idle_timeout_s),
        health_timeout_s=s.duration("health_timeout", defaults.health_timeout_s),
        devices=_devices(s),
        stop=stop,
        sleep_level=(sleep_level or 1) if stop == "sleep" else None,
        metrics=s.url("metrics", HTTP),
        model=s.str_("model"),
        cwd=s.str_("cwd"),
        env=s.str_map("env"),
        log=s.str_("log"),
        gpus=s.bool_("gpus", True),
        ipc_mode=_ipc_mode(s),
        shm_size=_shm_size(s),
        volumes=_volumes(s),
        ports=_ports(s),
        network=_container_ref(s, "network", ("host", "bridge", "none")),
        stop_timeout_s=s.duration("stop_timeout", DEFAULT_STOP_TIMEOUT_S),
        terminal=s.pattern("terminal", _TERMINAL, "a terminal name of letters, digits and '_'"),
        pid_mode=_container_ref(s, "pid_mode", ("host",), containers_only=True),
    )
    _check_service(svc, hosts[host])
    return svc


def _match(s: _Table) -> tuple[str, ...]:
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


def _devices(s: _Table) -> tuple[int, ...] | None:
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
            f"expected a list of GPU indexes (0-{MAX_DEVICE_INDEX}), got {_show(v)}",
            hint="e.g. devices = [0] or [0, 1]; leave it out for any one GPU",
        )
    if len(set(v)) != len(v):
        raise s.fail("devices", f"a GPU is listed twice: {v}")
    return tuple(v)


def _sleep_level(s: _Table) -> int | None:
    v = s.get("sleep_level")
    if v is None:
        return None
    if isinstance(v, bool) or v not in SLEEP_LEVELS:
        raise s.fail("sleep_level", f"expected 1 or 2, got {_show(v)}")
    return int(v)


def _ipc_mode(s: _Table) -> str | None:
    v = s.str_("ipc_mode")
    if v is None or v in _IPC_MODES:
        return v
    if v.startswith("container:") and _DOCKER_REF.fullmatch(v.removeprefix("container:")):
        return v
    raise s.fail("ipc_mode", f"expected {', '.join(_IPC_MODES)} or container:NAME, got {v!r}")


def _container_ref(
    s: _Table, key: str, words: tuple[str, ...], *, containers_only: bool = False
) -> str | None:
    v = s.str_(key)
    if v is None or v in words:
        return v
    if v.startswith("container:") and _DOCKER_REF.fullmatch(v.removeprefix("container:")):
        return v
    if not containers_only and _DOCKER_REF.fullmatch(v):
        return v  # a user-defined network
    shown = ", ".join(words) + (
        " or container:NAME" if containers_only else ", a network name or container:NAME"
    )
    raise s.fail(key, f"expected {shown}, got {v!r}")


def _shm_size(s: _Table) -> str | None:
    v = s.get("shm_size")
    if v is None:
        return None
    try:
        parse_size_mib(v)
    except ValueError as e:
        raise s.fail("shm_size", str(e)) from None
    return str(v).strip()


def _volumes(s: _Table) -> tuple[str, ...]:
    out = s.str_list("volumes")
    for spec in out:
        parts = spec.split(":")
        ok = len(parts) in (2, 3) and parts[0] and parts[1].startswith("/")
        if ok and len(parts) == 3:
            ok = all(m in _VOLUME_MODES for m in parts[2].split(","))
        if not ok:
            raise s.fail(
                "volumes",
                f"expected 'host:container[:ro]', got {spec!r}",
                hint="e.g. '/data/hf:/root/.cache/huggingface:ro'",
            )
    return out


def _ports(s: _Table) -> dict[str, int]:
    raw = s.get("ports")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise s.fail("ports", f'expected a table like {{ "8000" = 8000 }}, got {_show(raw)}')
    out: dict[str, int] = {}
    for k, value in raw.items():
        v = value
        port, _, proto = k.partition("/")
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536) or proto not in (
            "",
            "tcp",
            "udp",
            "sctp",
        ):
            raise ConfigError(
                f"{s.loc('ports')}.{_key(k)}: expected a container port like '8000' or '8000/tcp'"
            )
        if isinstance(v, str) and v.isascii() and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
            raise ConfigError(
                f"{s.loc('ports')}.{_key(k)}: expected a port number (1-65535), got {_show(v)}"
            )
        out[k] = v
    return out


def _check_service(svc: ServiceConfig, host: HostConfig) -> None:
    where = f"services.{svc.name}"
    launcher = svc.launcher
    if launcher == "docker" and not svc.image:
        raise ConfigError(f"{where}.image: missing (the docker launcher needs an image)")
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
    if svc.stop == "sleep" and not svc.health:
        raise ConfigError(
            f"{where}.stop: 'sleep' needs health (sleep mode is asked at the server's origin)"
        )
    # Jupyter writes `export NAME=value` into a bash script; the other launchers hand
    # the environment over as a mapping, where only '=' cannot be in a name.
    for key in svc.env:
        if launcher == "jupyter" and not _ENV_NAME.fullmatch(key):
            raise ConfigError(
                f"{where}.env.{_key(key)}: not a shell variable name",
                hint="use letters, digits and '_' only, not starting with a digit",
            )
        if not key or "=" in key:
            raise ConfigError(f"{where}.env.{_key(key)}: an environment name cannot hold '='")
