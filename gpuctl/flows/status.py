"""Gather status: every host's snapshot and every service's decision, all at once.

Hosts and health endpoints are asked in parallel (a thread each: the calls are
blocking httpx requests with their own timeouts), so one dead host shows UNKNOWN
after its own timeout and does not slow the others. Threads rather than asyncio
here: status makes a handful of requests, and the thread pool costs less at CLI
start than an event loop and the async stack. A single host with no health URL to
ask is read on the calling thread: no pool at all.

Each host is observed as ``ensure`` observes it (``gpuctl.flows.look``): records
first, then the snapshot with the servers they name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
from msgspec.structs import replace

from gpuctl.config.slurm_fields import names_node, node_of_url
from gpuctl.core.decision import NO_HEALTH, Decision, Health, Verdict, loading_owner
from gpuctl.core.jobs import is_job, job_specs
from gpuctl.core.names import is_service_name
from gpuctl.core.promised_specs import holds_memory
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Phase
from gpuctl.core.snapshot import GpuProcess, Snapshot, StartingProcess
from gpuctl.core.timestamps import iso_utc
from gpuctl.errors import GpuctlError
from gpuctl.flows.deps import HostDeps, LocalProbeOptions, StatusDeps
from gpuctl.flows.look import (
    HELD_BACK_HINT,
    Observation,
    decide,
    memory_use,
    observe,
    service_held_back,
    victim_facts,
    with_victims,
    yielding,
)
from gpuctl.flows.results import HostReport, OtherService, StatusReport

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = [
    "HostReport",
    "LocalProbeOptions",
    "StatusReport",
    "filtered",
    "status",
    "watch",
]

T = TypeVar("T")


class _Done(msgspec.Struct, Generic[T], frozen=True):
    """A value already computed, shaped like a Future (the no-pool path)."""

    value: T

    def result(self) -> T:
        return self.value


@contextmanager
def _runner(jobs: int) -> Iterator[Callable[..., Any]]:
    """``submit(fn, *args)``: in a thread pool when there is more than one job."""
    if jobs <= 1:
        yield lambda fn, *args: _Done(fn(*args))
        return
    # Imported here: one host with nothing to ask of health (the common case) has no pool.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(32, jobs)) as pool:
        yield pool.submit


def _observe_host(hd: HostDeps, services: Sequence[Any]) -> Observation:
    def no_records() -> list[Any]:
        return []

    try:
        return observe(
            hd.read_records if services else no_records,
            hd.read_snapshot,
            services,
            # An agent started without a state dir has no records: its snapshot still stands.
            records_required=False,
            find_servers=hd.find_servers,
            find_children=hd.find_children,
        )
    except Exception as e:  # a reader bug must not hide the other hosts
        return Observation(
            error=f"internal error: {type(e).__name__}: {e}",
            hint="a bug in gpuctl: run again with GPUCTL_DEBUG=1 for the traceback, and report it",
        )


def _ollama_others(services: Sequence[Any]) -> dict[str, frozenset[str]]:
    """For the first Ollama service of a host, the models its other Ollama services
    name: that one counts every other model Ollama has loaded, whatever loaded it (a
    client of its /services/ path, or of Ollama itself), so Ollama's memory is all
    counted, and counted once."""
    ollamas = [s for s in services if s.launcher == "ollama" and s.model]
    if not ollamas:
        return {}
    return {ollamas[0].name: frozenset(s.model for s in ollamas[1:])}


def _health_target(s: Any, deps: StatusDeps) -> bool:
    """Whether the service has a health to ask beside its host's reading: its URL, or an
    Ollama model's /api/ps. A Slurm job's ``{node}`` is asked after it (``_node_health``)."""
    if names_node(s.health):
        return False
    return bool(s.health) or (
        s.launcher == "ollama" and s.model is not None and deps.check_ollama is not None
    )


def _health_of(
    deps: StatusDeps,
    s: Any,
    ollama: str | None,
    timeout_s: float,
    others: frozenset[str] | None = None,
) -> Health:
    """One service's health: its URL (asleep or not, with vLLM sleep mode), or its Ollama
    model's ``/api/ps`` (``others``: see ``_ollama_others``)."""
    if s.health:
        h = deps.check_health(s.health, timeout_s)
        if s.stop == "sleep" and deps.check_sleeping is not None:
            h = deps.check_sleeping(s.health, h, timeout_s)
        return h
    if ollama and s.model and deps.check_ollama is not None:
        return deps.check_ollama(ollama, s.model, timeout_s, others)
    return NO_HEALTH


def _node_health(deps: StatusDeps, s: Any, obs: Observation, timeout_s: float) -> Health:
    """A Slurm job's health, whose ``{node}`` ``status`` never asks squeue for: at the URL
    its record keeps (the template with the node in it, recorded by the ``ensure`` that
    saw it answer there, while it says its job runs), else none, saying why."""
    rec = obs.records.get(s.name)
    live = rec is not None and rec.phase in (Phase.STARTING, Phase.RUNNING)
    url = rec.health if rec is not None and live else None
    if url is None or node_of_url(s.health, url) is None:
        return Health(
            "none",
            "its health names {node}, the node Slurm chose, not known until "
            f"`gpuctl ensure {s.name}` sees the job answer (status does not ask squeue)",
        )
    return replace(deps.check_health(url, timeout_s), url=url)


