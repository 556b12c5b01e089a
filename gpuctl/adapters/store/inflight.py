"""In-flight counts: who is using a service right now, in the store.

Layout::

    <state_dir>/inflight/<service>/<holder id>.json   one holder's entry (a lease's shape)

An entry says "this holder has at least one request in flight on this service". The
holder keeps its own count in memory and writes only when that count moves between 0
and at least 1 (``begin`` / ``end``), plus a ``renew`` every few seconds while busy, so
a busy caller never takes a file lock per request. Like a lease, an entry is tied to
its holder's pid, start time and boot id: on the same host a holder killed with
``kill -9`` leaves an entry that counts for nothing (and the next reader deletes it);
from elsewhere (through the agent) it counts until it expires.

``begin`` takes the service's file lock: it is ordered against a stop's lease. While
``gpuctl stop`` or ``gpuctl reclaim`` holds the lease, ``begin`` is refused (the caller
waits and goes on once the stop is over), and whatever ``begin`` wrote before the stop
took its lease, the stop sees when it checks again under the lease. So a request is
either counted before the stop decides, or starts after it: never cut.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from msgspec.structs import replace

from gpuctl.adapters.store.base import _NAME, check_name, judged_here
from gpuctl.adapters.store.codec import RecordError, decode_lease, parse_json
from gpuctl.adapters.store.files import Folder, set_aside_junk
from gpuctl.adapters.store.voided import set_aside_void
from gpuctl.core.record import (
    INFLIGHT_TTL_MAX_S,
    LINGER_ENTRY,
    Holder,
    Lease,
    LeaseState,
    Record,
    stopping,
)
from gpuctl.errors import StoreError, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    class _Files(Protocol):
        """What the mixin uses of ``DirectStore``."""

        state_dir: Path
        clock: Callable[[], float]

        def _locked(self, service: str) -> Any: ...
        def _read(self, service: str) -> Record: ...
        def modes(self) -> tuple[int, int]: ...
        def _write(self, record: Record) -> None: ...
        def _effective(self, rec: Record) -> tuple[Record, LeaseState]: ...
        def _keep_void(self, on_disk: Record) -> None: ...
        def _entry_path(self: _Files, service: str, holder_id: str) -> Path: ...
        def _inflight_dir(self, service: str) -> Path: ...
        def _write_entry(self: _Files, service: str, entry: Lease) -> None: ...
        def _entries(self, service: str, create: bool = False) -> Folder: ...


_MAX_ENTRY_BYTES = 4096


class InflightFiles:
    """The in-flight entries of a ``DirectStore`` (mixed into it)."""

    def _inflight_dir(self: _Files, service: str) -> Path:
        return self.state_dir / "inflight" / check_name(service)

    def _entry_path(self: _Files, service: str, holder_id: str) -> Path:
        if (
            not holder_id
            or not holder_id.isalnum()
            or not holder_id.isascii()
            or len(holder_id) > 64
        ):
            # A usage error (400 on the wire): the id names a file, so it is checked whole.
            raise UsageError(f"bad in-flight holder id {holder_id[:80]!r}: letters and digits only")
        return self._inflight_dir(service) / f"{holder_id}.json"

    def inflight_begin(
        self: _Files, service: str, holder: Holder, ttl_s: float
    ) -> tuple[bool, Record]:
        """Count ``holder`` as using ``service`` (its 0 → 1), and mark it used.

        Returns (granted, record): not granted while a stop holds the lease.
        """
        _check_ttl(ttl_s)
        lock = self._locked(service)
        try:
            on_disk = self._read(service)
            rec, state = self._effective(on_disk)
            if state is LeaseState.VOID:
                self._keep_void(on_disk)  # its write below drops the lease
            if stopping(rec):
                if not _lingers(self, service, holder.id):
                    return False, rec
                # Its lingering entry made the stop wait (or it is a person's stop,
                # which waits for nobody): counted again, the record left to the stop.
                self._write_entry(service, holder.lease(self.clock(), ttl_s))
                return True, rec
            self._write_entry(service, holder.lease(self.clock(), ttl_s))
            rec = replace(rec.touched(self.clock()), recovered=None)
            self._write(rec)
            return True, rec
        finally:
            lock.release()

    def inflight_renew(self: _Files, service: str, holder: Holder, ttl_s: float) -> Record:
        """Keep ``holder``'s entry alive and mark the service used (every few seconds)."""
        _check_ttl(ttl_s)
        lock = self._locked(service)
        try:
            self._write_entry(service, holder.lease(self.clock(), ttl_s))
            rec = self._read(service)
            if not stopping(self._effective(rec)[0]):
                rec = rec.touched(self.clock())
                self._write(replace(rec, recovered=None))
            return self._effective(rec)[0]
        finally:
            lock.release()

    def inflight_end(self: _Files, service: str, holder_id: str, linger_s: float = 0.0) -> Record:
        """``holder_id`` has nothing in flight any more (its 1 → 0): the idle clock starts.
        ``linger_s``: its live entry (counted, or lingering already) stays that long from
        now as a lingering one (``LINGER_ENTRY``); a lapsed one is not brought back.

        Never while a stop holds the lease (the record returned says so: ``stopping``):
        then a counted entry ends, and a lingering one stands as it is. A stop reads the
        lingering entries, then the counts: under its lease an entry may turn from
        lingering to counted (its holder's request), never back, so a request counted
        after the first read is in the second."""
        _check_ttl(linger_s)
        lock = self._locked(service)
        try:
            rec = self._read(service)
            stops = stopping(self._effective(rec)[0])
            path = self._entry_path(service, holder_id)
            with contextlib.suppress(FileNotFoundError), self._entries(service) as folder:
                now = self.clock()
                entry = _read_entry(folder, path.name, now) if linger_s else None
                if entry is None or judged_here(entry, now, INFLIGHT_TTL_MAX_S)[0] is not (
                    LeaseState.LIVE
                ):
                    folder.unlink(path.name)
                elif not stops:
                    # Counted, or lingering already (then its term starts again).
                    soft = replace(entry, entry=LINGER_ENTRY, granted=now, expires=now + linger_s)
                    self._write_entry(service, soft)
                elif entry.entry != LINGER_ENTRY:
                    folder.unlink(path.name)  # counted, under a stop: it ends
                # else: lingering under a stop, it lapses as it stands
            if not stops:
                rec = rec.touched(self.clock())
                self._write(replace(rec, recovered=None))
            return self._effective(rec)[0]
        except OSError as e:
            raise StoreError(f"cannot end the in-flight entry of {service!r}: {e}") from None
        finally:
            lock.release()

    def inflight(self: _Files) -> dict[str, int]:
        """Live in-flight holders per service (services with none are left out); a
        lingering entry is none (``lingering``)."""
        return _scan(self)[0]

    def lingering(self: _Files) -> dict[str, float]:
        """Per service with live lingering entries (``LINGER_ENTRY``), the seconds until
        the last of them lapses."""
        return _scan(self)[1]

    def _entries(self: _Files, service: str, create: bool = False) -> Folder:
        """The service's in-flight folder, reached without following links."""
        mode = self.modes()[0] if create else None
        return Folder(self.state_dir, "inflight", check_name(service), create=mode)

    def _write_entry(self: _Files, service: str, entry: Lease) -> None:
        path = self._entry_path(service, entry.id)
        try:
            with self._entries(service, create=True) as folder:
                data = json.dumps(entry.to_dict(), sort_keys=True).encode()
                folder.write(path.name, data, self.modes()[1])
        except OSError as e:
            raise StoreError(
                f"cannot write {path}: {e.strerror or e}",
                hint=f"{path.parent} must be a folder (not a link) writable by this user",
            ) from None


