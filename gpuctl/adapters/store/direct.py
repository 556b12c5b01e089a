"""``DirectStore``: the records on this machine's file system (the GPU host).

Layout::

    <state_dir>/records/<service>.json   the record (atomic replace)
    <state_dir>/locks/<service>.lock     its flock (the file's mtime means nothing)
    <state_dir>/logs/<service>.log       the process launcher's server log
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuctl.adapters.store.base import _NAME, LOCK_TIMEOUT_S, check_name
from gpuctl.adapters.store.codec import decode_record, encode_record
from gpuctl.adapters.store.inflight import InflightFiles, stopping
from gpuctl.core.record import Holder, LeaseState, Phase, Record, apply_update, lease_state
from gpuctl.errors import StoreError


class DirectStore(InflightFiles):
    """The records on this machine's file system."""

    def __init__(self, state_dir: Path, clock: Any = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.clock = clock

    # ---- files

    def _paths(self, service: str) -> tuple[Path, Path]:
        check_name(service)
        return (
            self.state_dir / "records" / f"{service}.json",
            self.state_dir / "locks" / f"{service}.lock",
        )

    def _ensure_dirs(self) -> None:
        try:
            for sub in ("records", "locks", "logs"):
                (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the state directory {self.state_dir}: {e.strerror or e}",
                hint="set GPUCTL_STATE_DIR to a writable local directory (not NFS)",
            ) from None

    def _lock(self, service: str) -> Any:
        from filelock import FileLock

        self._ensure_dirs()
        _, lock_path = self._paths(service)
        # mode 0o666: several users of one GPU host share the lock files (umask applies).
        return FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S, mode=0o666)

    def _read(self, service: str, *, recover: bool = True) -> Record:
        """The record on disk. A broken one is set aside (``recover``; only under the lock)
        or, without ``recover``, returned fresh with ``recovered`` saying why."""
        path, _ = self._paths(service)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return Record(service=service)
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            # bytes: json decodes them, so bytes that are not UTF-8 are a ValueError here.
            rec = decode_record(json.loads(raw))
        except (ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
        else:
            if rec.service == service:
                return rec
            why = f"it names service {rec.service!r}"
        if not recover:
            return Record(service=service, recovered=why)
        return self._recover(service, path, why)

    def _recover(self, service: str, path: Path, why: str) -> Record:
        """A corrupt or half-written record is set aside, never a crash."""
        stamp = int(self.clock())
        saved = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while saved.exists():  # two recoveries in one second keep both copies
            saved = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(path, saved)
        except OSError:
            saved = path
        return Record(
            service=service,
            recovered=f"record was unreadable ({why}); kept as {saved.name}, started afresh",
        )

    def _write(self, record: Record) -> None:
        path, _ = self._paths(record.service)
        data = encode_record(record)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            # Atomic through os.replace: a reader never sees a torn record. No fsync: it
            # costs milliseconds on every lease operation, and after a power loss the
            # records' leases are void anyway (the boot id changes, the servers are gone).
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreError(f"cannot write {path}: {e.strerror or e}") from None

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
            raise StoreError(
                f"the lock of {service!r} is held for more than {LOCK_TIMEOUT_S:.0f}s",
                hint=f"a process is stuck holding {self._paths(service)[1]}",
            ) from None
        except OSError as e:
            raise StoreError(f"cannot lock {service!r}: {e.strerror or e}") from None
        return lock

    # ---- the interface

    def close(self) -> None:
        """Nothing to free: every call opens and closes its own files."""

    def get(self, service: str) -> Record:
        # A broken record is set aside only under its lock: a reader that moved it without
        # the lock could move away the fresh record a lock holder has just written.
        rec = self._read(service, recover=False)
        if rec.recovered:
            lock = self._locked(service)
            try:
                rec = self._read(service)
                if rec.recovered:
                    self._write(replace(rec, recovered=None))
            finally:
                lock.release()
        return self._effective(rec)[0]

    def recorded_pids(self) -> list[int]:
        """The server pids the records name (their launchers' handles), read without locks.

        The agent adds these to ``starting``: a recorded server is its service's whatever
        its command line says.
        """
        out: list[int] = []
        for path in (self.state_dir / "records").glob("*.json"):
            try:
                data = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            handle = data.get("handle") if isinstance(data, dict) else None
            pid = handle.get("pid") if isinstance(handle, dict) else None
            if isinstance(pid, int) and pid > 0 and data.get("phase") != "stopped":
                out.append(pid)
        return out

    def records(self) -> list[Record]:
        d = self.state_dir / "records"
        try:
            names = sorted(p.stem for p in d.glob("*.json"))
        except OSError:
            return []
        # Names starting with "_" are gpuctl's own locks (the admission lock), not services.
        return [self.get(n) for n in names if _NAME.fullmatch(n) and not n.startswith("_")]

    def acquire(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        lock = self._locked(service)
        try:
            rec, state = self._effective(self._read(service))
            if state is LeaseState.LIVE and rec.lease is not None and rec.lease.holder != holder.id:
                return False, rec
            rec = replace(rec, lease=holder.lease(self.clock(), ttl_s))
            self._write(replace(rec, recovered=None))
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

    def touch(self, service: str, ready: bool = False) -> Record:
        lock = self._locked(service)
        try:
            on_disk = self._read(service)
            current, _ = self._effective(on_disk)
            if stopping(current):
                # A stop (or reclaim) holds the lease and has checked the idle time: a
                # touch now would lose to it anyway. It changes nothing, and the caller
                # sees the stop in the record it gets back.
                return current
            rec = on_disk.touched(self.clock())
            if ready and rec.phase not in (Phase.RUNNING, Phase.STOPPING):
                rec = replace(rec.with_phase(Phase.RUNNING, self.clock()), failure=None)
            self._write(replace(rec, recovered=None))
            return self._effective(rec)[0]
        finally:
            lock.release()


def _apply(rec: Record, update: dict[str, Any], now: float) -> Record:
    try:
        return apply_update(rec, update, now)
    except ValueError as e:
        raise StoreError(f"bad record update: {e}") from None
