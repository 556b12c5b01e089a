"""A service's record and its lease, as plain data with pure rules.

The record is the one shared truth about a service on its GPU host: its phase, when it
was last used, who holds the right to start or stop it (the lease), how to find its
server again (the launcher's handle), its start attempts, and its last failure with the
back-off before the next try. The store (``gpuctl.adapters.store``) keeps it in a JSON
file under a per-service file lock, and decodes and validates it there
(``gpuctl.adapters.store.codec``); everything here is pure, plain data.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Final

import msgspec
from msgspec.structs import replace

from gpuctl.core.promise import Promise

RECORD_SCHEMA = 1
MAX_ATTEMPTS_KEPT = 10
# LocalAI's policy: 10 s after the first failure, doubling, at most 5 minutes.
BACKOFF_FIRST_S = 10.0
BACKOFF_MAX_S = 300.0
# A lease outlives the health timeout by this much, so a holder that waits through the
# whole cold start never loses it; one that dies loses it at expiry at the latest.
LEASE_MARGIN_S = 60.0
# Bounds of the record's schema (``gpuctl.adapters.store.codec``, ``core.record_shapes``).
TIME_MAX: Final = 4_102_444_800.0  # 2100-01-01T00:00:00Z
DURATION_MAX: Final = 10 * 365 * 86_400.0
# Free keys a handle or an attempt may carry beyond those gpuctl reads.
MAX_EXTRA_KEYS: Final = 32


class Phase(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    SLEEPING = "sleeping"
    STOPPING = "stopping"
    PREEMPTED = "preempted"
    FAILED = "failed"


class Holder(msgspec.Struct, frozen=True):
    """Who asks for a lease: a fresh id per call, and the process behind it.

    The pid with its start time and the host's boot id let a caller on the same host
    tell that the holder has died (``lease_state``); ``entry`` says which entry point
    (ensure, stop, the API, cron) asked, for people reading ``gpuctl locks``.
    """

    id: str
    host: str
    boot_id: str
    pid: int
    pid_start: float | None
    entry: str

    def lease(self, now: float, ttl_s: float) -> Lease:
        """This holder's lease, granted ``now`` for ``ttl_s`` seconds."""
        return Lease(
            self.id, self.host, self.boot_id, self.pid, self.pid_start, self.entry, now, now + ttl_s
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "boot_id": self.boot_id,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "entry": self.entry,
        }


class Lease(Holder, frozen=True):
    """The right to start (or stop) a service: its holder, and the term it was granted for.

    Only the holder launches. ``holder`` is the holder's id, the name the record file and
    the wire have always used.
    """

    granted: float
    expires: float

    @property
    def holder(self) -> str:
        return self.id

    def to_dict(self) -> dict[str, Any]:
        return {
            "holder": self.id,
            "host": self.host,
            "boot_id": self.boot_id,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "entry": self.entry,
            "granted": self.granted,
            "expires": self.expires,
        }


class Failure(msgspec.Struct, frozen=True):
    at: float
    error: str
    log_tail: str = ""
    count: int = 1
    backoff_until: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "error": self.error,
            "log_tail": self.log_tail,
            "count": self.count,
            "backoff_until": self.backoff_until,
        }


