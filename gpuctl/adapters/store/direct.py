"""``DirectStore``: the records on this machine's file system (the GPU host).

Long because every operation here shares one discipline (the file lock, the schema on
read and write, setting aside what fails, the modes), and splitting it would spread
that discipline over modules that each get half of it right.

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

import contextlib
import errno
import logging
import os
import re
import stat
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuctl.adapters.store.base import _NAME, LOCK_TIMEOUT_S, check_name
from gpuctl.adapters.store.codec import (
    RecordError,
    check_record,
    encode_record,
    parse_record,
    salvage,
)
from gpuctl.adapters.store.files import NotAFile, folder_modes, make_state_dirs, read_bounded
from gpuctl.adapters.store.inflight import InflightFiles, stopping
from gpuctl.adapters.store.queue import QueueFiles
from gpuctl.core.promise import Promise
from gpuctl.core.record import (
    Holder,
    LeaseState,
    Listing,
    Phase,
    Record,
    SetAside,
    apply_update,
    clip,
    lease_state,
)
from gpuctl.core.record_pids import pid_is_here
from gpuctl.errors import StoreError, UsageError

log = logging.getLogger("gpuctl.store")


class DirectStore(InflightFiles, QueueFiles):
    """The records on this machine's file system."""

    def __init__(self, state_dir: Path, clock: Any = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.clock = clock
        self._modes: tuple[int, int] | None = None  # (folders, files), once known

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

    def _lock(self, service: str) -> Any:
        from filelock import FileLock

        self._ensure_dirs()
        _, lock_path = self._paths(service)
        # An explicit mode: filelock then sets it with fchmod, whatever the umask.
        return FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S, mode=self.modes()[1])

    def _load(self, service: str) -> Record | str:
        """The record on disk checked against the schema, or why it fails."""
        path, _ = self._paths(service)
        try:
            raw = read_bounded(path)
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
            fresh = salvage(read_bounded(path), service, now)
        except OSError:  # a symbolic link (never followed), or gone
            fresh = Record(service=service, since=now)
        stamp = int(now)
        saved = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while saved.exists():  # two recoveries in one second keep both copies
            saved = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(path, saved)
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
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as e:
            raise StoreError(
                f"cannot write in {path.parent}: {e.strerror or e}",
                hint=f"{path.parent} must be writable by this user (and on a local disk)",
            ) from None
        try:
            # Atomic through os.replace: a reader never sees a torn record. No fsync: it
            # costs milliseconds on every lease operation, and after a power loss the
            # records' leases are void anyway (the boot id changes, the servers are gone).
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), self.modes()[1])
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreError(
                f"cannot write {path}: {e.strerror or e}",
                hint=f"{path.parent} must be writable by this user (and on a local disk)",
            ) from None

    def _effective(self, rec: Record) -> tuple[Record, LeaseState]:
        from gpuctl.adapters import procinfo

        lease = rec.lease
        if lease is None:
            return rec, LeaseState.NONE
        here = procinfo.host_identity()
        alive = None
        if lease.host == here.hostname and lease.boot_id == here.boot_id:
            alive = procinfo.is_same_process(lease.pid, lease.pid_start)
        state = lease_state(
            lease,
            self.clock(),
            here_host=here.hostname,
            here_boot_id=here.boot_id,
            holder_alive=alive,
        )
        if state is LeaseState.LIVE:
            return rec, state
        return replace(rec, lease=None), state

    def _locked(self, service: str) -> Any:
        from filelock import Timeout

        lock = self._lock(service)
        try:
            # filelock polls a non-blocking flock; its default 50 ms step made 32 callers
            # touching at the same moment queue for up to a second. Records are held
            # for about a millisecond, so poll finely.
            lock.acquire(poll_interval=0.002)
        except Timeout:
            path = self._paths(service)[1]
            raise StoreError(
                f"the lock of {service!r} ({path}) is held for more than {LOCK_TIMEOUT_S:.0f}s",
                hint=f"a process is stuck holding it: `fuser -v {path}` names it",
            ) from None
        except OSError as e:
            path = self._paths(service)[1]
            raise StoreError(
                f"cannot lock {service!r} ({path}): {e.strerror or e}",
                hint=f"{path.parent} must be writable by this user (and on a local disk)",
            ) from None
        return lock

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
        from gpuctl.adapters import procinfo

        out: list[int] = []
        me = procinfo.host_identity()
        for path in self._record_paths():
            got = self._load(path.stem)
            if isinstance(got, Record):
                pid = (got.handle or {}).get("pid")
                # Another machine's (or boot's) pid is not looked up here.
                if not pid_is_here(got.handle, (me.hostname, me.boot_id)):
                    continue
                if isinstance(pid, int) and got.phase is not Phase.STOPPED:
                    out.append(pid)
        return out

    def _record_paths(self) -> list[Path]:
        d = self.state_dir / "records"
        try:
            _listable(d)
            paths = sorted(d.glob("*.json"))
        except OSError as e:
            raise StoreError(
                f"cannot list {d}: {e.strerror or e}",
                hint=f"{d} must be readable by this user",
            ) from None
        # Names starting with "_" are gpuctl's own locks (the admission lock), not services.
        return [p for p in paths if _NAME.fullmatch(p.stem) and not p.stem.startswith("_")]

    def records(self) -> list[Record]:
        return [self.get(p.stem) for p in self._record_paths()]

    def listing(self) -> Listing:
        # Records first: reading them sets aside what fails, and the list then names it.
        return Listing(self.records(), self.set_aside())

    def set_aside(self) -> list[SetAside]:
        """The record files that failed the schema and were kept, oldest first, each with
        why it failed (read again, at most ``MAX_RECORD_BYTES`` of it)."""
        d = self.state_dir / "records"
        out: list[SetAside] = []
        try:
            _listable(d)
            paths = list(d.glob("*.json.corrupt-*"))
        except OSError as e:
            raise StoreError(f"cannot list {d}: {e.strerror or e}") from None
        for path in paths:
            m = _KEPT.fullmatch(path.name)
            if m is None:
                continue
            try:
                size = path.lstat().st_size
                got: str | Record = (
                    "it is a symbolic link" if path.is_symlink() else _why(read_bounded(path))
                )
            except OSError as e:
                got = f"cannot read it: {e.strerror or e}"
            why = got if isinstance(got, str) else "it passes the schema now"
            out.append(SetAside(m["service"], path.name, float(m["stamp"]), size, clip(why)))
        return sorted(out, key=lambda a: (a.at, a.file))

    def acquire(
        self, service: str, holder: Holder, ttl_s: float, promise: Promise | None = None
    ) -> tuple[bool, Record]:
        lock = self._locked(service)
        try:
            rec, state = self._effective(self._read(service))
            if state is LeaseState.LIVE and rec.lease is not None and rec.lease.holder != holder.id:
                return False, rec
            rec = replace(rec, lease=holder.lease(self.clock(), ttl_s))
            if promise is not None:
                rec = replace(rec, promise=promise)
            self._write(rec)
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
        lock, rec = self._as_holder(service, holder_id)
        try:
            assert rec.lease is not None
            rec = replace(rec, lease=replace(rec.lease, expires=self.clock() + ttl_s))
            self._write(rec)
            return rec
        finally:
            lock.release()

    def update(self, service: str, holder_id: str, update: dict[str, Any]) -> Record:
        lock, rec = self._as_holder(service, holder_id)
        try:
            rec = _apply(rec, update, self.clock())
            self._write(rec)
            return rec
        finally:
            lock.release()

    def release(self, service: str, holder_id: str, update: dict[str, Any] | None = None) -> Record:
        lock = self._locked(service)
        try:
            rec, _ = self._effective(self._read(service))
            mine = rec.lease is not None and rec.lease.holder == holder_id
            if update and mine:
                rec = _apply(rec, update, self.clock())
            if mine:
                rec = replace(rec, lease=None)
                self._write(rec)
            return rec
        finally:
            lock.release()

    def touch(self, service: str, ready: bool = False, promise: Promise | None = None) -> Record:
        lock = self._locked(service)
        try:
            on_disk = self._read(service)
            current, _ = self._effective(on_disk)
            if stopping(current):
                # A stop (or reclaim) holds the lease and has checked the idle time: a
                # touch now would lose to it anyway. It changes nothing, and the caller
                # sees the stop in the record it gets back.
                return current
            rec = on_disk.used(self.clock(), ready=ready)
            if promise is not None and rec.promise is None:
                rec = replace(rec, promise=promise)
            self._write(rec)
            return self._effective(rec)[0]
        finally:
            lock.release()


def _apply(rec: Record, update: dict[str, Any], now: float) -> Record:
    """A holder's update, checked: a bad one is the caller's error (400 on the agent),
    never a record no reader accepts. A holder's write also ends a recovery note: the
    record says what is true again."""
    try:
        out = replace(apply_update(rec, update, now), recovered=None)
        check_record(out)
    except RecordError as e:
        raise UsageError(f"bad record update: {e}") from None
    except ValueError as e:
        raise UsageError(f"bad record update: {e}") from None
    return out


def _listable(d: Path) -> None:
    """Raise unless ``d`` is a folder or absent (no records yet): ``glob`` in a file
    finds nothing, and a host whose records folder is a file would read as idle.

    Raises:
        NotADirectoryError: it is there and is not a folder.
    """
    try:
        mode = os.stat(d).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # it is not there, nor can it be (a folder above is a file): no records
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, "it is not a directory")


def _why(raw: bytes) -> str | Record:
    try:
        return parse_record(raw)
    except RecordError as e:
        return str(e)


_KEPT = re.compile(r"(?P<service>.+)\.json\.corrupt-(?P<stamp>\d{1,12})(?:-\d+)?")
