"""``stop``, ``touch`` and ``locks``: the other uses of a service's record."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime

from msgspec.structs import replace

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.store.base import Store
from gpuctl.config import Config
from gpuctl.core.decision import loading_match, owns
from gpuctl.core.jobs import finished_long_ago
from gpuctl.core.pool import gathered, pool_record, pool_service
from gpuctl.core.queue import Waiter
from gpuctl.core.record import Phase, Record, SetAside, Voided, hidden_by_set_aside
from gpuctl.core.record_pids import recorded_servers
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import GpuctlError, StoreError, Undecided, Unproven
from gpuctl.flows import story
from gpuctl.flows.deps import EnsureDeps, LocksDeps, describe_handle
from gpuctl.flows.heal import heal, health_timeouts, repair_lines
from gpuctl.flows.look import hidden_words, keywords
from gpuctl.flows.op_results import LocksReport, StopResult, TouchResult
from gpuctl.flows.ports import Machine

STOP_LEASE_WAIT_S = 10.0


def stop(deps: EnsureDeps, entry: str = "stop") -> StopResult:
    """Stop the service's server: by its record, else by its match keywords on the host.

    Takes the lease first (waiting a little for a start under way), so a stop and a
    start never run at once. Only a server carrying its start's proof is signalled
    (``Launcher.stop``); anything else is reported and its record kept as it was.

    ``entry`` names who stops it (the CLI's ``stop``, the web view's ``ui``), in its
    lease and its journal event.

    Raises:
        Unproven: the record (or a keyword match) names a process without that proof.
    """
    svc = deps.service
    holder = deps.machine.holder(entry)
    deadline = deps.clock() + STOP_LEASE_WAIT_S
    while True:
        granted, record = deps.store.acquire(
            svc.name, holder, STOP_LEASE_WAIT_S + svc.stop_timeout_s + 30
        )
        if granted:
            break
        if deps.clock() >= deadline:
            lease = record.lease
            who = f"{lease.entry} pid {lease.pid} on {lease.host}" if lease else "someone"
            raise StoreError(
                f"{svc.name} is being started or stopped by {who}",
                hint="wait for it to finish (gpuctl locks shows it), then stop again",
            )
        deps.sleep(0.25)
    result = StopResult(svc.name, deps.host.name)
    try:
        aside = _hidden_start(deps, record, holder.id)
        if aside is None:
            # (Not while a set-aside record may hide a start: a phase written now would
            # end that doubt, and a rival would be let in beside a server still loading.)
            deps.store.update(svc.name, holder.id, RecordUpdate(phase=Phase.STOPPING))
        # Read after taking the lease, and fresh: a reading cached from before another
        # stop names pids that stop has ended (and the kernel may have handed on).
        snapshot = None
        with contextlib.suppress(GpuctlError):
            pid = (record.handle or {}).get("pid")
            snapshot = deps.probe.fresh()(keywords([svc]), [pid] if isinstance(pid, int) else [])
        launcher = deps.launchers.own(snapshot)
        # A handle that names no server (salvaged from a broken record) is no handle: its
        # start nonce still finds the server, below.
        handle = Handle.from_dict(record.handle) if record.handle else None
        if handle is not None and handle.locates and launcher.alive(handle) is not False:
            try:
                launcher.stop(handle, svc.stop_timeout_s, svc.name)
            except Unproven as e:
                raise Unproven(f"{svc.name}: {e.message}; not signalled", e.hint) from None
            result.stopped.append(describe_handle(handle))
        if not result.stopped:
            found = launcher.find(svc, record.start_nonce)
            if found is not None:
                launcher.stop(found, svc.stop_timeout_s, svc.name)
                result.stopped.append(describe_handle(found))
        if snapshot is not None and not result.stopped:
            # A server whose launcher died before it could record it: find it by keywords.
            # Only then: a keyword also matches, say, the shell that typed `gpuctl ensure X`.
            # Never a process another record names (another service's server, a
            # `gpuctl run` job's CMD), whatever its command line carries: it is theirs.
            servers = _recorded_elsewhere(deps, svc.name)
            seen: list[tuple[int, float | None]] = [
                (p.pid, None)
                for p in snapshot.processes
                if owns(svc, p.command) and p.pid not in servers
            ]
            if record.phase is Phase.STARTING or aside is not None:
                # A launch was under way and nothing recorded its server: it may still
                # be reading weights, off the GPU. Otherwise a keyword match off the GPU
                # is more likely a `tail -f` of its log than a server: left alone.
                seen += [
                    (s.pid, s.age_s)
                    for s in snapshot.starting or ()
                    if loading_match(svc, s, servers)
                ]
            taken = _epoch(snapshot.taken_at)
            ages: dict[int, float | None] = {}
            for pid, age in seen:
                ages[pid] = age if age is not None else ages.get(pid)
            unproven: list[str] = []
            for pid, age in ages.items():
                # The pid with the start time the reading saw (its age), so a pid the
                # kernel has handed to another process since is never signalled.
                started = taken - age if taken is not None and age is not None else None
                handle = Handle(kind=launcher.kind, pid=pid, pid_start=started)
                local = launcher.kind == "process"
                if started is None and local and not _started_before(deps.machine, pid, taken):
                    continue
                if launcher.alive(handle) is False:
                    continue  # gone since the reading: not ours to report
                try:
                    # A keyword match carries no recorded proof: the launcher signals
                    # it only where it can prove it (never a bare pid it would have to
                    # take on the command line's word: that may be another user's).
                    launcher.stop(handle, svc.stop_timeout_s, svc.name)
                except Unproven:
                    unproven.append(str(pid))
                    continue
                result.stopped.append(f"pid {pid}")
            if unproven and not result.stopped:
                raise Unproven(
                    f"{svc.name}: pid {', '.join(unproven)} match its keywords but carry no "
                    "proof that gpuctl started them; not signalled",
                    "if they are its servers, stop them by hand; then `gpuctl stop` "
                    "clears its record",
                )
        if aside is not None and not result.stopped:
            reason, hint = hidden_words(svc, aside)
            raise Undecided(f"{svc.name}: found nothing of it running, but {reason}", hint=hint)
        result.reason = (
            f"stopped {', '.join(result.stopped)}"
            if result.stopped
            else "nothing of it was running"
        )
        # A stop that found it stopped and nothing running changed nothing: no event (the
        # journal, and usage's count of stops, hold what happened).
        changed = bool(result.stopped) or record.phase is not Phase.STOPPED
        deps.store.release(
            svc.name,
            holder.id,
            RecordUpdate(phase=Phase.STOPPED, handle=None),
            event=story.ev(
                "stop",
                svc.name,
                entry,
                cause="manual",
                before=record.phase,
                after=Phase.STOPPED,
                reason=result.reason,
            )
            if changed
            else None,
        )
    except Unproven:
        # Nothing was signalled: the record stays as it was, for a person to judge.
        with contextlib.suppress(GpuctlError):
            deps.store.release(svc.name, holder.id, RecordUpdate(phase=record.phase))
        raise
    except BaseException:
        with contextlib.suppress(GpuctlError):
            deps.store.release(svc.name, holder.id)
        raise
    return result


def _recorded_elsewhere(deps: EnsureDeps, name: str) -> dict[int, str]:
    """``{pid: record}`` for the processes other records name (empty if unreadable)."""
    try:
        records = deps.store.records()
    except GpuctlError:
        return {}
    return {pid: n for pid, n in recorded_servers(records).items() if n != name}


def _hidden_start(deps: EnsureDeps, record: Record, holder_id: str) -> SetAside | None:
    """The set-aside record file that may hide a start of the service still loading
    (``core.record.hidden_by_set_aside``); None when there is none or it cannot be read."""
    try:
        kept = deps.store.set_aside()
    except GpuctlError:
        return None
    svc = deps.service
    return hidden_by_set_aside(
        svc.name, record, kept, svc.health_timeout_s, deps.clock(), own_holder=holder_id
    )


def _epoch(iso: str) -> float | None:
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def _started_before(machine: Machine, pid: int, taken: float | None) -> bool:
    """Whether ``pid``, a process on this machine, started before the reading that
    listed it (True where that cannot be told)."""
    if taken is None:
        return True

    started = machine.start_time(pid)
    return started is None or started <= taken + 0.5


def touch(deps: EnsureDeps) -> TouchResult:
    """Mark the service used now. A server that answers its health check completes a
    ``starting`` record (left by ``--no-wait`` or a killed launcher) to ``running``."""
    ready = deps.servers.health().ok
    svc = deps.service
    return TouchResult(svc.name, deps.store.touch(svc.name, ready=ready, promise=svc.promise()))


# A record in one of these phases says a copy is there, answering or not yet.
_THERE = (Phase.STARTING, Phase.RUNNING, Phase.SLEEPING)


def touch_pool(members: Sequence[EnsureDeps]) -> TouchResult:
    """Mark a pooled service used where its copy runs: the host of its pool where it
    answers its health check (READY), else one whose record says it is there (LOADING,
    asleep, or not answering yet). ``members``: one per host of the pool, in its order.

    Raises:
        GpuctlError: it runs on no host of the pool (exit 1, with the fix), or a host
            that could not be asked may hold it (that host's error: UNKNOWN).
    """
    unasked: tuple[str, GpuctlError] | None = None
    there: EnsureDeps | None = None
    for deps in members:
        try:
            if deps.servers.health().ok:
                return _touched(deps, ready=True)
            if there is None and deps.store.get(deps.service.name).phase in _THERE:
                there = deps
        except GpuctlError as e:
            unasked = unasked or (deps.host.name, e)
    name = members[0].service.name
    if there is not None:
        return _touched(there, ready=False)
    if unasked is not None:
        # The error alone names a URL; the line names the host and why it matters.
        host, cause = unasked
        err = GpuctlError(
            f"{name}: host {host} could not be asked, and it may run there "
            f"(no other host of its pool has it): {cause.message}",
            hint=cause.hint,
        )
        err.exit_code = cause.exit_code
        raise err
    where = ", ".join(d.host.name for d in members)
    raise GpuctlError(
        f"{name} runs on no host of its pool ({where}): nothing to mark as used",
        hint=f"`gpuctl ensure {name}` starts it; --host HOST marks it on one host",
    )


def _touched(deps: EnsureDeps, *, ready: bool) -> TouchResult:
    svc = deps.service
    rec = deps.store.touch(svc.name, ready=ready, promise=svc.promise())
    return TouchResult(svc.name, rec, host=deps.host.name)


def locks(deps: LocksDeps, *, finished: bool = False) -> LocksReport:
    """Every configured service's record on each host (a host that fails is reported),
    the record files each store set aside as unreadable, each host's wait queue, and the
    leases and entries it found forged (voided).

    The records of ``gpuctl run`` jobs that ended more than an hour ago are counted, not
    listed, unless ``finished`` (``core.jobs.finished_long_ago``)."""
    now = deps.clock()
    hidden = 0
    rows: list[tuple[str, Record | None, str | None]] = []
    aside: list[tuple[str, SetAside]] = []
    hints: dict[str, str | None] = {}
    queue: list[tuple[str, Waiter]] = []
    voided: list[tuple[str, Voided]] = []
    repaired: list[tuple[str, str]] = []
    for h in deps.hosts:
        names = [s.name for s in deps.config.services_on(h.name)]
        try:
            store = deps.store_of(h)
            listed = store.records()
            if deps.look_of is not None:
                # A record that lies about its server (a killed preemptor's leftovers, a
                # server gone on its own) is healed before it is shown, so `locks` never
                # lists as starting a start nobody is making.
                timeouts = health_timeouts(deps.config)
                repairs = heal(
                    store,
                    listed,
                    deps.look_of(h),
                    "locks",
                    new_holder=deps.machine.holder,
                    clock=deps.clock,
                    abandoned_after=timeouts,
                )
                repaired += [(h.name, line) for line in repair_lines(h.name, repairs)]
                if repairs:
                    listed = store.records()
            recs = {r.service: r for r in listed}
            kept = store.set_aside()
            queue += [(h.name, w) for w in store.waiters()]
        except GpuctlError as e:
            rows.append((h.name, None, e.message))
            hints[h.name] = e.hint
            continue
        # Only `locks` asks (it reads every record again, and the kept copies): `status`
        # never pays for it. An agent older than this list answers 404: it lists none.
        with contextlib.suppress(GpuctlError):
            voided += [(h.name, v) for v in store.voided()]
        aside += [(h.name, a) for a in kept]
        last_kept = {a.service: a for a in sorted(kept, key=lambda a: a.at)}
        for n in names:
            rows.append((h.name, _with_note(recs.pop(n, Record(service=n)), last_kept), None))
        rows += [(h.name, r, None) for r in _pool_locks(store, deps.config, h.name, now)]
        for r in recs.values():  # records of services no longer configured, and jobs
            noted = _with_note(r, last_kept)
            if not finished and finished_long_ago(noted, now):
                hidden += 1
                continue
            rows.append((h.name, noted, None))
    configured = {(h.name, s.name) for h in deps.hosts for s in deps.config.services_on(h.name)}
    pools = deps.config.pools()
    return LocksReport(
        gathered(rows, _row_place, pools),
        now,
        aside,
        hints,
        queue,
        hidden_jobs=hidden,
        repaired=repaired,
        voided=voided,
        configured=configured,
        pools=pools,
    )


def _pool_locks(store: Store, config: Config, host: str, now: float) -> list[Record]:
    """The pools' start locks held on ``host`` (``_pool.NAME``, on the pool's
    coordinator): a start across the pool is under way while one is held. The record
    itself is bookkeeping, so an unheld one is not listed."""
    out = []
    for name, hosts in config.pools().items():
        if host not in hosts:
            continue
        rec = store.get(pool_record(name))
        if rec.lease is not None and rec.lease.expires > now:
            out.append(rec)
    return out


def _row_place(row: tuple[str, Record | None, str | None]) -> tuple[str, str]:
    """A locks row's service (a pool's record: its service) and host."""
    host, rec, _ = row
    if rec is None:
        return "", host
    return pool_service(rec.service) or rec.service, host


def _with_note(record: Record, kept: dict[str, SetAside]) -> Record:
    """The record, noting the last copy of it that was set aside (while that copy is kept)."""
    a = kept.get(record.service)
    if a is None or record.recovered:
        return record
    return replace(record, recovered=f"record was unreadable ({a.why}); kept as {a.file}")