class Record(msgspec.Struct, frozen=True):
    """One service's record. ``recovered`` says why a broken record file was set aside
    (and where the copy is): a note on how it was read, not part of its state, so
    equality and hashing leave it out; ``start_nonce`` is the nonce the last start put in its
    server's environment (``GPUCTL_START_NONCE``), so a server whose pid was never
    recorded can still be found; ``health`` is the URL that tells the server answers;
    ``promise`` is what its last start promised (``Promise``), None in a record an older
    release wrote."""

    service: str
    phase: Phase = Phase.STOPPED
    since: float = 0.0
    last_used: float | None = None
    lease: Lease | None = None
    handle: dict[str, Any] | None = None
    attempts: tuple[dict[str, Any], ...] = ()
    failure: Failure | None = None
    recovered: str | None = None
    start_nonce: str | None = None
    health: str | None = None
    promise: Promise | None = None
    # A pool's record (``_pool.<service>`` on its coordinator): where its copy was
    # started, by host identity (``core.pool.host_key``).
    runs_on: str | None = None

    def _state(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self.__struct_fields__ if f != "recovered")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Record)
        return self._state() == other._state()

    def __hash__(self) -> int:
        return hash(self._state())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": RECORD_SCHEMA,
            "service": self.service,
            "phase": self.phase.value,
            "since": self.since,
            "last_used": self.last_used,
            "lease": self.lease.to_dict() if self.lease else None,
            "handle": self.handle,
            "attempts": list(self.attempts),
            "failure": self.failure.to_dict() if self.failure else None,
            "recovered": self.recovered,
            "start_nonce": self.start_nonce,
            "health": self.health,
            "promise": self.promise.to_dict() if self.promise else None,
            "runs_on": self.runs_on,
        }

    # ---- pure transitions (the store applies them under the lock)

    def with_phase(self, phase: Phase, now: float) -> Record:
        if phase is self.phase:
            return self
        return replace(self, phase=phase, since=now)

    def touched(self, now: float) -> Record:
        return replace(self, last_used=now)

    def used(self, now: float, *, ready: bool = False) -> Record:
        """A use (``gpuctl touch``, ``ensure``, a request): ``last_used = now``.

        ``ready``: the caller saw the server answer its health check, so a start still
        marked ``starting`` (its launcher was interrupted, or ran with ``--no-wait``) is
        complete. Nothing else changes the phase: a touch that raced a stop must not
        bring back a ``stopped``, ``preempted`` or ``failed`` record with no server.
        """
        out = self.touched(now)
        if ready and self.phase is Phase.STARTING:
            out = replace(out.with_phase(Phase.RUNNING, now), failure=None)
        return out

    def with_attempt(self, attempt: dict[str, Any]) -> Record:
        return replace(self, attempts=(*self.attempts, attempt)[-MAX_ATTEMPTS_KEPT:])

    def failed(
        self, now: float, error: str, log_tail: str = "", first_backoff_s: float = BACKOFF_FIRST_S
    ) -> Record:
        count = (self.failure.count + 1) if self.failure else 1
        return replace(
            self.with_phase(Phase.FAILED, now),
            failure=Failure(now, error, log_tail, count, now + backoff_s(count, first_backoff_s)),
        )

    def idle_for(self, now: float) -> float | None:
        ref = self.last_used if self.last_used is not None else None
        return None if ref is None else max(0.0, now - ref)


class SetAside(msgspec.Struct, frozen=True):
    """A record file that failed validation and was kept beside the records (its
    service then started afresh): for ``gpuctl locks`` to show until someone removes it."""

    service: str
    file: str  # its name in the records folder
    at: float  # when it was set aside
    size: int
    why: str  # where it failed the schema

    def to_dict(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "file": self.file,
            "at": self.at,
            "size": self.size,
            "why": self.why,
        }


class Listing(msgspec.Struct, frozen=True):
    """A host's records and its set-aside record files, read together (one ``GET
    /records``): a set-aside file can hide a start the fresh record no longer shows."""

    records: list[Record]
    set_aside: list[SetAside] = msgspec.field(default_factory=list)


def hidden_by_set_aside(
    service: str,
    record: Record | None,
    set_aside: Iterable[SetAside],
    timeout_s: float,
    now: float,
    *,
    own_holder: str | None = None,
) -> SetAside | None:
    """The set-aside file of ``service`` that may hide a start still loading unseen, or
    None.

    A record whose phase could not be salvaged (not JSON, a lease without a sound phase)
    starts afresh as ``stopped`` since the moment it was set aside (``codec.salvage``): if
    the file hid a start, its server may be reading weights with nothing to say so. That
    doubt lasts for the service's health timeout from the set-aside (``at`` is the second
    it happened in, floored), and ends earlier when a sound record is written after it: a
    phase other than ``stopped``, a phase change, or someone else's lease granted since
    (``own_holder``'s own lease proves nothing to itself). A salvage that kept a sound
    phase keeps its own ``since``, and that phase speaks for itself.
    """
    latest = max((a for a in set_aside if a.service == service), key=lambda a: a.at, default=None)
    if latest is None or now >= latest.at + 1.0 + timeout_s:
        return None
    after = latest.at + 1.0
    if record is not None:
        lease = record.lease
        if (
            record.phase is not Phase.STOPPED
            or not latest.at <= record.since < after
            or (lease is not None and lease.holder != own_holder and lease.granted >= after)
        ):
            return None
    return latest


