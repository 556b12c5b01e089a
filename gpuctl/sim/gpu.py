"""The simulated GPU: a directory of memory claims, each held by a live process (DESIGN §8).

Layout of a sim directory (missing or empty is a valid GPU, created on first use)::

    <sim_dir>/gpu.json              {"total_mib": N}: the total every process agrees on
    <sim_dir>/sim.lock              flock held while a claim grows (covers the fit check)
    <sim_dir>/claims/<pid>.lock     flock held by the claiming process for its lifetime
    <sim_dir>/claims/<pid>.json     {"pid", "name", "memory_mib", "gpu", "pid_ns"}, atomic

A claim is live while its ``.lock`` is flock-ed: the kernel drops the lock when the
process dies, even on ``kill -9``, so a dead process frees its memory the way a real
one frees its CUDA context. The next reader that finds a lock it can take deletes the
claim. A claim whose locker is gone (a zombie, or a dead parent whose forked child
inherited the descriptor) counts as dead too.

This module runs inside the fake model server, which must also work in a minimal
container that has only the standard library and the gpuctl package: it imports
nothing else (``platformdirs`` only lazily, with a fallback), and in particular not
``gpuctl.adapters.procinfo`` (psutil).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuctl.core.units import parse_size_mib
from gpuctl.errors import ConfigError, GpuctlError

DEFAULT_TOTAL_MIB = 128 * 1024
ENV_SIM_DIR = "GPUCTL_SIM_DIR"
ENV_GPU_MEMORY = "GPUCTL_SIM_GPU_MEMORY"

_GPU_FILE = "gpu.json"
_SIM_LOCK = "sim.lock"
_CLAIMS = "claims"
# Another PID namespace (a container sharing the sim dir) can reuse our pid number; the
# claim then takes the next free suffix. More than a handful means something is wrong.
_MAX_CLAIM_SLOTS = 64


def default_sim_dir() -> Path:
    """``platformdirs.user_state_dir("gpuctl")/sim``, or its XDG equivalent without platformdirs."""
    try:
        import platformdirs
    except ImportError:
        # The minimal-container case: same answer platformdirs gives on Linux.
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return Path(base) / "gpuctl" / "sim"
    return Path(platformdirs.user_state_dir("gpuctl")) / "sim"


def resolve_sim_dir(sim_dir: Path | str | None = None) -> Path:
    """The explicit directory, else ``$GPUCTL_SIM_DIR``, else the user state dir."""
    if sim_dir is not None and str(sim_dir) != "":
        return Path(sim_dir).expanduser()
    env = os.environ.get(ENV_SIM_DIR, "").strip()
    if env:
        return Path(env).expanduser()
    return default_sim_dir()


def cuda_size(mib: float) -> str:
    """PyTorch's way of writing sizes in its OOM message: ``8.00 GiB``, ``20.00 MiB``."""
    if abs(mib) >= 1024:
        return f"{mib / 1024:.2f} GiB"
    return f"{mib:.2f} MiB"


