"""The proxy's part of the config: the ``[proxy]`` table, and the service keys it routes
by (``models``, one service per model name; ``max_concurrent``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpuctl.config.table import ENV_NAME, Table, show
from gpuctl.config.values import (
    DEFAULT_PROXY_LISTEN,
    DEFAULT_PROXY_MAX_BODY_MIB,
    DEFAULT_PROXY_RETRY_AFTER_S,
    DEFAULT_PROXY_SSE_INTERVAL_S,
    ProxyConfig,
    ServiceConfig,
)
from gpuctl.core.conn_limits import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_PER_PEER,
    DEFAULT_MAX_TOTAL,
    MIN_PER_PEER,
    ConnectionLimits,
)
from gpuctl.errors import ConfigError

PROXY_KEYS = (
    "listen",
    "api_keys_file",
    "api_keys_env",
    "max_body",
    "sse_keepalive",
    "sse_interval",
    "retry_after",
    "access_log",
    "max_connections",
    "max_connections_per_peer",
    "header_timeout",
    "idle_timeout",
)
# A model name as clients send it ("Qwen/Qwen3-32B", "qwen3:32b"): printable, no spaces.
_MODEL_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")
MAX_CONCURRENT = 100_000


def parse_proxy(raw: Any, base: Path | None) -> ProxyConfig:
    p = Table("proxy", raw if raw is not None else {}, PROXY_KEYS)
    listen = p.str_("listen") or DEFAULT_PROXY_LISTEN
    host, sep, port = listen.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and int(port) <= 65535):
        raise p.fail("listen", f"expected HOST:PORT, got {listen!r}", hint="e.g. 127.0.0.1:9401")
    keys_env = p.pattern("api_keys_env", ENV_NAME, "an environment variable name")
    keys_file = p.path("api_keys_file", base)
    if keys_env and keys_file:
        raise ConfigError("proxy: set api_keys_env or api_keys_file, not both")
    max_body = p.size("max_body")
    limits = ConnectionLimits(
        max_total=p.int_("max_connections", DEFAULT_MAX_TOTAL, 1, 1 << 20),
        max_per_peer=p.int_(
            "max_connections_per_peer", DEFAULT_MAX_PER_PEER, MIN_PER_PEER, 1 << 20
        ),
        head_timeout_s=p.duration("header_timeout", DEFAULT_HEAD_TIMEOUT_S),
        idle_timeout_s=p.duration("idle_timeout", DEFAULT_IDLE_TIMEOUT_S),
    )
    if bad := limits.check():
        raise ConfigError(f"proxy: {bad[0]}")
    return ProxyConfig(
        listen=listen,
        api_keys_env=keys_env,
        api_keys_file=keys_file,
        max_body_mib=max_body if max_body is not None else DEFAULT_PROXY_MAX_BODY_MIB,
        sse_keepalive=p.bool_("sse_keepalive", True),
        sse_interval_s=p.duration("sse_interval", DEFAULT_PROXY_SSE_INTERVAL_S),
        retry_after_s=p.duration("retry_after", DEFAULT_PROXY_RETRY_AFTER_S),
        access_log=p.bool_("access_log", True),
        connections=limits,
    )


def models(s: Table) -> tuple[str, ...]:
    names = s.str_list("models")
    for m in names:
        if not _MODEL_NAME.fullmatch(m):
            raise s.fail(
                "models",
                f"a model name has no spaces or control characters (200 at most), got {show(m)}",
            )
    if len(set(names)) != len(names):
        raise s.fail("models", f"a model is listed twice: {show(list(names))}")
    return names


def check_models(services: dict[str, ServiceConfig]) -> None:
    """One service per model name: the proxy routes by it."""
    seen: dict[str, str] = {}
    for svc in services.values():
        for m in svc.models:
            if m in seen:
                raise ConfigError(
                    f"services.{svc.name}.models: {m!r} is already a model of services.{seen[m]}",
                    hint="a model name routes to one service; give each its own name",
                )
            seen[m] = svc.name


def max_concurrent(s: Table) -> int | None:
    if s.get("max_concurrent") is None:
        return None
    return s.int_("max_concurrent", 0, 1, MAX_CONCURRENT)
