"""What a launched server inherits: the caller's environment without gpuctl's secrets,
the service's ``env``, and the start nonce that lets gpuctl find it before it is recorded.

A server lives for hours and writes logs and crash dumps that other people read; the
agent's token or the host's ``token_env`` in its environment would leak through them.
The service's own ``env`` may still set any of those names on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuctl.config import HostConfig, ServiceConfig

START_NONCE_ENV = "GPUCTL_START_NONCE"
"""The variable each launcher puts into its server's environment: the ``start_nonce`` the
caller wrote into the record before spawning. ``/proc/<pid>/environ`` then names the
server of a start whose caller died before it recorded the pid."""

RUN_JOB_ENV = "GPUCTL_RUN_JOB"
RUN_NONCE_ENV = "GPUCTL_RUN_NONCE"
RUN_PREEMPTIBLE_ENV = "GPUCTL_RUN_PREEMPTIBLE"
"""The marks ``gpuctl run`` puts into its CMD's environment (``adapters.jobs.run_env``).
They belong to CMD alone: a stop of the job signals whatever carries them, so a server
launched from inside the job must never inherit them."""
RUN_MARK_PREFIX = "GPUCTL_RUN_"

# gpuctl's own variables that a server must never inherit: the agent's token, the
# test-only failpoints, and an enclosing job's marks (and a nonce from a gpuctl that
# itself runs under a server).
_ALWAYS_DROPPED = (
    "GPUCTL_AGENT_TOKEN",
    "GPUCTL_FAILPOINTS",
    "GPUCTL_FAILPOINTS_DIR",
    RUN_JOB_ENV,
    RUN_NONCE_ENV,
    RUN_PREEMPTIBLE_ENV,
)


def secret_names(host: HostConfig) -> frozenset[str]:
    """The environment variables that hold gpuctl's secrets for ``host``."""
    names = {*_ALWAYS_DROPPED, START_NONCE_ENV}
    for name in (host.token_env, host.read_token_env, host.jupyter_token_env):
        if name:
            names.add(name)
    return frozenset(names)


def server_env(
    service: ServiceConfig,
    inherited: Mapping[str, str],
    secrets: Iterable[str],
    start_nonce: str | None,
) -> dict[str, str]:
    """``inherited`` without ``secrets``, then the service's ``env``, then the nonce."""
    drop = {*secrets, *_ALWAYS_DROPPED, START_NONCE_ENV}
    env = {
        k: v for k, v in inherited.items() if k not in drop and not k.startswith(RUN_MARK_PREFIX)
    }
    env.update(service.env)
    if start_nonce:
        env[START_NONCE_ENV] = start_nonce
    return env


def dropped(service: ServiceConfig, secrets: Iterable[str]) -> list[str]:
    """The secret names a launcher must unset where it cannot choose the environment
    (a Jupyter terminal's shell has the Jupyter server's), minus those the service sets."""
    drop = {*secrets, *_ALWAYS_DROPPED, START_NONCE_ENV}
    return sorted(n for n in drop if n not in service.env)


def new_start_nonce() -> str:
    """A start's nonce, for a caller that brought none: unguessable, so no other process
    carries it by chance, and long enough to count as proof (``adapters.proof``)."""
    import secrets

    return secrets.token_hex(16)


UNPROVEN_HINT = "if it is the server, stop it by hand; then `gpuctl stop` clears its record"