def _scan(store: _Files) -> tuple[dict[str, int], dict[str, float]]:
    """Live in-flight entries per service: the counted ones, and for lingering ones the
    seconds until the last lapses.

    Read without locks; entries whose holder is dead on this host are deleted; forged
    ones (``core.record.void_why``: a term longer than ``INFLIGHT_TTL_MAX_S``, a holder
    at pid 1 or without a start time) are set aside once (``<name>.void-<time>``, kept
    for ``gpuctl locks`` to show); a file that is not a sound entry is set aside once
    (``<name>.corrupt-<time>``, kept for a person) and logged once.
    """
    base = store.state_dir / "inflight"
    try:
        with Folder(store.state_dir, "inflight") as top:
            services = [n for n in top.names() if _NAME.fullmatch(n) and not top.is_link(n)]
    except FileNotFoundError:
        return {}, {}
    except OSError as e:
        raise StoreError(
            f"cannot read {base}: {e.strerror or e}",
            hint=f"{base} must be a folder (not a link) readable by this user",
        ) from None
    now = store.clock()
    counts: dict[str, int] = {}
    lingering: dict[str, float] = {}
    for service in services:
        n = 0
        try:
            folder = Folder(store.state_dir, "inflight", service)
        except OSError:
            continue  # a file, or a link (set aside now): no entries
        with folder:
            for name in folder.names():
                if not name.endswith(".json"):
                    continue
                entry = _read_entry(folder, name, now)
                if entry is None:
                    continue
                state, why = judged_here(entry, now, INFLIGHT_TTL_MAX_S)
                if state is LeaseState.LIVE:
                    if entry.entry == LINGER_ENTRY:
                        # Told within its documented term (a step of the clock, or
                        # the slack a term is allowed, may leave a little more): a
                        # reader refuses a longer one. It is read again, not waited out.
                        left = min(entry.expires - now, INFLIGHT_TTL_MAX_S)
                        lingering[service] = max(lingering.get(service, 0.0), left)
                    else:
                        n += 1
                elif state is LeaseState.VOID:
                    # Nothing is in flight either way. A forged entry is kept for a
                    # person (``gpuctl locks`` shows it); a dead holder's is deleted.
                    if why is not None:
                        set_aside_void(folder, name, now, why)
                    else:
                        with contextlib.suppress(OSError):
                            folder.unlink(name)
        if n:
            counts[service] = n
    return counts, lingering


