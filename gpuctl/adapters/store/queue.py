"""The host's wait queue in the store (``gpuctl run --wait``; the order: ``core.queue``).

Layout::

    <state_dir>/queue/<holder id>.json   one waiter (``core.queue.Waiter``)
    <state_dir>/locks/_queue.lock        the queue's flock

``join`` adds the caller, or renews its entry when it is already there (its heartbeat:
the waiter calls it on every look, and keeps its place). The arrival number (``seq``) is
given under the queue's lock: one more than any entry there. ``leave`` deletes the
caller's entry (``gpuctl run`` calls it in a ``finally``: admitted, timed out, Ctrl-C,
an error). ``waiters`` lists the live entries in the order they will be served.

Like a lease, an entry is tied to its holder's pid, start time and boot id: on the GPU
host, the entry of a holder that died (``kill -9``) is void at once; from elsewhere
(through the agent) it lapses at its expiry, and no later than ``QUEUE_TTL_MAX_S`` after
its grant whatever its file says (``core.queue.overlived``). Every reader under the lock deletes the
dead and lapsed entries it finds, and sets aside a forged one once (``<id>.json.void-<time>``,
kept for ``gpuctl locks`` to show: ``core.record.void_why``). A file that is not a sound entry counts for nothing
and is left for a person to look at (its holder's next ``join`` overwrites it).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuctl.adapters.store.base import judged_here
from gpuctl.adapters.store.codec import (
    QUEUE_ID,
    QUEUE_TTL_MAX_S,
    SEQ_MAX,
    RecordError,
    decode_waiter,
    parse_json,
)
from gpuctl.adapters.store.files import Folder, set_aside_junk
from gpuctl.adapters.store.voided import set_aside_void
from gpuctl.core.queue import Waiter, in_order, overlived
from gpuctl.core.record import Holder, LeaseState
from gpuctl.errors import StoreError, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    class _Files(Protocol):
        """What the mixin uses of ``DirectStore``."""

        state_dir: Path
        clock: Callable[[], float]

        def _locked(self, service: str) -> Any: ...
        def modes(self) -> tuple[int, int]: ...
        def _live_waiters(self: _Files) -> list[Waiter]: ...
        def _waiter_path(self: _Files, holder_id: str) -> Path: ...


QUEUE_LOCK = "_queue"
_MAX_ENTRY_BYTES = 4096


class QueueFiles:
    """The wait queue of a ``DirectStore`` (mixed into it)."""

    def _waiter_path(self: _Files, holder_id: str) -> Path:
        if not isinstance(holder_id, str) or not QUEUE_ID.fullmatch(holder_id):
            # A usage error (400 on the wire): the id names a file, so it is checked whole.
            raise UsageError(
                f"bad queue holder id {str(holder_id)[:80]!r}: 1 to 64 letters and digits"
            )
        return self.state_dir / "queue" / f"{holder_id}.json"

    def queue_join(
        self: _Files, holder: Holder, ttl_s: float, *, name: str, priority: int, memory_mib: int
    ) -> tuple[Waiter, list[Waiter]]:
        """Join the queue, or renew the caller's entry (same holder id: it keeps its
        place). Returns its entry and the live queue in order (it included)."""
        path = self._waiter_path(holder.id)
        lock = self._locked(QUEUE_LOCK)
        try:
            live = self._live_waiters()
            now = self.clock()
            mine = next((w for w in live if w.id == holder.id), None)
            # Bounded: an entry at the top of the range (forged) must not make every later
            # join unwritable; joiners past it tie there and are ordered by arrival time.
            last = max((w.seq for w in live), default=0)
            seq = mine.seq if mine else min(last + 1, SEQ_MAX)
            since = mine.since if mine else now
            ttl_s = min(ttl_s, QUEUE_TTL_MAX_S)  # the wire's bound, for direct callers too
            entry = Waiter(name, priority, memory_mib, seq, since, holder.lease(now, ttl_s))
            try:
                decode_waiter(entry.to_dict())  # never write what no reader accepts
            except RecordError as e:
                raise UsageError(f"bad queue entry: {e}") from None
            _write_json(self.state_dir, path, entry.to_dict(), self.modes())
            return entry, in_order([*(w for w in live if w.id != holder.id), entry])
        finally:
            lock.release()

    def queue_leave(self: _Files, holder_id: str) -> bool:
        """Delete the caller's entry; whether there was one. No lock: an unlink is atomic,
        and leaving must work even while a stuck process holds the queue's lock."""
        name = self._waiter_path(holder_id).name
        try:
            with Folder(self.state_dir, "queue") as folder:
                folder.unlink(name)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(
                f"cannot leave the queue ({self._waiter_path(holder_id)}): {e.strerror or e}",
                hint=f"{self.state_dir / 'queue'} must be writable by this user",
            ) from None
        return True

    def waiters(self: _Files) -> list[Waiter]:
        """The live waiters, in the order they will be served."""
        if not _any_entry(self.state_dir):
            return []  # the common case (every plain `gpuctl run` asks): no lock to take
        lock = self._locked(QUEUE_LOCK)
        try:
            return in_order(self._live_waiters())
        finally:
            lock.release()

    def _live_waiters(self: _Files) -> list[Waiter]:
        """Every live entry (under the queue's lock); void and lapsed ones are deleted."""

        base = self.state_dir / "queue"
        try:
            folder = Folder(self.state_dir, "queue")
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(
                f"cannot read the wait queue {base}: {e.strerror or e}",
                hint=f"{base} must be a folder (not a link) readable by this user",
            ) from None
        now = self.clock()
        live: list[Waiter] = []
        with folder:
            for name in folder.names():
                if not name.endswith(".json"):
                    continue
                w = _read_waiter(folder, name, now)
                if w is None:
                    continue
                state, why = judged_here(w.holder, now, QUEUE_TTL_MAX_S)
                if state is LeaseState.LIVE and not overlived(w, now):
                    live.append(w)
                elif why is not None:
                    set_aside_void(folder, name, now, why)  # forged: kept for a person
                else:
                    with contextlib.suppress(OSError):
                        folder.unlink(name)  # its holder is gone, or stopped renewing
        return live


