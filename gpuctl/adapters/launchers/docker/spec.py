"""What a service's container is: its name, labels, configuration hash and the keyword
arguments of ``containers.create``. Pure: no engine is asked."""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from typing import Any

from gpuctl.config import ServiceConfig
from gpuctl.core.units import parse_size_mib
from gpuctl.errors import StartFailed

LABEL_MANAGED = "gpuctl.managed"
LABEL_SERVICE = "gpuctl.service"
LABEL_HASH = "gpuctl.config-hash"
# Set once, when the container is created (the creating start's nonce), and kept in the
# record's handle: a stop checks it before it asks the engine to stop anything, so a
# record naming someone else's container is refused. A reused container keeps it.
LABEL_PROOF = "gpuctl.proof"


def container_name(service: ServiceConfig) -> str:
    """``gpuctl-<service>``: one container per service, found again by this name."""
    return f"gpuctl-{service.name}"


def config_hash(service: ServiceConfig) -> str:
    """SHA-256 of the canonical JSON of what shapes the container (not timeouts, not priority).

    A stopped container with the same hash is started again; another hash means it is
    removed and recreated. The start nonce is not part of it: it changes every start.
    """
    launch = {
        "image": service.image,
        "command": service.command,
        "env": dict(service.env),
        "volumes": list(service.volumes),
        "ports": dict(service.ports),
        "network": service.network,
        "ipc_mode": service.ipc_mode,
        "shm_size": service.shm_size,
        "gpus": service.gpus,
        "pid_mode": service.pid_mode,
    }
    canonical = json.dumps(launch, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_kwargs(
    service: ServiceConfig, environment: Mapping[str, str], proof: str = ""
) -> dict[str, Any]:
    """The keyword arguments ``containers.create`` gets for ``service``.

    Args:
        environment: the container's environment (the service's ``env`` and gpuctl's
            start nonce; a container never inherits the caller's environment).
        proof: the ``gpuctl.proof`` label's value (none when empty).

    Raises:
        StartFailed: a volume, port or size in the service's config cannot be used.
    """
    from docker.types import DeviceRequest

    where = f"services.{service.name}"
    if not service.image:
        raise StartFailed(
            f"{where}.image: missing", hint="the docker launcher needs an image to run"
        )
    kwargs: dict[str, Any] = {
        "image": service.image,
        "command": shlex.split(service.command) if service.command else None,
        "name": container_name(service),
        "labels": {
            LABEL_MANAGED: "true",
            LABEL_SERVICE: service.name,
            LABEL_HASH: config_hash(service),
            **({LABEL_PROOF: proof} if proof else {}),
        },
        "environment": dict(environment),
        "volumes": [_volume(where, v) for v in service.volumes],
        "ports": {_port_key(where, k): int(v) for k, v in service.ports.items()},
        "init": True,
        "restart_policy": {"Name": "no"},
        # A server that runs for weeks must not fill the disk with its log.
        "log_config": {"Type": "json-file", "Config": {"max-size": "64m", "max-file": "3"}},
    }
    if service.gpus:
        # == docker run --gpus all
        kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if service.network:
        kwargs["network_mode"] = service.network
    if service.ipc_mode:
        kwargs["ipc_mode"] = service.ipc_mode
    if service.pid_mode:
        kwargs["pid_mode"] = service.pid_mode
    if service.shm_size:
        kwargs["shm_size"] = _shm_bytes(where, service.shm_size)
    return kwargs


def _volume(where: str, spec: str) -> str:
    """Check ``host:container[:ro|rw]`` (the host side may be a named volume)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/"):
        raise StartFailed(
            f"{where}.volumes: expected 'host:container[:ro]', got {spec!r}",
            hint="e.g. '/data/hf:/root/.cache/huggingface:ro'",
        )
    return spec


def _port_key(where: str, key: str) -> str:
    """``8000`` / ``8000/tcp`` / ``8000/udp`` -> the SDK's ``8000/tcp`` form."""
    port, _, proto = key.partition("/")
    proto = proto or "tcp"
    if not port.isdigit() or not 0 < int(port) < 65536 or proto not in ("tcp", "udp", "sctp"):
        raise StartFailed(
            f"{where}.ports: expected a container port like '8000' or '8000/tcp', got {key!r}",
            hint='e.g. ports = { "8000" = 8000 } (container port = host port)',
        )
    return f"{int(port)}/{proto}"


def _shm_bytes(where: str, text: str) -> int:
    """gpuctl's sizes (``16GiB``, ``2g``; never a bare number) in bytes, as Docker wants."""
    try:
        return parse_size_mib(text) * 1024 * 1024
    except ValueError as err:
        raise StartFailed(f"{where}.shm_size: {err}") from None
