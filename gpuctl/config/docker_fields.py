"""The Docker launcher's service fields, checked at load as ``docker run`` would check
them at launch: ``ipc_mode``, ``network``, ``pid_mode``, ``shm_size``, ``volumes``,
``ports``. Each takes the service's ``Table`` and raises its located ``ConfigError``."""

from __future__ import annotations

import re

from gpuctl.config.table import Table, key_text, show
from gpuctl.core.units import parse_size_mib
from gpuctl.errors import ConfigError

_DOCKER_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)
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


def ipc_mode(s: Table) -> str | None:
    v = s.str_("ipc_mode")
    if v is None or v in _IPC_MODES:
        return v
    if v.startswith("container:") and _DOCKER_REF.fullmatch(v.removeprefix("container:")):
        return v
    raise s.fail("ipc_mode", f"expected {', '.join(_IPC_MODES)} or container:NAME, got {v!r}")


def container_ref(
    s: Table, key: str, words: tuple[str, ...], *, containers_only: bool = False
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


def shm_size(s: Table) -> str | None:
    v = s.get("shm_size")
    if v is None:
        return None
    try:
        parse_size_mib(v)
    except ValueError as e:
        raise s.fail("shm_size", str(e)) from None
    return str(v).strip()


def volumes(s: Table) -> tuple[str, ...]:
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


def ports(s: Table) -> dict[str, int]:
    raw = s.get("ports")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise s.fail("ports", f'expected a table like {{ "8000" = 8000 }}, got {show(raw)}')
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
                f"{s.loc('ports')}.{key_text(k)}: expected a container port like '8000' or '8000/tcp'"
            )
        if isinstance(v, str) and v.isascii() and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
            raise ConfigError(
                f"{s.loc('ports')}.{key_text(k)}: expected a port number (1-65535), got {show(v)}"
            )
        out[k] = v
    return out
