"""``DirectStore``: the records on this machine's file system (the GPU host).

Layout::

    <state_dir>/records/<service>.json   the record (atomic replace)
    <state_dir>/records/<service>.json.corrupt-<time>   a record that failed the schema, kept
    <state_dir>/locks/<service>.lock     its flock (the file's mtime means nothing)
    <state_dir>/logs/<service>.log       the process launcher's server log
    <state_dir>/queue/<holder id>.json   a ``gpuctl run --wait`` waiter (``queue``)

File modes, whatever the umask: folders 0700 and files 0600 for one user. When the
state folder is shared by a group (its setgid bit is set, or its group is named
``gpuctl``: ``install -d -m 2770 -g gpuctl /var/lib/gpuctl``), folders are 2770 and
files 0660, so every member can take leases and nobody else can read them.
"""

from __future__ import annotations

import errno
import logging
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from gpuctl import failpoints
from gpuctl.adapters import procinfo
from gpuctl.adapters.store.base import _NAME, LOCK_TIMEOUT_S, check_name, judged_here
from gpuctl.adapters.store.codec import (
    RecordError,
    check_record,
    encode_record,
    parse_record,
    salvage,
)
from gpuctl.adapters.store.files import (
    Folder,
    FolderLock,
    NotAFile,
    folder_modes,
    make_state_dirs,
    set_aside_name,
)
from gpuctl.adapters.store.inflight import InflightFiles
from gpuctl.adapters.store.queue import QueueFiles
from gpuctl.adapters.store.voided import PSEUDO_LEASES, VOID_SUFFIX
from gpuctl.adapters.store.voided import voided as list_voided
from gpuctl.core.promise import Promise
from gpuctl.core.record import (
    BACKOFF_FIRST_S,
    TERM_MAX_S,
    Holder,
    LeaseState,
    Listing,
    Phase,
    Record,
    SetAside,
    Voided,
    clip,
    stopping,
)
from gpuctl.core.record_pids import pid_is_here
from gpuctl.core.record_shapes import RecordUpdate, apply_update
from gpuctl.errors import StoreError, UsageError

if TYPE_CHECKING:
    from gpuctl.core.events import Event
    from gpuctl.core.usage import Tally

log = logging.getLogger("gpuctl.store")