# The key salvage adds to a handle it could not keep whole (``codec.salvage``): the names
# of the fields it dropped, comma-separated ("*": the handle was not an object). Such a
# handle may have lost the one field that finds its server (the pid of a record an
# older release wrote, with no start nonce to fall back on), so it means UNKNOWN until
# a start or a stop writes a sound one: never IDLE, which let a second copy start.
UNREADABLE_KEY = "unreadable"
# Phases in which a record's handle stands for a server that may run.
SERVER_PHASES = frozenset({Phase.STARTING, Phase.RUNNING, Phase.SLEEPING, Phase.STOPPING})


def unreadable_handle(record: Record | None) -> str | None:
    """The handle fields salvage dropped from a record of a server that may run, or
    None (a sound handle, or a phase with no server)."""
    if record is None or record.phase not in SERVER_PHASES or not record.handle:
        return None
    dropped = record.handle.get(UNREADABLE_KEY)
    return str(dropped) if dropped is not None else None


def backoff_s(count: int, first_s: float = BACKOFF_FIRST_S) -> float:
    """Back-off after ``count`` consecutive failed starts: 10 s, 20 s, 40 s … at most 5 min.
    ``first_s``: the first step (the store passes a test's override, else 10 s)."""
    if count <= 0:
        return 0.0
    # The exponent is capped: 2.0 ** 1024 overflows, and the count of a service that keeps
    # failing under cron grows without bound.
    return float(min(first_s * 2.0 ** min(count - 1, 64), BACKOFF_MAX_S))


# Each kind of lease's documented term, the longest any holder asks: one whose file says
# longer (or that expires further ahead than that) was not written by gpuctl, and is void
# (else a 7-day in-flight entry kept a server from ever being reclaimed, and a long
# ``_admission`` lease made every ``ensure`` time out). The agent refuses a longer one
# with a 400. In-flight entries renew every few seconds; ``_reclaim`` covers one pass;
# ``_admission`` covers a re-check and a spawn (see ``flows.admission``).
INFLIGHT_TTL_MAX_S = 30.0
# A *lingering* in-flight entry (its ``entry``): a holder whose last request has ended
# keeps the right to send the next one without writing first, for the entry's term
# (at most ``INFLIGHT_TTL_MAX_S``). It counts as no request in flight (status, the
# plans), but reclaim keeps the service and a preemption waits until it lapses, and
# its holder may turn it back into a counted entry even while a stop holds the
# service's lease (``adapters.store.inflight``): so a request its holder sent on its
# strength is never cut by a stop that did not wait for it. Never the other way under
# a stop: an entry ended then does not linger (a stop reads the lingering entries, then
# the counts, and must find in the second whatever left the first).
LINGER_ENTRY = "linger"
RECLAIM_TTL_MAX_S = 15 * 60.0
ADMISSION_TTL_MAX_S = 10.0
# By the pseudo-service the lease is on (a service's own lease: its holder chooses,
# within the wire's bound).
TERM_MAX_S: dict[str, float] = {"_reclaim": RECLAIM_TTL_MAX_S, "_admission": ADMISSION_TTL_MAX_S}
# Float rounding of ``granted + ttl`` and a small clock step on the host.
TERM_SLACK_S = 1.0


def overlong(lease: Lease, now: float, longest: float | None) -> bool:
    """A lease whose term is longer than ``longest`` (its kind's documented term), or that
    expires further ahead than that from ``now`` (a grant in the future)."""
    if longest is None:
        return False
    most = longest + TERM_SLACK_S
    return lease.expires - lease.granted > most or lease.expires - now > most


