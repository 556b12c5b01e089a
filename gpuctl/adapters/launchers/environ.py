"""What a launched server inherits: the caller's environment without gpuctl's secrets,
the service's ``env``, and the start nonce that lets gpuctl find it before it is recorded.

A server lives for hours and writes logs and crash dumps that other people read; the
agent's tokens or any host's ``token_env`` in its environment would leak through them.
So the environment a server gets is the caller's, less every variable any part of the
config names as a secret (``secret_names``) and every ``GPUCTL_*`` secret
(``is_scrubbed``). ``server_env`` builds it for the process and Docker launchers, and
``dropped`` names what a Jupyter terminal's launch script unsets: one rule, here.
The service's own ``env`` may still set any of those names on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.redact import is_secret_name

START_NONCE_ENV = "GPUCTL_START_NONCE"
"""The variable each launcher puts into its server's environment: the ``start_nonce`` the
caller wrote into the record before spawning. ``/proc/<pid>/environ`` then names the
server of a start whose caller died before it recorded the pid."""

START_SERVICE_ENV = "GPUCTL_START_SERVICE"
"""Set beside the nonce at every launch: the service the server was started for. A stop
checks both (``adapters.proof``): the nonce alone ties a process to a start, not to a
service, so a record copied from ``svcb`` to ``svca`` (same handle, same nonce) would
have a stop of ``svca`` kill ``svcb``'s server."""

RUN_JOB_ENV = "GPUCTL_RUN_JOB"
RUN_NONCE_ENV = "GPUCTL_RUN_NONCE"
RUN_PREEMPTIBLE_ENV = "GPUCTL_RUN_PREEMPTIBLE"
"""The marks ``gpuctl run`` puts into its CMD's environment (``adapters.job_cmd.run_env``).
They belong to CMD alone: a stop of the job signals whatever carries them, so a server
launched from inside the job must never inherit them."""
RUN_MARK_PREFIX = "GPUCTL_RUN_"
"""Every mark a ``gpuctl run`` job has, this release's and any later one's."""

# gpuctl's own variables that a server must never inherit, whatever the config says: the
# agent's two tokens (``gpuctl agent`` reads them from these), an enclosing ``gpuctl run``
# job's marks, the test-only failpoints, and a nonce from a gpuctl that itself runs
# under a server.
_ALWAYS_DROPPED = (
    "GPUCTL_AGENT_TOKEN",
    "GPUCTL_AGENT_READ_TOKEN",
    "GPUCTL_FAILPOINTS",
    "GPUCTL_FAILPOINTS_DIR",
    RUN_JOB_ENV,
    RUN_NONCE_ENV,
    RUN_PREEMPTIBLE_ENV,
)


def secret_names(source: Config | HostConfig) -> frozenset[str]:
    """The environment variables that hold gpuctl's secrets: for a whole config, every
    host's ``token_env``, ``read_token_env`` and ``jupyter_token_env`` (a server started
    for one host must not carry another host's token) and the proxy's ``api_keys_env``;
    for one host (a launcher built alone, as in tests), that host's."""
    names = {*_ALWAYS_DROPPED, START_NONCE_ENV, START_SERVICE_ENV}
    hosts = source.hosts.values() if isinstance(source, Config) else (source,)
    for host in hosts:
        for name in (host.token_env, host.read_token_env, host.jupyter_token_env):
            if name:
                names.add(name)
    if isinstance(source, Config) and source.proxy.api_keys_env:
        names.add(source.proxy.api_keys_env)
    return frozenset(names)


def is_scrubbed(name: str, secrets: Iterable[str] | frozenset[str]) -> bool:
    """Whether a launched server must not inherit ``name``: one of ``secrets``, one of
    gpuctl's own (``_ALWAYS_DROPPED``), a ``GPUCTL_RUN_*`` mark, or any ``GPUCTL_*``
    variable whose name is a secret's (``GPUCTL_PROXY_KEY``: a name gpuctl may read one
    day is scrubbed before it is added here). ``GPUCTL_CONFIG``, ``GPUCTL_STATE_DIR`` and
    the like are kept: a server that runs gpuctl itself needs them."""
    if name in secrets or name in _ALWAYS_DROPPED or name in (START_NONCE_ENV, START_SERVICE_ENV):
        return True
    return name.startswith("GPUCTL_") and (name.startswith(RUN_MARK_PREFIX) or is_secret_name(name))


def server_env(
    service: ServiceConfig,
    inherited: Mapping[str, str],
    secrets: Iterable[str],
    start_nonce: str | None,
) -> dict[str, str]:
    """A launched server's environment: ``inherited`` less what ``is_scrubbed`` names,
    then the service's ``env``, then the nonce and the service's name (the proof a stop
    checks, ``start_marks``). The one place that builds it."""
    drop = frozenset(secrets)
    env = {k: v for k, v in inherited.items() if not is_scrubbed(k, drop)}
    env.update(service.env)
    if start_nonce:
        env.update(start_marks(service.name, start_nonce))
    return env


def start_marks(service: str, start_nonce: str) -> dict[str, str]:
    """The marks a launch puts into its server's environment, and a stop of ``service``
    requires there (``adapters.proof.require_env``): the start's nonce and the service."""
    return {START_NONCE_ENV: start_nonce, START_SERVICE_ENV: service}


def dropped(service: ServiceConfig, secrets: Iterable[str]) -> list[str]:
    """The secret names a launcher must unset where it cannot choose the environment
    (a Jupyter terminal's shell has the Jupyter server's), minus those the service sets.
    A name only ``is_scrubbed``'s pattern would catch cannot be listed here: the launch
    script unsets those by pattern (``jupyter.script``)."""
    drop = {*secrets, *_ALWAYS_DROPPED, START_NONCE_ENV, START_SERVICE_ENV}
    return sorted(n for n in drop if n not in service.env)


def new_start_nonce() -> str:
    """A start's nonce, for a caller that brought none: unguessable, so no other process
    carries it by chance, and long enough to count as proof (``adapters.proof``)."""
    import secrets

    return secrets.token_hex(16)


UNPROVEN_HINT = "if it is the server, stop it by hand; then `gpuctl stop` clears its record"