class DirectStore(InflightFiles, QueueFiles):
    """The records on this machine's file system."""

    def __init__(self, state_dir: Path, clock: Any = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.clock = clock
        self._modes: tuple[int, int] | None = None  # (folders, files), once known

    # ---- the journal (``adapters.store.journal``): a witness, never a gate

    def note(self, *events: Event) -> None:
        """Write ``events`` to the host's journal; never fails (``journal.write``)."""
        if events:
            from gpuctl.adapters.store.journal import journal_for

            journal_for(self.state_dir).write(*events)

    def prune_journal(self) -> None:
        """Retention without an agent (``reclaim`` calls it): old events fold into daily
        rows (``Journal.maintain``); never raises."""
        from gpuctl.adapters.store.journal import journal_for

        journal_for(self.state_dir).maintain()

    def events(
        self, since: float, *, service: str | None = None, after_id: int = 0
    ) -> list[tuple[int, Event]]:
        """This host's journal from ``since``, oldest first (StoreError when unreadable)."""
        import sqlite3

        from gpuctl.adapters.store.journal import journal_for

        try:
            return journal_for(self.state_dir).read(since, service=service, after_id=after_id)
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot read the journal in {self.state_dir}: {e}") from None

    def usage(self, since: float) -> dict[tuple[str, str, str], Tally]:
        """This host's usage rows from ``since`` (``core.usage``), keyed (day, service,
        user) (StoreError when unreadable)."""
        import sqlite3

        from gpuctl.adapters.store.journal import journal_for

        try:
            return journal_for(self.state_dir).usage(since)
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot read the journal in {self.state_dir}: {e}") from None

    # ---- files

    def _paths(self, service: str) -> tuple[Path, Path]:
        check_name(service)
        return (
            self.state_dir / "records" / f"{service}.json",
            self.state_dir / "locks" / f"{service}.lock",
        )

    def modes(self) -> tuple[int, int]:
        """(folder mode, file mode) for this state folder."""
        if self._modes is None:
            self._modes = folder_modes(self.state_dir)
        return self._modes

    def _ensure_dirs(self) -> None:
        """The subfolders, with their modes (``files.make_state_dirs``)."""
        make_state_dirs(self.state_dir, self.modes()[0])

    def _load(self, service: str, folder: Folder | None = None) -> Record | str:
        """The record on disk checked against the schema, or why it fails (``folder``:
        the records folder, when the caller has it open)."""
        path, _ = self._paths(service)
        try:
            if folder is None:
                with self._records() as f:
                    raw = f.read(path.name)
            else:
                raw = folder.read(path.name)
        except FileNotFoundError:
            return Record(service=service)
        except NotAFile as e:
            return e.strerror or "it is not a regular file"
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW: a record is never a link elsewhere
                return "it is a symbolic link"
            raise StoreError(
                f"cannot read {path}: {e.strerror or e}",
                hint=f"the state directory {self.state_dir} must be readable by this user",
            ) from None
        try:
            rec = parse_record(raw)
        except RecordError as e:
            return str(e)
        if rec.service != service:
            return f"it names service {rec.service!r}"
        return rec

    def _records(self, create: bool = False) -> Folder:
        """The records folder, open without following links (``files.Folder``).

        Raises:
            FileNotFoundError: there is none yet (or a link stood there: set aside).
        """
        return Folder(self.state_dir, "records", create=self.modes()[0] if create else None)

    def _read(self, service: str) -> Record:
        """The record, under its lock: one that fails the schema is set aside."""
        got = self._load(service)
        if isinstance(got, str):
            got = self._recover(service, self._paths(service)[0], got)
            self._write(got)  # the fresh record; the note goes to this reader only
        return got

    def _recover(self, service: str, path: Path, why: str) -> Record:
        """A record that fails the schema is set aside (kept for a person to look at),
        and the service goes on with the fields of it that pass (``codec.salvage``)."""
        now = self.clock()
        try:
            with self._records() as folder:
                try:
                    fresh = salvage(folder.read(path.name), service, now)
                except OSError:  # a symbolic link (never followed), or gone
                    fresh = Record(service=service, since=now)
                saved = path.with_name(folder.set_aside(path.name, ".corrupt-", now))
        except OSError as e:
            raise StoreError(
                f"the record {path} is unreadable ({why}) and cannot be set aside: "
                f"{e.strerror or e}",
                hint=f"move it away by hand; {path.parent} must be writable by this user",
            ) from None
        kept = (
            "started afresh"
            if replace(fresh, since=0.0) == Record(service)
            else "kept its valid fields"
        )
        note = f"record was unreadable ({why}); kept as {saved.name}, {kept}"
        # For the agent's log (and journald): the one reader told in the record may be a
        # status nobody reads; `gpuctl locks` lists the copy until it is removed.
        log.warning("%s: %s", path, note)
        self.note(_witnessed("set_aside", service, now, note))
        return replace(fresh, recovered=clip(note))

    def _write(self, record: Record) -> None:
        path, _ = self._paths(record.service)
        try:
            # ``recovered`` is told to the reader that set the file aside, never stored:
            # ``set_aside()`` lists the kept copies for as long as they are there.
            data = encode_record(replace(record, recovered=None))
        except RecordError as e:
            raise StoreError(
                f"refusing to write an invalid record for {record.service!r}: {e}"
            ) from None
        try:
            with self._records(create=True) as folder:
                folder.write(path.name, data.encode(), self.modes()[1])
        except OSError as e:
            raise StoreError(
                f"cannot write in {path.parent} ({path.name}): {e.strerror or e}",
                hint=f"{path.parent} must be writable by this user (and on a local disk)",
            ) from None

    def _effective(self, rec: Record) -> tuple[Record, LeaseState]:
        lease = rec.lease
        if lease is None:
            return rec, LeaseState.NONE
        state, _ = judged_here(lease, self.clock(), TERM_MAX_S.get(rec.service))
        if state is LeaseState.LIVE:
            return rec, state
        return replace(rec, lease=None), state

    def _keep_void(self, on_disk: Record) -> None:
        """Before a writer replaces a forged lease (``core.record.void_why``), a copy of
        its record is kept beside it (``<service>.json.void-<time>``) and logged, for
        ``gpuctl locks`` to show who planted it (``voided``). A dead holder's lease is
        not kept: it was sound. Called under the service's lock."""
        lease = on_disk.lease
        if lease is None:
            return
        now = self.clock()
        _, why = judged_here(lease, now, TERM_MAX_S.get(on_disk.service))
        if why is None:
            return
        path = self._paths(on_disk.service)[0]
        try:
            with self._records() as folder:
                name = set_aside_name(path.name, VOID_SUFFIX, now, folder.exists)
                folder.write(name, encode_record(on_disk).encode(), self.modes()[1])
        except (OSError, RecordError) as e:
            log.warning("%s: a void lease (%s) could not be kept: %s", path, why, e)
            return
        log.warning("%s: lease of %s pid %d is void (%s); kept as %s",
                    path, lease.host, lease.pid, why, name)  # fmt: skip
        by = f"{lease.entry} pid {lease.pid} on {lease.host}"
        self.note(_witnessed("lease", on_disk.service, now, f"broken: {why}", by))

    def voided(self) -> list[Voided]:
        """The void leases and entries (``voided``), for ``gpuctl locks`` only: it reads
        every record, ``_reclaim``'s and ``_admission``'s, and up to
        ``MAX_VOIDED_LISTED`` kept copies."""
        # Their readers set aside the forged entries they find; nobody may have read
        # them since they were planted.
        self.inflight()
        self.waiters()
        try:
            raw = [self._load(n) for n in [*self._record_names(), *PSEUDO_LEASES]]
            # As on disk (``get`` would drop the void lease it is asked about); a record
            # that fails the schema is listed as set aside instead.
            recs = [r for r in raw if isinstance(r, Record)]
            return list_voided(self.state_dir, recs, procinfo.host_identity(), self.clock())
        except OSError as e:
            raise StoreError(
                f"cannot list {self.state_dir}: {e.strerror or e}",
                hint=f"{self.state_dir} must be readable by this user",
            ) from None

    def _locked(self, service: str) -> FolderLock:
        """The service's file lock, held (``release()`` frees it)."""
        self._ensure_dirs()
        path = self._paths(service)[1]
        timeout_s = failpoints.seconds("store.lock_timeout", LOCK_TIMEOUT_S)
        try:
            with Folder(self.state_dir, "locks", create=self.modes()[0]) as folder:
                # Records are held for about a millisecond: poll finely, so 32 callers
                # touching at the same moment do not queue for a second.
                return folder.lock(path.name, self.modes()[1], timeout_s, 0.002)
        except TimeoutError:
            raise StoreError(
                f"the lock of {service!r} ({path}) is held for more than {timeout_s:.0f}s",
                hint=f"a process is stuck holding it: `fuser -v {path}` names it",
            ) from None
        except OSError as e:
            raise StoreError(
                f"cannot lock {service!r} ({path}): {e.strerror or e}",
                hint=f"{path.parent} must be writable by this user (and on a local disk)",
            ) from None

    # ---- the interface

    def close(self) -> None:
        """Nothing to free: every call opens and closes its own files."""

    def get(self, service: str) -> Record:
        got = self._load(service)
        if isinstance(got, str):
            # Set aside only under its lock: a reader that moved it without the lock could
            # move away the fresh record a lock holder has just written.
            lock = self._locked(service)
            try:
                got = self._read(service)
            finally:
                lock.release()
        return self._effective(got)[0]

    def recorded_pids(self) -> list[int]:
        """The server pids the records name (their launchers' handles), read without locks.

        The agent adds these to ``starting``: a recorded server is its service's whatever
        its command line says. A record that fails the schema names no pid (the next
        locked read sets it aside).
        """
        out: list[int] = []
        me = procinfo.host_identity()
        for name in self._record_names():
            got = self._load(name)
            if isinstance(got, Record):
                pid = (got.handle or {}).get("pid")
                # Another machine's (or boot's) pid is not looked up here.
                if not pid_is_here(got.handle, (me.hostname, me.boot_id)):
                    continue
                if isinstance(pid, int) and got.phase is not Phase.STOPPED:
                    out.append(pid)
        return out

    def _record_names(self) -> list[str]:
        """The services that have a record file, sorted."""
        d = self.state_dir / "records"
        try:
            with self._records() as folder:
                names = folder.names()
        except FileNotFoundError:
            return []
        except OSError as e:
            if e.errno == errno.ENOTDIR and not self.state_dir.is_dir():
                return []  # no state folder, nor can there be (a folder above is a file)
            # A file where the folder belongs is an error, not an idle host.
            raise StoreError(
                f"cannot list {d}: {e.strerror or e}",
                hint=f"{d} must be a folder (not a link) readable by this user",
            ) from None
        stems = sorted(n[:-5] for n in names if n.endswith(".json"))
        # Names starting with "_" are gpuctl's own locks (the admission lock), not services.
        return [n for n in stems if _NAME.fullmatch(n) and not n.startswith("_")]

    def records(self) -> list[Record]:
        return [self.get(name) for name in self._record_names()]

    def listing(self) -> Listing:
        # Records first: reading them sets aside what fails, and the list then names it.
        return Listing(self.records(), self.set_aside())

    def set_aside(self) -> list[SetAside]:
        """What was set aside in the state folder and kept for a person, oldest first:
        record files that failed the schema (each with why, read again), links found
        where a folder or a lock belonged, junk in ``queue/`` and ``inflight/``.

        Counted and summarised, never all read: the newest of each service first, at
        most ``MAX_SET_ASIDE_LISTED`` rows, and one row that counts the rest (10,001
        copies made the agent's answer too long to read, and the host UNKNOWN).
        """
        try:
            found = _set_aside_names(self.state_dir)
        except OSError as e:
            raise StoreError(
                f"cannot list {self.state_dir}: {e.strerror or e}",
                hint=f"{self.state_dir} must be readable by this user",
            ) from None
        newest: dict[str, tuple[str, str, float]] = {}
        for item in sorted(found, key=lambda t: t[2]):
            newest[item[0]] = item
        first = sorted(newest.values(), key=lambda t: -t[2])
        firsts = set(first)
        rest = sorted((t for t in found if t not in firsts), key=lambda t: -t[2])
        listed = (first + rest)[:MAX_SET_ASIDE_LISTED]
        out = [self._describe(*item) for item in listed]
        left = len(found) - len(listed)
        if left > 0:
            at = max(t[2] for t in (first + rest)[MAX_SET_ASIDE_LISTED:])
            why = f"{left} more set-aside files, not read; remove them once seen"
            out.append(SetAside("*", f"+{left} more", at, 0, why))
        return sorted(out, key=lambda a: (a.at, a.file))

    def _describe(self, service: str, rel: str, at: float) -> SetAside:
        """One set-aside file, with why it was set aside (a record's reason read again)."""
        folder_rel, _, name = rel.rpartition("/")
        try:
            with Folder(self.state_dir, *filter(None, folder_rel.split("/"))) as folder:
                st = folder.lstat(name)
                if stat.S_ISLNK(st.st_mode):
                    got: str | Record = "it is a symbolic link (never followed)"
                elif folder_rel == "records":
                    got = _why(folder.read(name))
                elif service == "_journal":
                    got = "the journal could not read it as a database; a new one was started"
                else:
                    got = "it is not a sound entry (it counted for nothing)"
        except OSError as e:
            st, got = None, f"cannot read it: {e.strerror or e}"
        why = got if isinstance(got, str) else "it passes the schema now"
        file = name if folder_rel == "records" else rel
        return SetAside(service, file, at, st.st_size if st else 0, clip(why))

    def acquire(
        self,
        service: str,
        holder: Holder,
        ttl_s: float,
        promise: Promise | None = None,
        event: Event | None = None,
    ) -> tuple[bool, Record]:
        """``event``: written to the journal when the lease is granted."""
        _check_term(service, ttl_s)
        lock = self._locked(service)
        try:
            on_disk = self._read(service)
            rec, state = self._effective(on_disk)
            if state is LeaseState.VOID:
                self._keep_void(on_disk)
            if state is LeaseState.LIVE and rec.lease is not None and rec.lease.holder != holder.id:
                return False, rec
            rec = replace(rec, lease=holder.lease(self.clock(), ttl_s))
            if promise is not None:
                rec = replace(rec, promise=promise)
            self._write(rec)
            if event is not None:
                self.note(event)
            return True, rec
        finally:
            lock.release()

    def _as_holder(self, service: str, holder_id: str) -> tuple[Any, Record]:
        lock = self._locked(service)
        try:
            rec, _ = self._effective(self._read(service))
        except BaseException:
            lock.release()
            raise
        if rec.lease is None or rec.lease.holder != holder_id:
            lock.release()
            who = (
                f"held by {rec.lease.entry} pid {rec.lease.pid} on {rec.lease.host}"
                if rec.lease
                else "not held"
            )
            raise StoreError(f"the lease of {service!r} is no longer ours ({who})")
        return lock, rec

    def renew(self, service: str, holder_id: str, ttl_s: float) -> Record:
        _check_term(service, ttl_s)
        lock, rec = self._as_holder(service, holder_id)
        try:
            assert rec.lease is not None
            # A lease's term counts from its last renewal (``core.record.overlong``).
            now = self.clock()
            rec = replace(rec, lease=replace(rec.lease, granted=now, expires=now + ttl_s))
            self._write(rec)
            return rec
        finally:
            lock.release()

    def update(
        self, service: str, holder_id: str, update: RecordUpdate, event: Event | None = None
    ) -> Record:
        lock, rec = self._as_holder(service, holder_id)
        try:
            rec = _apply(rec, update, self.clock())
            self._write(rec)
            if event is not None:  # under the lock: a service's events in their order
                self.note(event)
            return rec
        finally:
            lock.release()

    def release(
        self,
        service: str,
        holder_id: str,
        update: RecordUpdate | None = None,
        event: Event | None = None,
    ) -> Record:
        lock = self._locked(service)
        try:
            rec, _ = self._effective(self._read(service))
            mine = rec.lease is not None and rec.lease.holder == holder_id
            if update and mine:
                rec = _apply(rec, update, self.clock())
            if mine:
                rec = replace(rec, lease=None)
                self._write(rec)
                if event is not None:
                    self.note(event)
            return rec
        finally:
            lock.release()

    def touch(
        self,
        service: str,
        ready: bool = False,
        promise: Promise | None = None,
        *,
        entry: str = "touch",
    ) -> Record:
        """``entry``: who completes a start here (the ``ready`` event's teller)."""
        lock = self._locked(service)
        try:
            on_disk = self._read(service)
            current, _ = self._effective(on_disk)
            if stopping(current):
                # A stop (or reclaim) holds the lease and has checked the idle time: a
                # touch now would lose to it anyway. It changes nothing, and the caller
                # sees the stop in the record it gets back.
                return current
            now = self.clock()
            rec = on_disk.used(now, ready=ready)
            if promise is not None and rec.promise is None:
                rec = replace(rec, promise=promise)
            self._write(rec)
            if on_disk.phase is Phase.STARTING and rec.phase is Phase.RUNNING and not current.lease:
                # A start nobody waits on any more (``--no-wait``, a caller killed) is
                # complete: its ``ready`` is told here, once, under the service's lock.
                # While its launcher holds the lease, the launcher tells it instead.
                self.note(_completed(service, entry, now, on_disk.since))
            return self._effective(rec)[0]
        finally:
            lock.release()


def _apply(rec: Record, update: RecordUpdate, now: float) -> Record:
    """A holder's update, checked: a bad one is the caller's error (400 on the agent),
    never a record no reader accepts. A holder's write also ends a recovery note: the
    record says what is true again."""
    try:
        # The back-off after a failed start is 10 s; a test that must call within it on a
        # loaded machine lengthens it with the failpoint ``ensure.backoff=seconds:<s>``.
        first = failpoints.seconds("ensure.backoff", BACKOFF_FIRST_S)
        out = replace(
            apply_update(rec, update.checked(), now, first_backoff_s=first), recovered=None
        )
        check_record(out)
    except ValueError as e:  # RecordError too
        raise UsageError(f"bad record update: {e}") from None
    return out


def _witnessed(kind: str, service: str, now: float, reason: str, by: str | None = None) -> Event:
    """An event the store itself tells (a record set aside, a lease broken)."""
    import os

    from gpuctl.adapters import procinfo
    from gpuctl.core.events import Event, Kind

    who = {"entry": "store", "pid": str(os.getpid())}
    host = procinfo.host_identity().hostname
    return Event(now, Kind(kind), service, host, reason=clip(reason), by=by, who=who)


def _completed(service: str, entry: str, now: float, since: float) -> Event:
    """``starting`` -> ``running`` seen by a toucher: the ``ready`` of a start whose
    launcher went, with its cold-start time (from the record's ``starting``)."""
    import getpass
    import os

    from gpuctl.adapters import procinfo
    from gpuctl.core.events import Event, Kind

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    who = {"entry": entry, "user": user, "pid": str(os.getpid())}
    host = procinfo.host_identity().hostname
    figures = {"cold_start_s": round(now - since, 3)} if since > 0 else {}
    return Event(
        now, Kind.READY, service, host, before="starting", after="running", who=who,
        figures=figures,
    )  # fmt: skip


def _check_term(service: str, ttl_s: float) -> None:
    """Refuse a lease longer than its kind's documented term (400 on the wire)."""
    longest = TERM_MAX_S.get(service)
    if longest is not None and not ttl_s <= longest:
        raise UsageError(f"a lease on {service!r} lasts at most {longest:.0f}s, not {ttl_s}s")


def _set_aside_names(state_dir: Path) -> list[tuple[str, str, float]]:
    """(service, path under the state folder, when) of everything set aside there:
    listed by name only (never read, never followed). A record's copy is named by its
    service; anything else by ``_<folder>`` (``_state`` for the state folder itself), so
    it never passes for a service's set-aside record (``core.record.hidden_by_set_aside``)."""
    out: list[tuple[str, str, float]] = []

    def scan(parts: tuple[str, ...], pattern: re.Pattern[str], service: str | None) -> list[str]:
        try:
            with Folder(state_dir, *parts) as folder:
                names = folder.names()
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = "".join(f"{p}/" for p in parts)
        for name in names:
            m = pattern.fullmatch(name)
            if m is not None:
                who = service or m["service"]
                out.append((who, prefix + name, float(m["stamp"])))
        return names

    for name in scan((), _LINKED, "_state"):
        m = _JOURNAL_KEPT.fullmatch(name)
        if m is not None:
            out.append(("_journal", name, float(m["stamp"])))
    scan(("records",), _KEPT, None)
    scan(("locks",), _LINKED, "_locks")
    scan(("queue",), _JUNK, "_queue")
    for name in scan(("inflight",), _LINKED, "_inflight"):
        if _NAME.fullmatch(name) and not _LINKED.fullmatch(name):
            scan(("inflight", name), _JUNK, "_inflight")
    return out


def _why(raw: bytes) -> str | Record:
    try:
        return parse_record(raw)
    except RecordError as e:
        return str(e)


_KEPT = re.compile(r"(?P<service>.+)\.json\.corrupt-(?P<stamp>\d{1,12})(?:-\d+)?")
# A link set aside where a folder or a lock file belonged (``files.LINK_SUFFIX``).
_LINKED = re.compile(r"(?P<service>[^/]+?)(?:\.lock)?\.link-(?P<stamp>\d{1,12})(?:-\d+)?")
# A journal SQLite said is not a database, and its -wal and -shm, set aside together
# (``journal.NAME`` + ``journal.CORRUPT_SUFFIX``; that module is not imported here:
# ``status`` and ``locks`` never load sqlite3).
_JOURNAL_KEPT = re.compile(r"journal\.db(?:-wal|-shm)?\.corrupt-(?P<stamp>\d{1,12})(?:-\d+)?")
# A queue or in-flight file that is not a sound entry, set aside once.
_JUNK = re.compile(r"(?P<service>.+)\.corrupt-(?P<stamp>\d{1,12})(?:-\d+)?")
MAX_SET_ASIDE_LISTED = 100