def _judge(
    deps: StatusDeps,
    hd: HostDeps,
    obs: Observation,
    services: Sequence[Any],
    now: float,
    *,
    counts: Callable[[], Mapping[str, int]] | None,
    in_flight: Callable[[Any], int | None] | None,
) -> Callable[[Any, Health], Verdict]:
    """How ``status`` decides each service of one host: as ``ensure`` does
    (``observe.decide``, then ``observe.with_victims``), so a service that would fit once
    lower-priority work stops is PREEMPTABLE here too, naming what ``ensure --preempt``
    would stop. The in-flight counts and the servers' metrics are read once per host, and
    only when some service does not fit."""

    def judge(svc: Any, health: Health) -> Verdict:
        decide_it = partial(
            decide,
            svc,
            health,
            obs,
            others=services,
            now=now,
            total_override_mib=hd.host.gpu_memory_mib,
            host_hint=False,  # the host's line shows it, once
        )
        first = decide_it()
        if counts is not None and obs.snapshot is not None:
            facts = partial(
                victim_facts,
                obs,
                services,
                svc,
                counts=counts,
                server_in_flight=in_flight,
                machine=deps.machine,
                now=now,
            )
            first = with_victims(first, svc, decide_it, facts)
        return _queue_check(first, svc, obs, hd, waiters)

    waiters = _once(hd.read_waiters) if hd.read_waiters is not None else None
    return judge


def _queue_check(
    verdict: Verdict,
    svc: Any,
    obs: Observation,
    hd: HostDeps,
    waiters: Callable[[], Sequence[Waiter]] | None,
) -> Verdict:
    """An IDLE or FITS service that ``ensure`` would hold back for the head of the
    ``gpuctl run --wait`` queue (``look.service_held_back``) is BUSY, with the
    reason and hint ``ensure`` gives; a queue that cannot be read leaves it UNKNOWN."""
    if waiters is None or verdict.decision not in (Decision.IDLE, Decision.FITS):
        return verdict
    try:
        queue = waiters()
    except GpuctlError as e:
        return replace(
            verdict,
            decision=Decision.UNKNOWN,
            reason=f"the host's wait queue cannot be read ({e.message}); {verdict.reason}",
            hint=e.hint or "",
        )
    held = service_held_back(
        queue,
        priority=svc.priority,
        need_mib=svc.memory_mib,
        verdict=verdict,
        snapshot=obs.snapshot,
        total_override_mib=hd.host.gpu_memory_mib,
    )
    if held is None:
        return verdict
    return replace(verdict, decision=Decision.BUSY, reason=held, hint=HELD_BACK_HINT)


def _once(read: Callable[[], T]) -> Callable[[], T]:
    """``read`` called at most once; its answer (or its GpuctlError) kept for the rest."""
    got: list[T | GpuctlError] = []

    def call() -> T:
        if not got:
            try:
                got.append(read())
            except GpuctlError as e:
                got.append(e)
        if isinstance(got[0], GpuctlError):
            raise got[0]
        return got[0]

    return call


def _per_service(
    ask: Callable[[Any], int | None],
) -> Callable[[Any], int | None]:
    """``ask`` once per service name (two services that do not fit ask of the same
    victims); an error is asked again, and raised again."""
    known: dict[str, int | None] = {}

    def call(svc: Any) -> int | None:
        if svc.name not in known:
            known[svc.name] = ask(svc)
        return known[svc.name]

    return call


