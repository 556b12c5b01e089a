"""The host's journal: every event gpuctl writes on this host, in SQLite (standard
library) under the state folder.

``<state_dir>/journal.db`` (and its ``-wal`` and ``-shm``), WAL mode, indexed on time.
Many writers write at once (32 racing ``ensure`` callers, the agent, cron, the proxy):
SQLite serialises them, each waiting at most ``BUSY_S`` for the others.

A witness, not a gate: a journal that cannot be written (disk full or nearly,
``RESERVE_BYTES``; locked past ``BUSY_S``, corrupt, a link in its place) never fails the
start or stop it would have told of. The write is dropped, the process warns once, and ``failures()`` counts it
(the agent's ``/metrics``: ``gpuctl_journal_write_failures_total``).

The files are made with the store's modes before SQLite opens them (``files``), and a
link found in place of any of them is set aside (``journal.db.link-<time>``), never
followed: checked before the open and after it. A file SQLite says is not a database
is set aside (``journal.db.corrupt-<time>``) and a new journal started.

Retention (``maintain``): events older than ``days`` go, and so do the oldest past
``MAX_BYTES``; what they added up to stays, as one row per (UTC day, service, user)
(``core.usage``). Closed days are rolled up before any of their events go, so
``usage`` reads a closed day from its rows, and only today from events.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from gpuctl.adapters.store.files import LINK_SUFFIX, Folder, folder_modes
from gpuctl.core.events import Event, Kind, event_from_dict
from gpuctl.core.usage import DAY_S, Held, Key, Tally, day_start, fold

log = logging.getLogger("gpuctl.journal")

NAME: Final = "journal.db"
_FILES: Final = (NAME, NAME + "-wal", NAME + "-shm")
CORRUPT_SUFFIX: Final = ".corrupt-"
SPECIAL_SUFFIX: Final = ".special-"
BUSY_S: Final = 1.0
DEFAULT_DAYS: Final = 90
# The journal never takes the last of the state folder's disk: below this much free
# space it stops writing (a failed write, counted and warned of), so the records, which
# every start and stop must write, keep room: SQLite itself, let run to the end of a
# disk, takes its last pages, and the next record write then fails.
RESERVE_BYTES: Final = 16 * 1024 * 1024
# The size bound: past it the oldest events go first (1,000,000 events take about
# 300 MiB; a busy host writes some 11,000 a day).
MAX_BYTES: Final = 512 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY, at REAL NOT NULL, service TEXT NOT NULL,
    kind TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE TABLE IF NOT EXISTS daily(
    day TEXT NOT NULL, service TEXT NOT NULL, user TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY(day, service, user));
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_count_lock = threading.Lock()
# "write_failures", "warned", and what was written (``counters``): one process's count.
_written: dict[str, float] = {}


def failures() -> int:
    """Journal writes this process dropped (the agent's ``/metrics``)."""
    return int(_written.get("write_failures", 0))


def counters() -> dict[str, float]:
    """What this process wrote, for ``/metrics``: ``starts``, ``stops:<cause>``,
    ``cold_start_seconds`` and ``cold_starts``."""
    with _count_lock:
        return {k: v for k, v in _written.items() if k not in ("warned", "write_failures")}


def _count(events: tuple[Event, ...]) -> None:
    with _count_lock:
        for e in events:
            keys: list[tuple[str, float]] = []
            if e.kind is Kind.LAUNCH:
                keys.append(("starts", 1))
            elif e.kind is Kind.STOP:
                keys.append((f"stops:{e.cause.value if e.cause else 'other'}", 1))
            elif e.kind is Kind.READY and "cold_start_s" in e.figures:
                keys += [("cold_starts", 1), ("cold_start_seconds", e.figures["cold_start_s"])]
            for key, n in keys:
                _written[key] = _written.get(key, 0) + n


def dropped(why: str) -> None:
    """An event this process could not hand on (an agent that refused it): counted and
    warned of once, like a failed write."""
    _failed(why)


def _failed(why: str) -> None:
    with _count_lock:
        _written["write_failures"] = _written.get("write_failures", 0) + 1
        first = "warned" not in _written
        _written["warned"] = 1
    if first:  # once per process (a command's stderr, the agent's log)
        log.warning("the journal cannot be written (%s); going on without it", why)


class Journal:
    """The journal of one state folder. Thread-safe; one connection per instance,
    opened on first use and kept."""

    def __init__(self, state_dir: Path, clock: object = time.time) -> None:
        self.state_dir = Path(state_dir)
        self._clock = clock
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    # ---- files

    def _prepare(self) -> None:
        """The three files, made with the store's modes, none of them a link. A FIFO, a
        socket or a device in place of one is set aside too: SQLite would block on it or
        fail every write, and a group member could so turn the journal off for good."""
        file_mode = folder_modes(self.state_dir)[1]
        with Folder(self.state_dir) as folder:
            for name in _FILES:
                if folder.is_link(name):
                    kept = folder.set_aside(name, LINK_SUFFIX, time.time())
                    log.warning(
                        "%s is a symbolic link, never followed; set aside as %s",
                        folder.path / name,
                        kept,
                    )
                elif _special(folder.fd, name):
                    kept = folder.set_aside(name, SPECIAL_SUFFIX, time.time())
                    log.warning(
                        "%s is not a regular file, never opened; set aside as %s",
                        folder.path / name,
                        kept,
                    )
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                fd = os.open(name, flags, file_mode, dir_fd=folder.fd)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise OSError(errno.EINVAL, f"{name} is not a regular file")
                    if stat.S_IMODE(st.st_mode) != file_mode and st.st_uid == os.geteuid():
                        os.fchmod(fd, file_mode)
                finally:
                    os.close(fd)

    def _no_links(self) -> None:
        with Folder(self.state_dir) as folder:
            for name in _FILES:
                if folder.is_link(name):
                    kept = folder.set_aside(name, LINK_SUFFIX, time.time())
                    raise OSError(
                        errno.ELOOP, f"{name} became a symbolic link (set aside as {kept})"
                    )

    def _open(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self._prepare()
        conn = sqlite3.connect(
            self.state_dir / NAME, timeout=BUSY_S, check_same_thread=False, isolation_level=None
        )
        try:
            self._no_links()
            try:
                self._setup(conn)
            except sqlite3.DatabaseError as e:
                if isinstance(e, sqlite3.OperationalError) and _busy(e):
                    raise
                conn.close()
                self._set_aside_corrupt(str(e))
                self._prepare()
                conn = sqlite3.connect(
                    self.state_dir / NAME,
                    timeout=BUSY_S,
                    check_same_thread=False,
                    isolation_level=None,
                )
                self._no_links()
                self._setup(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    @staticmethod
    def _setup(conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_S * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode: a power loss may lose the last events, never the file.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.executescript(_SCHEMA)

    def _set_aside_corrupt(self, why: str) -> None:
        now = time.time()
        with Folder(self.state_dir) as folder:
            kept = folder.set_aside(NAME, CORRUPT_SUFFIX, now)
            for side in _FILES[1:]:
                with contextlib.suppress(FileNotFoundError):
                    folder.set_aside(side, CORRUPT_SUFFIX, now)
        log.warning(
            "%s is not a journal (%s); set aside as %s, a new one started",
            self.state_dir / NAME,
            why,
            kept,
        )

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._open()

    # ---- writing

    def write(self, *events: Event) -> bool:
        """Add the events (one transaction). Never raises: a failure is counted, warned
        of once, and the caller goes on."""
        if not events:
            return True
        free = self._free_bytes()
        if free is not None and free < RESERVE_BYTES:
            _failed(
                f"{free // 1024} KiB free on the disk of {self.state_dir}; the journal leaves "
                f"the last {RESERVE_BYTES // (1024 * 1024)} MiB to the records"
            )
            return False
        rows = [
            (e.at, e.service, e.kind.value, json.dumps(e.to_dict(), separators=(",", ":")))
            for e in events
        ]
        for attempt in (1, 2):
            try:
                with self._db() as db:
                    db.execute("BEGIN IMMEDIATE")
                    try:
                        db.executemany(
                            "INSERT INTO events(at, service, kind, body) VALUES (?,?,?,?)", rows
                        )
                        db.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(sqlite3.Error):
                            db.execute("ROLLBACK")
                        raise
                _count(events)
                return True
            except sqlite3.DatabaseError as e:
                corrupt = not isinstance(e, sqlite3.OperationalError) or "malformed" in str(e)
                if attempt == 1 and corrupt:
                    self.close()
                    with contextlib.suppress(OSError):
                        self._set_aside_corrupt(str(e))
                    continue
                _failed(str(e))
            except OSError as e:
                self.close()
                _failed(e.strerror or str(e))
            except Exception as e:  # a witness never fails its caller
                _failed(f"{type(e).__name__}: {e}")
            return False
        return False

    def _free_bytes(self) -> int | None:
        """Free space on the state folder's disk for an unprivileged writer (None: the
        system would not say; the write is tried)."""
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    # ---- reading

    def read(
        self,
        since: float = 0.0,
        *,
        service: str | None = None,
        after_id: int = 0,
        limit: int | None = None,
    ) -> list[tuple[int, Event]]:
        """Events from ``since`` (and past ``after_id``), oldest first; ``limit``: the
        newest that many. A journal that does not exist yet reads as empty."""
        if not (self.state_dir / NAME).exists():
            return []
        sql, args = _where(since, service, after_id)
        if limit is not None:
            # ``sql`` is built from constant text only; every value is a parameter.
            sql = f"SELECT * FROM ({sql} ORDER BY at DESC, id DESC LIMIT ?) ORDER BY 1"  # noqa: S608
            args.append(limit)
        sql += "" if limit is not None else " ORDER BY at, id"
        with self._db() as db:
            rows = db.execute(sql, args).fetchall()
        out = _decoded(rows)
        if limit is not None:
            out.sort(key=lambda p: (p[1].at, p[0]))
        return out

    def page(
        self, since: float, *, service: str | None = None, after_id: int = 0, size: int
    ) -> tuple[list[tuple[int, Event]], int | None]:
        """The oldest ``size`` rows past ``after_id`` (from ``since``), in id order, as
        events, and where the next page begins: the last row's id when the page was
        full, else None. A row that is not an event is skipped but still moves the page
        on: one bad row must not end a reader's paging."""
        if not (self.state_dir / NAME).exists():
            return [], None
        sql, args = _where(since, service, after_id)
        with self._db() as db:
            rows = db.execute(f"{sql} ORDER BY id LIMIT ?", [*args, size]).fetchall()
        nxt = rows[-1][0] if len(rows) == size else None
        return _decoded(rows), nxt

    def usage(self, since: float, now: float | None = None) -> dict[Key, Tally]:
        """The rows from ``since`` to now: closed days from the daily rows (whole UTC
        days, from the one ``since`` falls in), the rest from events."""
        now = self._now() if now is None else now
        if not (self.state_dir / NAME).exists():
            return {}
        with self._db() as db:
            rolled, carry = _rolled(db)
            rows: dict[Key, Tally] = {}
            first_day = day_start(since)
            if rolled > first_day:
                for day, service, user, body in db.execute(
                    "SELECT day, service, user, body FROM daily WHERE day >= ? AND day < ?",
                    (_day(first_day), _day(rolled)),
                ):
                    # A row that is not a total (a writer outside gpuctl) is skipped.
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        rows[(str(day), str(service), str(user))] = Tally.from_dict(
                            json.loads(body)
                        )
                start = rolled
            else:
                start, carry = since, self._carry_at(db, since)
            events = [e for _, e in _events(db, start, now)]
        fresh, _ = fold(events, start, now, carry)
        for key, t in fresh.items():
            rows.setdefault(key, Tally()).add(t)
        return rows

    def _carry_at(self, db: sqlite3.Connection, since: float) -> dict[str, Held]:
        """What was held at ``since``: from the last rolled-up day and the events after it."""
        rolled, carry = _rolled(db)
        _, held = fold([e for _, e in _events(db, rolled, since)], rolled, since, carry)
        return held

    def _now(self) -> float:
        clock = self._clock
        return float(clock()) if callable(clock) else time.time()

    # ---- retention

    def maintain(self, days: float = DEFAULT_DAYS, max_bytes: int = MAX_BYTES) -> int:
        """Roll up the closed days not yet rolled up, then drop events older than
        ``days`` and the oldest past ``max_bytes``. Returns how many events went. Never
        raises (a witness): a failure is counted like a failed write."""
        try:
            return self._maintain(days, max_bytes)
        except (sqlite3.Error, OSError) as e:
            _failed(f"pruning: {e}")
            return 0

    def _maintain(self, days: float, max_bytes: int) -> int:
        now = self._now()
        today = day_start(now)
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                rolled, carry = _rolled(db)
                if rolled == 0.0:
                    first = db.execute("SELECT MIN(at) FROM events").fetchone()[0]
                    rolled = day_start(first) if first is not None else today
                if rolled < today:
                    events = [e for _, e in _events(db, rolled, today)]
                    rows, carry = fold(events, rolled, today, carry)
                    for (day, service, user), t in rows.items():
                        db.execute(
                            "INSERT OR REPLACE INTO daily VALUES (?,?,?,?)",
                            (day, service, user, json.dumps(t.to_dict())),
                        )
                    rolled = today
                db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('rolled', ?)",
                    (
                        json.dumps(
                            {"until": rolled, "held": {s: h.to_dict() for s, h in carry.items()}}
                        ),
                    ),
                )
                # Only rolled-up events go: what they add up to is kept.
                cut = min(now - days * DAY_S, rolled)
                gone = db.execute("DELETE FROM events WHERE at < ?", (cut,)).rowcount
                page = db.execute("PRAGMA page_size").fetchone()[0]
                used = page * (
                    db.execute("PRAGMA page_count").fetchone()[0]
                    - db.execute("PRAGMA freelist_count").fetchone()[0]
                )
                if used > max_bytes:
                    total = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
                    drop = int(total * (1 - max_bytes / used)) + 1
                    gone += db.execute(
                        "DELETE FROM events WHERE id IN "
                        "(SELECT id FROM events ORDER BY at LIMIT ?)",
                        (drop,),
                    ).rowcount
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            if gone:
                db.execute("PRAGMA incremental_vacuum")
        return gone


def _special(dir_fd: int, name: str) -> bool:
    """A FIFO, socket or device at ``name`` (a folder stays: it is refused, not moved)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _busy(e: sqlite3.OperationalError) -> bool:
    return "locked" in str(e) or "busy" in str(e)


def _day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def _rolled(db: sqlite3.Connection) -> tuple[float, dict[str, Held]]:
    row = db.execute("SELECT value FROM meta WHERE key = 'rolled'").fetchone()
    if row is None:
        return 0.0, {}
    data = json.loads(row[0])
    return float(data["until"]), {s: Held.from_dict(h) for s, h in data["held"].items()}


def _where(since: float, service: str | None, after_id: int) -> tuple[str, list[object]]:
    """The events from ``since`` past ``after_id`` (of ``service``): the query, built
    from constant text only, and its parameters."""
    sql = "SELECT id, body FROM events WHERE at >= ? AND id > ?"
    args: list[object] = [since, after_id]
    if service is not None:
        sql += " AND service = ?"
        args.append(service)
    return sql, args


def _decoded(rows: list[tuple[int, str]]) -> list[tuple[int, Event]]:
    """The rows' events; a row that is not an event (a writer outside gpuctl) is skipped.
    One ``json.loads`` for all of them: 11,000 calls cost several times as much."""
    try:
        bodies = json.loads("[" + ",".join(body for _, body in rows) + "]")
    except ValueError:
        bodies = []
        for _, body in rows:
            try:
                bodies.append(json.loads(body))
            except ValueError:
                bodies.append(None)
    out: list[tuple[int, Event]] = []
    for (rid, _), body in zip(rows, bodies, strict=True):
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            out.append((rid, event_from_dict(body, stored=True)))
    return out


def _events(db: sqlite3.Connection, start: float, end: float) -> list[tuple[int, Event]]:
    rows = db.execute(
        "SELECT id, body FROM events WHERE at >= ? AND at < ? ORDER BY at, id", (start, end)
    ).fetchall()
    return _decoded(rows)


_journals: dict[Path, Journal] = {}
_journals_lock = threading.Lock()


def journal_for(state_dir: Path) -> Journal:
    """The process's journal of ``state_dir`` (one connection per process and folder)."""
    key = Path(state_dir)
    with _journals_lock:
        j = _journals.get(key)
        if j is None:
            j = _journals[key] = Journal(key)
        return j


__all__ = [
    "DAY_S",
    "DEFAULT_DAYS",
    "MAX_BYTES",
    "RESERVE_BYTES",
    "Journal",
    "failures",
    "journal_for",
]
