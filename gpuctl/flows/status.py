"""Gather status: every host's snapshot and every service's decision, all at once.

Agents and health endpoints are asked in parallel (a thread each: the calls are
blocking httpx requests with their own timeouts), so one dead host shows UNKNOWN
after its own timeout and does not slow the others. Threads rather than asyncio
here: status makes a handful of requests, and the thread pool costs less at CLI
start than an event loop and the async stack.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from gpuctl.config import Config, HostConfig, ServiceConfig
from gpuctl.core.decision import NO_HEALTH, Health, Verdict, classify
from gpuctl.core.model import Snapshot
from gpuctl.core.record import Record, recorded_servers, starting_services
from gpuctl.errors import ExitCode, GpuctlError, StoreError

LOCAL_HOST = "local"


@dataclass(frozen=True, slots=True)
class HostReport:
    """One host: what its agent (or the local probe) said, or why it said nothing."""

    name: str
    source: str
    snapshot: Snapshot | None
    error: str | None = None
    hint: str | None = None
    verdicts: tuple[Verdict, ...] = ()
    services: tuple[ServiceConfig, ...] = ()
    health: tuple[Health, ...] = ()
    elapsed_s: float = 0.0
    gpu_memory_mib: int | None = None
    servers: Mapping[int, str] = field(default_factory=dict)  # recorded server pid -> service

    @property
    def ok(self) -> bool:
        return self.snapshot is not None

    @property
    def total_mib(self) -> int | None:
        if self.snapshot is None:
            return None
        return self.snapshot.memory_total_mib or self.gpu_memory_mib


@dataclass(frozen=True, slots=True)
class StatusReport:
    hosts: tuple[HostReport, ...]
    taken_at: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if all(h.ok for h in self.hosts) else ExitCode.UNKNOWN


@dataclass(frozen=True, slots=True)
class LocalProbeOptions:
    """How to read this machine's GPU when there is no agent."""

    probe: str = "auto"
    sim_dir: Path | None = None
    gpu_memory_mib: int | None = None


def read_agent(host: HostConfig, keywords: Sequence[str], pids: Sequence[int]) -> Snapshot:
    """Ask the host's agent, with that host's token and no other."""
    from gpuctl.adapters.agent_client import AgentClient

    assert host.agent is not None
    client = AgentClient(host.agent, host.token(), timeout_s=host.timeout_s, host_name=host.name)
    try:
        return client.status(match=keywords, pids=pids)
    finally:
        client.close()


def read_local(
    options: LocalProbeOptions, keywords: Sequence[str], pids: Sequence[int]
) -> Snapshot:
    """Probe this machine directly, as nvidia-smi and nvitop do."""
    from gpuctl.adapters.local import local_snapshot

    return local_snapshot(
        options.probe,
        keywords,
        sim_dir=options.sim_dir,
        gpu_memory_mib=options.gpu_memory_mib,
        pids=pids,
    )


def read_records(host: HostConfig) -> dict[str, Record]:
    """The host's records (leases, failures), through its agent or directly."""
    from gpuctl.adapters.store import store_for

    store = store_for(host, timeout_s=host.timeout_s)  # a hung agent: its own short timeout
    try:
        return {r.service: r for r in store.records()}
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _keywords(services: Sequence[ServiceConfig]) -> list[str]:
    seen: dict[str, None] = {}
    for s in services:
        for k in s.keywords:
            seen.setdefault(k, None)
    return list(seen)


def _records_or_none(host: HostConfig, services: Sequence[ServiceConfig]) -> dict[str, Record]:
    """The host's records; none when it has no services, or an agent without a store."""
    if not services:
        return {}
    with contextlib.suppress(StoreError):
        return read_records(host)
    return {}


