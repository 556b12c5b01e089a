"""The GPU host's state store (DESIGN §3): one JSON record per service, each changed only
under that service's file lock and written atomically.

One interface, two implementations:

- ``DirectStore``: the files themselves, on the GPU host (``GPUCTL_STATE_DIR``).
- ``AgentStore``: the same operations through the host agent's ``/records`` endpoints,
  for callers elsewhere (and cron on the host, when an agent runs there). The agent
  serves them with a ``DirectStore``, so both paths work on the same files under the
  same locks, and even a mix of the two cannot double-start.

``curl -H 'Authorization: Bearer …' http://dgx:9400/records`` lists the records.

Layout::

    <state_dir>/records/<service>.json   the record (atomic replace)
    <state_dir>/locks/<service>.lock     its flock (the file's mtime means nothing)
    <state_dir>/logs/<service>.log       the process launcher's server log
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from gpuctl.config import HostConfig
from gpuctl.core.record import Lease, LeaseState, Phase, Record, apply_update, lease_state
from gpuctl.errors import StoreError, UsageError

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$")
LOCK_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Holder:
    """Who asks for a lease: a fresh id per call, and the process behind it."""

    id: str
    host: str
    boot_id: str
    pid: int
    pid_start: float | None
    entry: str

    @classmethod
    def here(cls, entry: str) -> Holder:
        from gpuctl.adapters import procinfo

        ident = procinfo.host_identity()
        pid = os.getpid()
        return cls(
            uuid.uuid4().hex, ident.hostname, ident.boot_id, pid, procinfo.start_time(pid), entry
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

    @classmethod
    def from_dict(cls, d: Any) -> Holder:
        if not isinstance(d, dict):
            raise ValueError("holder must be an object")
        return cls(
            id=str(d["id"]),
            host=str(d.get("host", "")),
            boot_id=str(d.get("boot_id", "")),
            pid=int(d.get("pid", 0)),
            pid_start=float(d["pid_start"]) if d.get("pid_start") is not None else None,
            entry=str(d.get("entry", "?")),
        )


class Store(Protocol):
    """The store's operations; every one raises ``StoreError`` when it cannot be done."""

    def get(self, service: str) -> Record:
        """The record as it stands: a lease that expired or whose holder died is shown as none."""
        ...

    def records(self) -> list[Record]: ...

    def acquire(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        """Take the lease unless someone else holds a live one. Returns (granted, record)."""
        ...

    def renew(self, service: str, holder_id: str, ttl_s: float) -> Record: ...

    def release(self, service: str, holder_id: str, update: dict[str, Any] | None = None) -> Record:
        """Apply ``update`` and drop the lease, if ``holder_id`` still holds it."""
        ...

    def update(self, service: str, holder_id: str, update: dict[str, Any]) -> Record:
        """Apply ``update`` as the lease holder (StoreError otherwise)."""
        ...

    def touch(self, service: str, ready: bool = False) -> Record:
        """last_used = now: every entry point marks a use the same way.

        ``ready``: the caller saw it answer its health check, so a record still saying
        ``starting`` (its launcher was interrupted) becomes ``running``.
        """
        ...


def check_name(service: str) -> str:
    if not _NAME.match(service):
        raise UsageError(f"invalid service name {service!r}")
    return service


class DirectStore:
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
            rec = Record.from_dict(json.loads(raw))
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
        data = json.dumps(record.to_dict(), sort_keys=True, indent=1)
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
        return [self.get(n) for n in names if _NAME.match(n) and not n.startswith("_")]

    def acquire(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        lock = self._locked(service)
        try:
            rec, state = self._effective(self._read(service))
            if state is LeaseState.LIVE and rec.lease is not None and rec.lease.holder != holder.id:
                return False, rec
            now = self.clock()
            lease = Lease(
                holder=holder.id,
                host=holder.host,
                boot_id=holder.boot_id,
                pid=holder.pid,
                pid_start=holder.pid_start,
                entry=holder.entry,
                granted=now,
                expires=now + ttl_s,
            )
            rec = replace(rec, lease=lease, recovered=rec.recovered)
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
            rec = self._read(service).touched(self.clock())
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


class AgentStore:
    """The store through the host agent's ``/records`` endpoints (same semantics)."""

    def __init__(
        self, base_url: str, token: str | None, timeout_s: float = 5.0, host_name: str = "?"
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.host_name = host_name
        self.timeout_s = timeout_s
        self.token_sent = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; errors as the status client words them (one shared vocabulary).

        A 409 (the lease is not ours) is a StoreError, not an unavailable agent.
        """
        import httpx

        from gpuctl.adapters.agent_client import parse_response, transport_error

        try:
            r = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise transport_error(e, self.base_url, self.timeout_s) from None
        if r.status_code in (409, 503):
            # The agent answered, but its store could not do it (not the lease holder, a
            # lock held too long, no state dir): the same StoreError the files give.
            try:
                data = r.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("error"), str):
                hint = data.get("hint")
                raise StoreError(
                    f"the store on {self.host_name}: {data['error']}",
                    hint=hint if isinstance(hint, str) else "",
                )
        return parse_response(r, self.base_url, self.host_name, self.token_sent)

    def _record(self, data: Any) -> Record:
        from gpuctl.errors import AgentUnavailable

        try:
            return Record.from_dict(data)
        except (ValueError, KeyError, TypeError) as e:
            raise AgentUnavailable(
                f"the agent at {self.base_url} sent a broken record: {e}"
            ) from None

    def get(self, service: str) -> Record:
        return self._record(self._call("GET", f"/records/{check_name(service)}"))

    def records(self) -> list[Record]:
        data = self._call("GET", "/records")
        return [self._record(r) for r in (data.get("records") or [])]

    def acquire(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        data = self._call(
            "POST",
            f"/records/{check_name(service)}/lease",
            {"holder": holder.to_dict(), "ttl_s": ttl_s},
        )
        return bool(data.get("granted")), self._record(data.get("record"))

    def renew(self, service: str, holder_id: str, ttl_s: float) -> Record:
        return self._record(
            self._call(
                "POST",
                f"/records/{check_name(service)}/lease/renew",
                {"holder": holder_id, "ttl_s": ttl_s},
            )
        )

    def release(self, service: str, holder_id: str, update: dict[str, Any] | None = None) -> Record:
        return self._record(
            self._call(
                "POST",
                f"/records/{check_name(service)}/lease/release",
                {"holder": holder_id, "update": update or {}},
            )
        )

    def update(self, service: str, holder_id: str, update: dict[str, Any]) -> Record:
        return self._record(
            self._call(
                "PATCH", f"/records/{check_name(service)}", {"holder": holder_id, "update": update}
            )
        )

    def touch(self, service: str, ready: bool = False) -> Record:
        return self._record(
            self._call("POST", f"/records/{check_name(service)}/touch", {"ready": ready})
        )


def store_for(host: HostConfig, timeout_s: float | None = None) -> Store:
    """The host's store: through its agent, or the files here. ``timeout_s`` bounds each
    agent request (default: the host's timeout, at least 5 s, as lease calls may wait
    for a file lock on the host)."""
    if host.agent:
        return AgentStore(
            host.agent,
            host.token(),
            timeout_s=timeout_s if timeout_s is not None else max(host.timeout_s, 5.0),
            host_name=host.name,
        )
    from gpuctl.config.paths import default_state_dir

    return DirectStore(default_state_dir())
