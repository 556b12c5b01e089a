"""How the agent answers: its tokens, keywords, cache and identity (``gpuctl agent``'s
options, parsed by ``gpuctl.cli.agent_cmd``)."""

from __future__ import annotations

import msgspec

from gpuctl.adapters.procinfo import host_identity
from gpuctl.core.health_reach import DEFAULT_HEALTH_PORTS, PortRanges, parse_ports
from gpuctl.core.snapshot import HostIdentity


class AgentSettings(msgspec.Struct, frozen=True):
    """How the agent answers.

    Attributes:
        token: the bearer token every endpoint but /healthz and /openapi.json requires;
            None means no auth (the server only allows that on loopback).
        cache_ttl_s: how long one probe reading (and one match scan) is reused.
        state_dir: the state directory this agent uses, reported in /status.
        gpu_memory_mib: the configured total, for devices that cannot tell (unified
            memory). The caller passes it to the probe; /status falls back to it too.
        host: this machine's identity, reported in /status.
        read_token: a second, read-only token: good for every GET, a write with it is 403.
        match: keywords of servers to report, for clients of the original ``/status``,
            in ``processes`` (``memory_mib`` 0, ``on_gpu`` false) while they load.
        match_max_age_s: only such processes younger than this count as loading.
        health_ports: the ports of this machine on which it fetches a record's health
            URL (``core.health_reach``); ``--health-ports``.
        journal_days: how many days of events the journal keeps (``--journal-days``);
            older ones survive as daily totals (``adapters.store.journal``).
        sim_dir: the simulated GPU's folder (the ``sim`` probe): only processes that
            carry it count as this host's (``procinfo.find_matching``).
    """

    token: str | None = None
    read_token: str | None = None
    match: tuple[str, ...] = ()
    match_max_age_s: float = 900.0
    cache_ttl_s: float = 1.0
    state_dir: str | None = None
    gpu_memory_mib: int | None = None
    host: HostIdentity = msgspec.field(default_factory=host_identity)
    health_ports: PortRanges = msgspec.field(
        default_factory=lambda: parse_ports(DEFAULT_HEALTH_PORTS)
    )
    journal_days: float = 90.0
    sim_dir: str | None = None