def _lingers(store: _Files, service: str, holder_id: str) -> bool:
    """Whether ``holder_id`` has a live lingering entry on ``service`` (under its lock)."""
    now = store.clock()
    try:
        with store._entries(service) as folder:
            entry = _read_entry(folder, store._entry_path(service, holder_id).name, now)
    except OSError:
        return False
    if entry is None or entry.entry != LINGER_ENTRY:
        return False
    return judged_here(entry, now, INFLIGHT_TTL_MAX_S)[0] is LeaseState.LIVE


def _check_ttl(ttl_s: float) -> None:
    """Refuse an entry longer than its documented term, or a negative one (400 on the
    wire)."""
    if not 0 <= ttl_s <= INFLIGHT_TTL_MAX_S:
        raise UsageError(
            f"an in-flight entry lasts at most {INFLIGHT_TTL_MAX_S:.0f}s, not {ttl_s}s"
        )


def _read_entry(folder: Folder, name: str, now: float) -> Lease | None:
    """An entry, or None when it is not one: a hostile file counts for nothing rather
    than crashing every reader, and is set aside once (kept for a person, logged once),
    never read again."""
    try:
        raw = folder.read(name, _MAX_ENTRY_BYTES)  # never a link, never a FIFO's open
        entry = decode_lease(parse_json(raw, _MAX_ENTRY_BYTES))
        if entry.holder != name[: -len(".json")]:
            raise RecordError("$.holder", "names another holder than its file")
    except FileNotFoundError:
        return None
    except (OSError, RecordError) as e:
        set_aside_junk(folder, name, now, e)
        return None
    return entry