def status(deps: StatusDeps) -> StatusReport:
    """Status of every host in ``deps``. Never raises for a host that does not answer:
    that host is reported UNKNOWN with why."""
    config = deps.config
    started = deps.monotonic()
    taken_at = iso_utc(deps.clock())
    per_host = [config.services_on(hd.host.name) for hd in deps.hosts]
    healths_wanted = [s for services in per_host for s in services if _health_target(s, deps)]
    with _runner(len(deps.hosts) + len(healths_wanted)) as submit:
        seen: list[Future[Observation] | _Done[Observation]] = [
            submit(_observe_host, hd, services)
            for hd, services in zip(deps.hosts, per_host, strict=True)
        ]
        # By host and name: a pooled service is asked on each host of its pool.
        healths: dict[tuple[str, str], Future[Health] | _Done[Health]] = {}
        for hd, services in zip(deps.hosts, per_host, strict=True):
            counts_all = _ollama_others(services)
            for s in services:
                if _health_target(s, deps):
                    timeout = min(deps.health_timeout_s, hd.host.timeout_s)
                    healths[hd.host.name, s.name] = submit(
                        _health_of, deps, s, hd.host.ollama, timeout, counts_all.get(s.name)
                    )
        reports = []
        for hd, services, fut in zip(deps.hosts, per_host, seen, strict=True):
            obs = fut.result()
            timeout = min(deps.health_timeout_s, hd.host.timeout_s)
            hs = tuple(
                healths[hd.host.name, s.name].result()
                if (hd.host.name, s.name) in healths
                else _node_health(deps, s, obs, timeout)
                if names_node(s.health)
                else NO_HEALTH
                for s in services
            )
            now = deps.clock()
            # Read once per host, and only when asked: by a service that does not fit,
            # or a server idle past its yield_after.
            counts = _once(hd.read_inflight) if hd.read_inflight is not None else None
            in_flight = _per_service(deps.server_in_flight) if deps.server_in_flight else None
            judge = _judge(deps, hd, obs, services, now, counts=counts, in_flight=in_flight)
            verdicts = tuple(judge(s, hh) for s, hh in zip(services, hs, strict=True))
            idle = (
                yielding(obs, services, counts=counts, server_in_flight=in_flight, now=now)
                if counts is not None
                else {}
            )
            others = other_services(obs, services)
            jobs = tuple(job_specs(obs.records.values()))
            reports.append(
                HostReport(
                    name=hd.host.name,
                    source=hd.source,
                    snapshot=_counted_starting(obs, (*services, *jobs, *(o.spec for o in others))),
                    error=obs.error,
                    hint=obs.hint,
                    verdicts=verdicts,
                    services=tuple(services),
                    health=hs,
                    elapsed_s=deps.monotonic() - started,
                    gpu_memory_mib=hd.host.gpu_memory_mib,
                    servers=obs.servers,
                    memory=memory_use(obs, services, now, hd.host.gpu_memory_mib),
                    jobs=jobs,
                    others=others,
                    yielding=idle,
                )
            )
    return StatusReport(hosts=tuple(reports), taken_at=taken_at)


def _counted_starting(obs: Observation, specs: Sequence[Any]) -> Snapshot | None:
    """The snapshot with only the starting processes the decisions count as a service
    loading (``loading_owner``): the agent lists every process whose command line holds a
    keyword, and `python myvllmtools/bench.py` or `less notes-about-vllm.txt` is none."""
    snap = obs.snapshot
    if snap is None or not snap.starting:
        return snap
    kept = tuple(s for s in snap.starting if loading_owner(s, specs, obs.servers) is not None)
    return snap if len(kept) == len(snap.starting) else replace(snap, starting=kept)


def other_services(obs: Observation, services: Sequence[Any]) -> tuple[OtherService, ...]:
    """The services the host's records name and ``services`` do not, while they hold or
    promise memory: admission counts them (at their promise), so status shows them."""
    configured = {s.name for s in services}
    out = []
    for r in sorted(obs.records.values(), key=lambda r: r.service):
        if (
            r.service in configured
            or is_job(r.service)
            or not is_service_name(r.service)
            or not holds_memory(r)
        ):
            continue
        pids = tuple(sorted(pid for pid, n in obs.servers.items() if n == r.service))
        held = 0
        if obs.snapshot is not None:
            held = sum(p.memory_mib or 0 for p in obs.snapshot.gpu_processes if p.pid in pids)
        out.append(OtherService(r.service, r.phase.value, r.promise, pids, held))
    return tuple(out)


def watch(
    deps: StatusDeps,
    interval_s: float,
    show: Callable[[StatusReport], None],
    first: StatusReport | None = None,
) -> StatusReport:
    """Gather every ``interval_s`` and hand each report to ``show`` (``first``, when given,
    is already shown), until Ctrl-C (KeyboardInterrupt), which ends the watch and returns
    the last report."""
    report = first
    try:
        if report is None:
            report = status(deps)
            show(report)
        while True:
            deps.sleep(interval_s)
            report = status(deps)
            show(report)
    except KeyboardInterrupt:
        if report is None:
            raise
        return report


def filtered(
    report: StatusReport, *, only: Sequence[str] = (), users: Sequence[str] = ()
) -> StatusReport:
    """The report narrowed to some services (``--only``) and some users' processes
    (``--user``), as nvitop's filters narrow its view. The memory figures and the
    decisions stay those of the whole host: a filter hides rows, never memory."""
    if not only and not users:
        return report
    hosts = []
    for h in report.hosts:
        keep = [i for i, s in enumerate(h.services) if not only or s.name in only]
        snap = h.snapshot
        if snap is not None:
            snap = replace(
                snap,
                processes=tuple(p for p in snap.processes if _shown(h, p, only, users)),
                starting=None
                if snap.starting is None
                else tuple(s for s in snap.starting if _shown(h, s, only, users)),
            )
        hosts.append(
            replace(
                h,
                snapshot=snap,
                services=tuple(h.services[i] for i in keep),
                others=tuple(o for o in h.others if not only or o.name in only),
                verdicts=tuple(h.verdicts[i] for i in keep),
                health=tuple(h.health[i] for i in keep),
            )
        )
    words = tuple(f"only {n}" for n in only) + tuple(f"user {u}" for u in users)
    return replace(report, hosts=tuple(hosts), filters=words)


def _shown(
    h: HostReport, p: GpuProcess | StartingProcess, only: Sequence[str], users: Sequence[str]
) -> bool:
    if users and p.user not in users:
        return False
    if only:
        owner = h.owner(p.pid, p.command)
        return owner is not None and owner.name in only
    return True