class SimOutOfMemory(GpuctlError):
    """A claim did not fit: the simulated ``torch.OutOfMemoryError``.

    Attributes:
        requested_mib: what the failed step tried to allocate on top of what it held.
        free_mib: what was free on the simulated GPU (total minus every live claim).
        total_mib: the simulated GPU's total.
        holders: (pid, memory_mib) of the other live claims, largest first.
    """

    def __init__(
        self,
        requested_mib: int,
        free_mib: int,
        total_mib: int,
        holders: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.requested_mib = requested_mib
        self.free_mib = max(0, free_mib)
        self.total_mib = total_mib
        self.holders = holders
        msg = (
            f"CUDA out of memory. Tried to allocate {cuda_size(requested_mib)}. "
            f"GPU 0 has a total capacity of {cuda_size(total_mib)} of which "
            f"{cuda_size(self.free_mib)} is free."
        )
        # Real PyTorch names the other processes too; that is what makes the message useful.
        msg += "".join(
            f" Process {pid} has {cuda_size(mib)} memory in use." for pid, mib in holders
        )
        super().__init__(msg, hint="free GPU memory first; `gpuctl sim ls` shows who holds it")


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    """One live claim on the simulated GPU.

    ``pid`` is the claiming process as this process sees it: the holder of the claim's
    flock from ``/proc/locks`` where the kernel tells us (right even for a process in a
    container's PID namespace), else the pid the claim file records.
    """

    pid: int
    name: str
    memory_mib: int
    gpu: int = 0
    claim_id: str = ""


class SimGpu:
    """A simulated GPU in a sim directory.

    Args:
        sim_dir: the directory; default ``$GPUCTL_SIM_DIR``, else the user state dir.
        total_mib: the total memory; default ``$GPUCTL_SIM_GPU_MEMORY``, else what
            ``gpu.json`` says, else 128 GiB. An explicit value (argument or env) is written
            to ``gpu.json`` so that every process using the directory agrees.

    Raises:
        ConfigError: ``$GPUCTL_SIM_GPU_MEMORY`` is not a size, or a total is not positive.
    """

    def __init__(self, sim_dir: Path | str | None = None, total_mib: int | None = None) -> None:
        self.sim_dir = resolve_sim_dir(sim_dir)
        self.claims_dir = self.sim_dir / _CLAIMS
        explicit = total_mib
        if explicit is None:
            env = os.environ.get(ENV_GPU_MEMORY, "").strip()
            if env:
                try:
                    explicit = parse_size_mib(env)
                except ValueError as err:
                    raise ConfigError(f"{ENV_GPU_MEMORY}: {err}") from None
        if explicit is not None and explicit <= 0:
            raise ConfigError(
                f"the simulated GPU's total memory must be positive, got {explicit} MiB"
            )
        self._explicit_total = explicit
        if explicit is not None and self._read_total_file() != explicit:
            try:
                with self._locked():
                    self._write_total_file(explicit)
            except OSError:
                # A read-only sim dir (a probe that may only look): the value still holds in
                # this process; claims, which must write, report the error themselves.
                pass

    # ------------------------------------------------------------------ total memory

    @property
    def total_mib(self) -> int:
        """The total memory in MiB (read again each time: another process may have set it)."""
        if self._explicit_total is not None:
            return self._explicit_total
        from_file = self._read_total_file()
        return from_file if from_file is not None else DEFAULT_TOTAL_MIB

    def _read_total_file(self) -> int | None:
        try:
            data = json.loads((self.sim_dir / _GPU_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        value = data.get("total_mib") if isinstance(data, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return None

    def _write_total_file(self, total_mib: int) -> None:
        _write_json_atomic(self.sim_dir / _GPU_FILE, {"total_mib": total_mib})

    def _ensure_dir(self) -> None:
        """Create the directory and its ``gpu.json`` (under the sim lock: one writer wins)."""
        self.claims_dir.mkdir(parents=True, exist_ok=True)
        if (self.sim_dir / _GPU_FILE).exists():
            return
        with self._locked():
            if self._read_total_file() is None:
                self._write_total_file(self.total_mib)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The sim-wide lock: growing a claim and checking that it fits is one step."""
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        path = self.sim_dir / _SIM_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:
            # Created by another user (root in a container): flock works on a read-only fd.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    # ------------------------------------------------------------------ reading claims

    def claims(self) -> list[ClaimInfo]:
        """The live claims (memory 0 included), sorted by pid. Deletes the dead ones it meets."""
        return self._scan()[0]

    def used_mib(self) -> int:
        """The sum of the live claims."""
        return sum(c.memory_mib for c in self.claims())

    def prune(self) -> int:
        """Delete the files of dead claims (and stray temp files); returns how many claims went."""
        removed = self._scan()[1]
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.claims_dir):
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        # A temp file younger than a minute may be a write in progress.
                        if _age_s(entry) > 60:
                            os.unlink(entry.path)
        return removed

    def _scan(self) -> tuple[list[ClaimInfo], int]:
        try:
            names = os.listdir(self.claims_dir)
        except FileNotFoundError:
            return [], 0
        stems = {
            n[:-5]
            for n in names
            if not n.startswith(".") and (n.endswith(".lock") or n.endswith(".json"))
        }
        if not stems:
            return [], 0
        holders = _LockTable()
        live: list[ClaimInfo] = []
        removed = 0
        for stem in sorted(stems):
            info, dead = self._check(stem, holders)
            if info is not None:
                live.append(info)
            removed += dead
        live.sort(key=lambda c: (c.pid, c.claim_id))
        return live, removed

    def _check(self, stem: str, holders: _LockTable) -> tuple[ClaimInfo | None, int]:
        """Decide one claim: (info, 0) live, (None, 1) dead and deleted, (None, 0) not ready."""
        lock_path = self.claims_dir / f"{stem}.lock"
        json_path = self.claims_dir / f"{stem}.json"
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            # A record without its lock: the owner crashed while releasing (it deletes the
            # record first), or someone edited the directory. A lock is created before its
            # record, so this is never a claim being born.
            return None, int(_unlink(json_path))
        except OSError:
            return None, 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None, 0
            else:
                # We got the lock, so its owner is gone: delete while holding it, so a
                # claimant that opened the old file notices (its identity check fails).
                existed = _unlink(json_path)
                _unlink(lock_path)
                return None, int(existed)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        record = _read_json(json_path)
        if record is None:
            return None, 0  # locked but no record yet: a claim being born
        try:
            claim_pid = int(record["pid"])
            name = str(record.get("name", ""))
            memory = int(record.get("memory_mib", 0))
            gpu = int(record.get("gpu", 0))
        except (KeyError, TypeError, ValueError):
            return None, 0
        holder = holders.holder(st.st_dev, st.st_ino)
        if holder:
            pid, alive = holder, _pid_alive(holder)
        elif record.get("pid_ns") == _pid_namespace():
            # Same PID namespace, and the kernel did not name a live locker (no /proc/locks,
            # or the locker died and was reaped while a forked child kept the lock).
            pid, alive = claim_pid, _pid_alive(claim_pid)
        else:
            # The locker lives in another PID namespace (we are in a container and it is
            # on the host, say): its pid means nothing here, so the held lock decides.
            pid, alive = claim_pid, True
        if not alive:
            # The locker died but its descriptor lives on (a forked child inherited it), or
            # it is a zombie. Dead is dead: the memory is free.
            existed = _unlink(json_path)
            _unlink(lock_path)
            return None, int(existed)
        return ClaimInfo(pid=pid, name=name, memory_mib=max(0, memory), gpu=gpu, claim_id=stem), 0

    # ------------------------------------------------------------------ claiming

    def claim(self, name: str) -> Claim:
        """Register this process on the simulated GPU with 0 MiB; grow it with ``Claim.set``.

        Raises:
            GpuctlError: the sim directory cannot be written.
        """
        try:
            return self._claim(name)
        except OSError as err:
            raise GpuctlError(
                f"cannot write the simulated GPU at {self.sim_dir}: {err.strerror or err}",
                hint="check the directory's permissions, or pass another --sim-dir",
            ) from err

    def _claim(self, name: str) -> Claim:
        self._ensure_dir()
        pid = os.getpid()
        slot = 0
        while slot < _MAX_CLAIM_SLOTS:
            stem = str(pid) if slot == 0 else f"{pid}-{slot}"
            lock_path = self.claims_dir / f"{stem}.lock"
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    slot += 1  # held: a claim of ours, or a same-numbered pid elsewhere
                    continue
                raise
            # A reader that found the old file unlocked may have deleted it between our
            # open and our flock; then we hold a lock on a file nobody can see. Retry.
            try:
                on_disk = os.stat(lock_path)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (on_disk.st_dev, on_disk.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            claim = Claim(self, stem, fd, name)
            try:
                with self._locked():
                    claim._write(0)
            except BaseException:
                claim.release()
                raise
            return claim
        raise GpuctlError(
            f"cannot claim the simulated GPU: {_MAX_CLAIM_SLOTS} claims for pid {pid} already",
            hint=f"run `gpuctl sim reset` (sim dir {self.sim_dir})",
        )


class Claim:
    """This process's memory on the simulated GPU; a context manager that releases it.

    Thread-safe: a model server grows it from its main thread and shrinks it from a
    request thread (sleep mode).
    """

    def __init__(self, gpu: SimGpu, claim_id: str, lock_fd: int, name: str) -> None:
        self.gpu = gpu
        self.claim_id = claim_id
        self.name = name
        self._fd: int | None = lock_fd
        self._memory = 0
        self._mutex = threading.Lock()

    @property
    def memory_mib(self) -> int:
        return self._memory

    @property
    def released(self) -> bool:
        return self._fd is None

    def set(self, memory_mib: int) -> None:
        """Hold ``memory_mib`` from now on: grow (if it fits) or shrink.

        Raises:
            SimOutOfMemory: growing would exceed the total beside the other live claims;
                the claim keeps what it held.
            ValueError: a negative size.
            RuntimeError: the claim was released.
        """
        if memory_mib < 0:
            raise ValueError(f"a claim cannot be negative: {memory_mib}")
        with self._mutex:
            if self._fd is None:
                raise RuntimeError("this claim was released")
            with self.gpu._locked():
                if memory_mib > self._memory:
                    others = [c for c in self.gpu.claims() if c.claim_id != self.claim_id]
                    total = self.gpu.total_mib
                    used_by_others = sum(c.memory_mib for c in others)
                    if memory_mib > total - used_by_others:
                        holders = tuple(
                            (c.pid, c.memory_mib)
                            for c in sorted(others, key=lambda c: -c.memory_mib)
                            if c.memory_mib > 0
                        )
                        raise SimOutOfMemory(
                            requested_mib=memory_mib - self._memory,
                            free_mib=total - used_by_others - self._memory,
                            total_mib=total,
                            holders=holders,
                        )
                self._write(memory_mib)

    def _write(self, memory_mib: int) -> None:
        record: dict[str, Any] = {
            "pid": os.getpid(),
            "name": self.name,
            "memory_mib": memory_mib,
            "gpu": 0,
            "pid_ns": _pid_namespace(),
        }
        _write_json_atomic(self.gpu.claims_dir / f"{self.claim_id}.json", record)
        self._memory = memory_mib

    def release(self) -> None:
        """Give the memory back and drop the lock. Safe to call twice."""
        with self._mutex:
            if self._fd is None:
                return
            # Record first, lock last: a record without a lock means "dead" to readers.
            _unlink(self.gpu.claims_dir / f"{self.claim_id}.json")
            _unlink(self.gpu.claims_dir / f"{self.claim_id}.lock")
            os.close(self._fd)
            self._fd = None
            self._memory = 0

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# ---------------------------------------------------------------------- helpers


class _LockTable:
    """Who holds which flock, from ``/proc/locks`` (Linux), read lazily once per scan.

    The kernel shows each locker's pid in the reader's PID namespace (0 when it lives
    outside it), which is how a host sees the real pid of a claim made in a container.
    """

    def __init__(self) -> None:
        self._entries: dict[int, list[tuple[int, int, int]]] | None = None
        self._reloaded = False

    def holder(self, st_dev: int, st_ino: int) -> int | None:
        """The locker's pid (0: outside our PID namespace), or None when not listed."""
        if self._entries is None:
            self._entries = _read_proc_locks()
        found = self._lookup(st_dev, st_ino)
        if found is None and not self._reloaded:
            # Loaded before this lock was taken (a claim born during the scan): look again,
            # once, rather than judge a live claim by a pid from another namespace.
            self._reloaded = True
            self._entries = _read_proc_locks()
            found = self._lookup(st_dev, st_ino)
        return found

    def _lookup(self, st_dev: int, st_ino: int) -> int | None:
        found = (self._entries or {}).get(st_ino)
        if not found:
            return None
        major, minor = os.major(st_dev), os.minor(st_dev)
        for maj, mnr, pid in found:
            if (maj, mnr) == (major, minor):
                return pid
        # Overlay file systems can show another device number than stat() does; one
        # lock on that inode number is still ours.
        return found[0][2] if len(found) == 1 else None


def _read_proc_locks() -> dict[int, list[tuple[int, int, int]]]:
    """Parse ``/proc/locks`` into inode → [(major, minor, pid)]; empty where unreadable."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    entries: dict[int, list[tuple[int, int, int]]] = {}
    # "1: FLOCK  ADVISORY  WRITE 4459 fe:00:2146324 0 EOF"; "1: -> FLOCK ..." are waiters.
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            pid = int(parts[4])
            maj_s, min_s, ino_s = parts[5].split(":")
            entries.setdefault(int(ino_s), []).append((int(maj_s, 16), int(min_s, 16), pid))
        except ValueError:
            continue
    return entries


@functools.cache
def _pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), or None without /proc."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie (a zombie has exited; see DESIGN §3)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
        return _kill0(pid)  # no /proc here (macOS): existence is all we can learn
    except OSError:
        return _kill0(pid)
    # The command name may contain spaces and parentheses; the state follows the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] not in ("Z", "X", "x")


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` so a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            # mkstemp makes 0600; the host and a container may run as different users.
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise


def _unlink(path: Path) -> bool:
    """Delete ``path``; True when it existed. Other errors are ignored (another reader won)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def _age_s(entry: os.DirEntry[str]) -> float:
    return time.time() - entry.stat(follow_symlinks=False).st_mtime


class StopFlag:
    """Set by SIGTERM/SIGINT; polled by the simulated workloads' main loops.

    A flag polled every few tens of milliseconds, not an Event waited on: a signal
    handler that sets an Event can deadlock against the main thread inside ``wait``.
    """

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def is_set(self) -> bool:
        return self.signal is not None

    def sleep(self, seconds: float, step: float = 0.05) -> bool:
        """Sleep up to ``seconds``; return False as soon as a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while not self.is_set:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(step, left))
        return False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM and SIGINT into a ``StopFlag`` for the block (main thread only)."""
    import signal

    flag = StopFlag()

    def handler(signum: int, _frame: object) -> None:
        flag.signal = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
