"""``gpuctl config show``: the loaded config under its own key names (those of the TOML).

Sizes and durations are written back the way a user writes them (``80GiB``, ``30m``),
so the TOML view can be pasted into a config file. Secrets never appear: only where
they come from, as comments (TOML) or a masked string (JSON).
"""

from __future__ import annotations

import os
from typing import Any

from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.redact import MASK, is_secret_name, redact_command, show_url


def size_text(mib: int | None) -> str | None:
    if mib is None:
        return None
    if mib % (1024 * 1024) == 0:
        return f"{mib // (1024 * 1024)}TiB"
    if mib % 1024 == 0:
        return f"{mib // 1024}GiB"
    return f"{mib}MiB"


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds != int(seconds):
        return f"{round(seconds * 1000)}ms"
    s = int(seconds)
    if s and s % 3600 == 0:
        return f"{s // 3600}h"
    if s and s % 60 == 0:
        return f"{s // 60}m"
    return f"{s}s"


def _url(url: str | None) -> str | None:
    """A configured URL as shown: its password as ``***`` (``core.redact.show_url``)."""
    return show_url(url) if url else url


def _command(command: str | None) -> str | None:
    """A command line (or an ``env`` value) as shown: secret values as ``***``, URL
    passwords too (``core.redact.redact_command``)."""
    return redact_command(command) if command else command


def _host(h: HostConfig) -> dict[str, Any]:
    return {
        "agent": _url(h.agent),
        "token_env": h.token_env,
        "token_file": str(h.token_file) if h.token_file else None,
        "read_token_env": h.read_token_env,
        "read_token_file": str(h.read_token_file) if h.read_token_file else None,
        "jupyter": _url(h.jupyter),
        "jupyter_token_env": h.jupyter_token_env,
        "jupyter_token_file": str(h.jupyter_token_file) if h.jupyter_token_file else None,
        "docker": _url(h.docker),
        "ollama": _url(h.ollama),
        "gpu_memory": size_text(h.gpu_memory_mib),
        "timeout": duration_text(h.timeout_s),
        # Only a host without an agent is probed here.
        "probe": None if h.agent else h.probe,
        "sim_dir": str(h.sim_dir) if h.sim_dir else None,
    }


def _service(s: ServiceConfig) -> dict[str, Any]:
    t = s.templates  # a URL written with {host} is shown as written
    return {
        # A pool of one is `host`, as most configs write it.
        "host": None if s.pooled else s.host,
        "hosts": list(s.hosts) if s.pooled else None,
        "launcher": s.launcher,
        "image": s.image,
        # A command or an env value may hold a key (``--api-key X``, ``HF_TOKEN``): masked
        # as /status masks other people's command lines (``core.redact``).
        "command": _command(s.command),
        "health": _url(t.get("health", s.health)),
        "match": list(s.match) or None,
        "memory": size_text(s.memory_mib),
        "priority": s.priority,
        "idle_timeout": duration_text(s.idle_timeout_s),
        # A batch never yields: the key is not one it takes.
        "yield_after": duration_text(s.yield_after_s) if s.kind != "batch" else None,
        "health_timeout": duration_text(s.health_timeout_s),
        "devices": list(s.devices) if s.devices is not None else None,
        "stop": s.stop,
        "sleep_level": s.sleep_level,
        "metrics": _url(t.get("metrics", s.metrics)),
        "model": s.model,
        "cwd": s.cwd,
        # A value under any name may still hold one: ``DB_URL = "postgres://u:X@h/db"``,
        # ``EXTRA_ARGS = "--api-key X"``: each value is redacted as a command line.
        "env": {k: MASK if is_secret_name(k) else _command(v) for k, v in s.env.items()} or None,
        "log": s.log,
        "gpus": s.gpus,
        "ipc_mode": s.ipc_mode,
        "shm_size": s.shm_size,
        "volumes": list(s.volumes) or None,
        "ports": dict(s.ports) or None,
        "network": s.network,
        "pid_mode": s.pid_mode,
        "stop_timeout": duration_text(s.stop_timeout_s),
        "terminal": s.terminal,
        "models": list(s.models) or None,
        "url": _url(t.get("url", s.url)),
        "max_concurrent": s.max_concurrent,
        "queue_timeout": duration_text(s.queue_timeout_s) if s.queue_timeout_s else None,
        "preempt": s.preempt or None,
        "resume": s.resume or None,
        "kind": s.kind if s.kind != "server" else None,
    }


def _proxy(conf: Config) -> dict[str, Any]:
    p = conf.proxy
    return {
        "listen": p.listen,
        "api_keys_env": p.api_keys_env,
        "api_keys_file": str(p.api_keys_file) if p.api_keys_file else None,
        "max_body": size_text(p.max_body_mib),
        "sse_keepalive": p.sse_keepalive,
        "sse_interval": duration_text(p.sse_interval_s),
        "retry_after": duration_text(p.retry_after_s),
        "access_log": p.access_log,
    }


def _secret(env: str | None, file: object) -> str | None:
    if env:
        return f"****** (from ${env}{'' if os.environ.get(env) else ', NOT SET'})"
    if file:
        return f"****** (from {file})"
    return None


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def config_to_json(conf: Config) -> dict[str, Any]:
    """``{"schema": 1, "path", "defaults", "hosts", "services", "proxy"}`` under the config's key names;
    each host adds ``token`` / ``read_token`` / ``jupyter_token``: where the secret comes from, masked."""
    d = conf.defaults
    hosts = {}
    for n, h in conf.hosts.items():
        hosts[n] = {
            **_drop_none(_host(h)),
            "token": _secret(h.token_env, h.token_file),
            "read_token": _secret(h.read_token_env, h.read_token_file),
            "jupyter_token": _secret(h.jupyter_token_env, h.jupyter_token_file),
        }
    return {
        "schema": 1,
        "path": str(conf.path) if conf.path else None,
        "defaults": {
            "idle_timeout": duration_text(d.idle_timeout_s),
            "yield_after": duration_text(d.yield_after_s),
            "health_timeout": duration_text(d.health_timeout_s),
            "agent_timeout": duration_text(d.agent_timeout_s),
            "priority": d.priority,
        },
        "hosts": hosts,
        "services": {n: _drop_none(_service(s)) for n, s in conf.services.items()},
        "proxy": _drop_none(_proxy(conf)),
    }


def config_to_toml(conf: Config) -> str:
    """The config as gpuctl reads it, in TOML that loads back as the same config.

    Written by a TOML library (``tomli_w``), never by hand: a host or service name that
    is not a bare key (``gpu.box``) must be quoted (``[hosts."gpu.box"]``), and strings
    escaped as TOML wants. Secrets are never values here: where a host's token comes
    from is said in comments above the tables."""
    import tomli_w

    obj = config_to_json(conf)
    notes = [f"# {obj['path'] or '(no config file)'}: as gpuctl reads it, defaults filled in"]
    hosts: dict[str, Any] = {}
    for name, body in obj["hosts"].items():
        kept = {}
        for k, v in body.items():
            if k in ("token", "read_token", "jupyter_token"):
                if v:
                    notes.append(f"# hosts.{name}.{k}: {v}")
                continue
            kept[k] = v
        hosts[name] = kept
    doc = {
        "defaults": obj["defaults"],
        "hosts": hosts,
        "services": obj["services"],
        "proxy": obj["proxy"],
    }
    return "\n".join(notes) + "\n\n" + tomli_w.dumps(doc)