def void_why(
    lease: Lease, now: float, *, here_host: str, here_boot_id: str, longest: float | None
) -> str | None:
    """Why gpuctl never wrote this lease (or in-flight or queue entry) as it stands, so
    it counts for nothing whoever holds it; None: it may be sound. What ``gpuctl locks``
    shows for each one voided.

    pid 1 is never a gpuctl holder (it would be alive for ever), and every holder on
    this host records its start time (the pid-reuse check): without it, it is forged.
    A term longer than its kind's documented one is forged wherever it was taken.
    """
    if lease.host == here_host and lease.boot_id == here_boot_id:
        if lease.pid == 1:
            return "holder at pid 1"
        if lease.pid_start is None:
            return "holder without a start time on this host"
    if overlong(lease, now, longest):
        assert longest is not None
        return f"term longer than {longest:.0f} s"
    return None


class Voided(msgspec.Struct, frozen=True):
    """A lease or an entry found forged (``void_why``), for ``gpuctl locks`` to show.

    ``kind``: ``lease`` (a record's, ``_reclaim``'s or ``_admission``'s), ``inflight``
    or ``queue``; ``service``: the record, the in-flight entry's service, or ``_queue``;
    ``file``: where it is, under the state folder; ``at``: when it was set aside (a
    lease still in its record: when it was granted). A summary row (``kind`` ``more``)
    counts the copies not read.
    """

    kind: str
    service: str
    file: str
    host: str
    pid: int
    at: float
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "service": self.service,
            "file": self.file,
            "host": self.host,
            "pid": self.pid,
            "at": self.at,
            "why": self.why,
        }


class LeaseState(StrEnum):
    NONE = "none"
    LIVE = "live"
    EXPIRED = "expired"
    VOID = "void"  # its holder's process is known to be dead


def lease_state(
    lease: Lease | None,
    now: float,
    *,
    here_host: str,
    here_boot_id: str,
    holder_alive: bool | None,
    longest: float | None = None,
) -> LeaseState:
    """Is this lease still in force? ``longest``: its kind's documented term (one longer
    is void: ``overlong``).

    ``holder_alive`` is what the caller found for the holder's pid (and start time) on
    *this* machine; it only counts when the lease was taken on this machine (same
    hostname and boot id): nobody else can know that pid is dead.
    """
    if lease is None:
        return LeaseState.NONE
    same_host = lease.host == here_host and lease.boot_id == here_boot_id
    if same_host and holder_alive is False:
        return LeaseState.VOID
    if void_why(lease, now, here_host=here_host, here_boot_id=here_boot_id, longest=longest):
        return LeaseState.VOID
    if now >= lease.expires:
        return LeaseState.EXPIRED
    return LeaseState.LIVE


# A lease taken by these entry points is a stop under way: no new use may begin. A
# preemptor's lease on its victim is one: it has checked that nothing is in flight, and
# a use begun after that check would be cut by the stop that follows.
STOP_ENTRIES = frozenset({"stop", "reclaim", "preempt"})


def stopping(record: Record) -> bool:
    """Whether the record's (effective) lease is a stop under way."""
    return record.lease is not None and record.lease.entry in STOP_ENTRIES


def in_backoff(record: Record | None, now: float) -> bool:
    return bool(
        record
        and record.failure
        and now < record.failure.backoff_until
        and record.phase is Phase.FAILED
    )


# What a start failure keeps: one message, and the end of the server's log. A server
# that printed a megabyte of progress bars must not make its record unwritable.
ERROR_MAX = 4096
LOG_TAIL_MAX = 16384


def clip(text: str, limit: int = ERROR_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def starting_services(records: Iterable[Record], exclude: str = "") -> list[str]:
    """Services whose admitted start promises memory before its server exists: a live
    lease on a record in phase ``starting`` (set under the admission lock before the
    spawn, or by a preemption before its victims give their memory back) or one that
    holds memory already (a stop's lease, until the memory comes back). ``exclude``: the
    service being decided (its own lease never counts against itself).

    A lease on a record that holds nothing yet and states its promise is a caller on its
    way to the admission lock, which re-checks under it before it spawns: it counts for
    nothing, so of two rivals the first admitted starts and the other then finds it
    (counting each other's waiting leases refused callers of the one that started). A
    record without a promise (an older release, which may spawn without ``starting``)
    counts whatever its phase."""
    return [
        r.service
        for r in records
        if r.lease is not None
        and r.service != exclude
        and not (
            r.promise is not None
            and (
                r.phase in (Phase.STOPPED, Phase.FAILED)
                or (r.phase is Phase.PREEMPTED and not r.handle)
            )
        )
    ]