def _any_entry(state_dir: Path) -> bool:
    """Whether the queue folder may hold an entry (an unreadable folder: yes, so that
    the locked read reports it)."""
    try:
        with Folder(state_dir, "queue") as folder:
            return any(n.endswith(".json") for n in folder.names())
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _read_waiter(folder: Folder, name: str, now: float) -> Waiter | None:
    """An entry, or None when it is not one: a hostile file counts for nothing rather
    than crashing every reader, and is set aside once (kept for a person, logged once)."""
    try:
        raw = folder.read(name, _MAX_ENTRY_BYTES)  # never follows a link, never a FIFO
        w = decode_waiter(parse_json(raw, _MAX_ENTRY_BYTES))
        if w.holder.holder != name[: -len(".json")]:
            raise RecordError("$.holder.holder", "names another holder than its file")
    except FileNotFoundError:
        return None
    except (OSError, RecordError) as e:
        set_aside_junk(folder, name, now, e)
        return None
    return w


def _write_json(state_dir: Path, path: Path, data: dict[str, Any], modes: tuple[int, int]) -> None:
    """Atomically, with the store's modes whatever the umask, never through a link."""
    dir_mode, file_mode = modes
    try:
        with Folder(state_dir, "queue", create=dir_mode) as folder:
            folder.write(path.name, json.dumps(data, sort_keys=True).encode(), file_mode)
    except OSError as e:
        raise StoreError(
            f"cannot write {path}: {e.strerror or e}",
            hint=f"{path.parent} must be a folder (not a link) writable by this user",
        ) from None