def _read_local_host(
    host: HostConfig, services: Sequence[ServiceConfig], local: LocalProbeOptions
) -> tuple[Snapshot, dict[str, Record]]:
    """This machine: records first, so the servers they name are looked up by pid.

    (An agent does that itself, so for agents the two are asked in parallel.)
    """
    records = _records_or_none(host, services)
    pids = sorted(recorded_servers(records.values()))
    kws = _keywords(services)
    opts = LocalProbeOptions(
        probe=local.probe if local.probe != "auto" else host.probe,
        sim_dir=local.sim_dir or host.sim_dir,
        gpu_memory_mib=host.gpu_memory_mib or local.gpu_memory_mib,
    )
    return read_local(opts, kws, pids), records


def gather(
    config: Config,
    host_names: Sequence[str] | None = None,
    *,
    local: LocalProbeOptions | None = None,
    health_timeout_s: float = 2.0,
) -> StatusReport:
    """Status of ``host_names`` (default: every configured host; with none, this machine).

    Never raises for a host that does not answer: that host is reported UNKNOWN with
    why. Raises ``UsageError`` for an unknown host name.
    """
    local = local or LocalProbeOptions()
    if host_names:
        hosts = [config.host(n) for n in host_names]
    elif config.hosts:
        hosts = list(config.hosts.values())
    else:
        hosts = [
            HostConfig(
                name=LOCAL_HOST,
                probe=local.probe,
                sim_dir=local.sim_dir,
                gpu_memory_mib=local.gpu_memory_mib,
            )
        ]

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(32, 4 + 4 * len(hosts))) as pool:
        reads: dict[str, Future[tuple[Snapshot, dict[str, Record]]]] = {}
        snaps: dict[str, Future[Snapshot]] = {}
        recs: dict[str, Future[dict[str, Record]]] = {}
        healths: dict[str, Future[Health]] = {}
        for h in hosts:
            services = config.services_on(h.name)
            if h.agent:
                snaps[h.name] = pool.submit(read_agent, h, _keywords(services), ())
                recs[h.name] = pool.submit(_records_or_none, h, services)
            else:
                reads[h.name] = pool.submit(_read_local_host, h, services, local)
            for s in services:
                if s.health:
                    healths[s.name] = pool.submit(
                        _health, s.health, min(health_timeout_s, h.timeout_s)
                    )

        reports: list[HostReport] = []
        for h in hosts:
            services = config.services_on(h.name)
            snapshot: Snapshot | None = None
            records: dict[str, Record] = {}
            error = hint = None
            try:
                if h.agent:
                    snapshot = snaps[h.name].result()
                    # The agent answered /status: a failing /records must not hide that.
                    with contextlib.suppress(GpuctlError):
                        records = recs[h.name].result()
                else:
                    snapshot, records = reads[h.name].result()
            except GpuctlError as e:
                error, hint = e.message, e.hint or None
            except Exception as e:  # a reader bug must not hide the other hosts
                error = f"{type(e).__name__}: {e}"
            hs = tuple(
                healths[s.name].result() if s.name in healths else NO_HEALTH for s in services
            )
            now = time.time()
            servers = recorded_servers(records.values())
            verdicts = tuple(
                classify(
                    s,
                    hh,
                    snapshot,
                    others=services,
                    agent_error=error,
                    total_override_mib=h.gpu_memory_mib,
                    record=records.get(s.name),
                    now=now,
                    leased=starting_services(records.values()),
                    servers=servers,
                )
                for s, hh in zip(services, hs, strict=True)
            )
            reports.append(
                HostReport(
                    name=h.name,
                    source=h.agent
                    or f"local probe ({h.probe if local.probe == 'auto' else local.probe})",
                    snapshot=snapshot,
                    error=error,
                    hint=hint,
                    verdicts=verdicts,
                    services=tuple(services),
                    health=hs,
                    elapsed_s=time.monotonic() - started,
                    gpu_memory_mib=h.gpu_memory_mib,
                    servers=servers,
                )
            )
    return StatusReport(hosts=tuple(reports))


def _health(url: str, timeout_s: float) -> Health:
    from gpuctl.adapters import health

    return health.check(url, timeout_s)
