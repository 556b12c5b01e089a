"""The simulated GPU: a directory of memory claims, each held by a live process (``Claim``).

Layout of a sim directory (missing or empty is a valid GPU, created on first use)::

    <sim_dir>/gpu.json              {"total_mib": N} (one GPU) or {"devices": [{"total_mib":
                                    N0}, ...], "total_mib": sum}: what every process agrees on
    <sim_dir>/sim.lock              flock held while a claim grows (covers the fit check)
    <sim_dir>/claims/<pid>.lock     flock held by the claiming process for its lifetime
    <sim_dir>/claims/<pid>.json     {"pid", "name", "memory_mib", "gpu", "util_pct", "pid_ns"},
                                    written atomically

A claim is live while its ``.lock`` is flock-ed: the kernel drops the lock when the
process dies, even on ``kill -9``, so a dead process frees its memory the way a real
one frees its CUDA context. The next reader that finds a lock it can take deletes the
claim. A claim whose locker is gone (a zombie, or a dead parent whose forked child
inherited the descriptor) counts as dead too.

This module runs inside the fake model server, which must also work in a minimal
container that has only the standard library and the gpuctl package: like all of
``gpuctl.sim`` it imports the standard library and ``gpuctl.core`` only (no
``platformdirs``, no psutil). The reader of claims for gpuctl is
``gpuctl.adapters.probes.sim``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuctl.core.units import format_mib
from gpuctl.sim.errors import SimError, SimOutOfMemory
from gpuctl.sim.fs import (
    FILE_MODE,
    age_s,
    make_dirs,
    own_mode,
    read_json,
    unlink,
    write_json_atomic,
)
from gpuctl.sim.liveness import LockTable, pid_alive, pid_namespace
from gpuctl.sim.settings import (
    DEFAULT_TOTAL_MIB,
    ENV_GPUS,
    GPU_FILE,
    default_gpu,
    default_sim_dir,
    explicit_totals,
    parse_totals,
    read_gpu_file,
    resolve_sim_dir,
    write_gpu_file,
)

__all__ = [
    "DEFAULT_TOTAL_MIB",
    "Claim",
    "ClaimInfo",
    "SimError",
    "SimGpu",
    "SimOutOfMemory",
    "default_gpu",
    "default_sim_dir",
    "parse_totals",
    "resolve_sim_dir",
]

_SIM_LOCK = "sim.lock"
_CLAIMS = "claims"
# Another PID namespace (a container sharing the sim dir) can reuse our pid number; the
# claim then takes the next free suffix. More than a handful means something is wrong.
_MAX_CLAIM_SLOTS = 64


def _shown(totals: Sequence[int]) -> str:
    return ",".join(format_mib(t) for t in totals)


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
    # The share of its GPU the process keeps busy (a model server answering requests).
    util_pct: int = 0


class SimGpu:
    """A simulated GPU host in a sim directory: one or several GPUs, each with its total.

    Args:
        sim_dir: the directory; default ``$GPUCTL_SIM_DIR``, else the user state dir.
        total_mib: one GPU of this total; default ``$GPUCTL_SIM_GPU_MEMORY``.
        totals_mib: several GPUs, one total each. ``$GPUCTL_SIM_GPUS`` (``80GiB,80GiB``)
            stands in for it and, being the host's definition, wins over a single
            total. Without any, what ``gpu.json`` says, else one GPU of 128 GiB. An
            explicit value (argument or env) is written to ``gpu.json`` so that every
            process using the directory agrees.
        define: True for the ``gpuctl sim`` commands that make the simulated host (its
            workloads). A reader (the sim probe, ``sim ls``) passes False: it never
            writes ``gpu.json`` (a read must not change the hardware), and where
            ``gpu.json`` names the GPUs they win over the totals it was given
            (``totals_mismatch`` says so). Its totals hold only while there is no file.

    Raises:
        SimError: an environment variable is not a size (list), or a total is not positive.
    """

    def __init__(
        self,
        sim_dir: Path | str | None = None,
        total_mib: int | None = None,
        *,
        totals_mib: Sequence[int] | None = None,
        define: bool = True,
    ) -> None:
        self.sim_dir = resolve_sim_dir(sim_dir)
        self.claims_dir = self.sim_dir / _CLAIMS
        explicit = explicit_totals(total_mib, totals_mib)
        self._explicit_totals = explicit
        self._define = define
        if define and explicit is not None and read_gpu_file(self.sim_dir) != explicit:
            try:
                with self._locked():
                    write_gpu_file(self.sim_dir, explicit)
            except OSError:
                # A read-only sim dir (a probe that may only look): the value still holds in
                # this process; claims, which must write, report the error themselves.
                pass

    # ------------------------------------------------------------------ total memory

    @property
    def totals_mib(self) -> tuple[int, ...]:
        """Each GPU's total in MiB (read again each time: another process may set them)."""
        if self._define and self._explicit_totals is not None:
            return self._explicit_totals
        from_file = read_gpu_file(self.sim_dir)
        if from_file is not None:
            return from_file
        return self._explicit_totals or (DEFAULT_TOTAL_MIB,)

    def totals_mismatch(self) -> str | None:
        """For a reader: why the totals it was given are not the ones it reports (the
        directory's ``gpu.json`` says otherwise); None when they agree or none were given."""
        if self._define or self._explicit_totals is None:
            return None
        from_file = read_gpu_file(self.sim_dir)
        if from_file is None or from_file == self._explicit_totals:
            return None
        return (
            f"the simulated GPUs in {self.sim_dir} are {_shown(from_file)}, not the "
            f"{_shown(self._explicit_totals)} asked; reading what gpu.json says (the "
            "`gpuctl sim` workloads set it, with their --gpu-memory)"
        )

    @property
    def total_mib(self) -> int:
        """All GPUs' memory together (one GPU: its total)."""
        return sum(self.totals_mib)

    def device_total_mib(self, gpu: int) -> int:
        """The total of GPU ``gpu``.

        Raises:
            SimError: the simulated host has no such GPU.
        """
        totals = self.totals_mib
        if not 0 <= gpu < len(totals):
            raise SimError(
                f"the simulated host has no GPU {gpu} (it has {len(totals)})",
                hint=f"set its GPUs with {ENV_GPUS}=80GiB,80GiB (one size per GPU)",
            )
        return totals[gpu]

    def _ensure_dir(self) -> None:
        """Create the directory and its ``gpu.json`` (under the sim lock: one writer wins)."""
        make_dirs(self.claims_dir)
        if (self.sim_dir / GPU_FILE).exists():
            return
        with self._locked():
            if read_gpu_file(self.sim_dir) is None:
                write_gpu_file(self.sim_dir, self.totals_mib)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The sim-wide lock: growing a claim and checking that it fits is one step."""
        make_dirs(self.sim_dir)
        path = self.sim_dir / _SIM_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            own_mode(fd)
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

    def used_mib(self, gpu: int | None = None) -> int:
        """The sum of the live claims (on GPU ``gpu``; None: on all)."""
        return sum(c.memory_mib for c in self.claims() if gpu is None or c.gpu == gpu)

    def prune(self) -> int:
        """Delete the files of dead claims (and stray temp files); returns how many claims went."""
        removed = self._scan()[1]
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.claims_dir):
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        # A temp file younger than a minute may be a write in progress.
                        if age_s(entry) > 60:
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
        holders = LockTable()
        live: list[ClaimInfo] = []
        removed = 0
        for stem in sorted(stems):
            info, dead = self._check(stem, holders)
            if info is not None:
                live.append(info)
            removed += dead
        live.sort(key=lambda c: (c.pid, c.claim_id))
        return live, removed

    def _check(self, stem: str, holders: LockTable) -> tuple[ClaimInfo | None, int]:
        """Decide one claim: (info, 0) live, (None, 1) dead and deleted, (None, 0) not ready."""
        lock_path = self.claims_dir / f"{stem}.lock"
        json_path = self.claims_dir / f"{stem}.json"
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            # A record without its lock: the owner crashed while releasing (it deletes the
            # record first), or someone edited the directory. A lock is created before its
            # record, so this is never a claim being born.
            return None, int(unlink(json_path))
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
                existed = unlink(json_path)
                unlink(lock_path)
                return None, int(existed)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        record = read_json(json_path)
        if record is None:
            return None, 0  # locked but no record yet: a claim being born
        try:
            claim_pid = int(record["pid"])
            name = str(record.get("name", ""))
            memory = int(record.get("memory_mib", 0))
            gpu = int(record.get("gpu", 0))
            util = int(record.get("util_pct", 0))
        except (KeyError, TypeError, ValueError):
            return None, 0
        holder = holders.holder(st.st_dev, st.st_ino)
        if holder:
            pid, alive = holder, pid_alive(holder)
        elif record.get("pid_ns") == pid_namespace():
            # Same PID namespace, and the kernel did not name a live locker (no /proc/locks,
            # or the locker died and was reaped while a forked child kept the lock).
            pid, alive = claim_pid, pid_alive(claim_pid)
        else:
            # The locker lives in another PID namespace (we are in a container and it is
            # on the host, say): its pid means nothing here, so the held lock decides.
            pid, alive = claim_pid, True
        if not alive:
            # The locker died but its descriptor lives on (a forked child inherited it), or
            # it is a zombie. Dead is dead: the memory is free.
            existed = unlink(json_path)
            unlink(lock_path)
            return None, int(existed)
        info = ClaimInfo(
            pid=pid,
            name=name,
            memory_mib=max(0, memory),
            gpu=gpu,
            claim_id=stem,
            util_pct=min(max(util, 0), 100),
        )
        return info, 0

    # ------------------------------------------------------------------ claiming

    def claim(self, name: str, gpu: int = 0) -> Claim:
        """Register this process on simulated GPU ``gpu`` with 0 MiB; grow it with
        ``Claim.set``.

        Raises:
            SimError: the sim directory cannot be written, or there is no such GPU.
        """
        self.device_total_mib(gpu)
        try:
            return self._claim(name, gpu)
        except OSError as err:
            raise SimError(
                f"cannot write the simulated GPU at {self.sim_dir}: {err.strerror or err}",
                hint="check the directory's permissions, or pass another --sim-dir",
            ) from err

    def _claim(self, name: str, gpu: int) -> Claim:
        self._ensure_dir()
        pid = os.getpid()
        slot = 0
        while slot < _MAX_CLAIM_SLOTS:
            stem = str(pid) if slot == 0 else f"{pid}-{slot}"
            lock_path = self.claims_dir / f"{stem}.lock"
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            own_mode(fd)
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
            claim = Claim(self, stem, fd, name, gpu)
            try:
                with self._locked():
                    claim._write(0, 0)
            except BaseException:
                claim.release()
                raise
            return claim
        raise SimError(
            f"cannot claim the simulated GPU: {_MAX_CLAIM_SLOTS} claims for pid {pid} already",
            hint=f"run `gpuctl sim reset` (sim dir {self.sim_dir})",
        )


class Claim:
    """This process's memory on the simulated GPU; a context manager that releases it.

    Thread-safe: a model server grows it from its main thread and shrinks it from a
    request thread (sleep mode).
    """

    def __init__(
        self, gpu: SimGpu, claim_id: str, lock_fd: int, name: str, device: int = 0
    ) -> None:
        self.gpu = gpu
        self.claim_id = claim_id
        self.name = name
        self.device = device
        self._fd: int | None = lock_fd
        self._memory = 0
        self._util = 0
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
            SimOutOfMemory: growing would exceed its GPU's total beside the other live
                claims on that GPU; the claim keeps what it held.
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
                    others = [
                        c
                        for c in self.gpu.claims()
                        if c.claim_id != self.claim_id and c.gpu == self.device
                    ]
                    total = self.gpu.device_total_mib(self.device)
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
                            gpu=self.device,
                        )
                self._write(memory_mib, self._util)

    def set_util(self, util_pct: int) -> None:
        """Report how busy this process keeps its GPU (0-100), as NVML's per-process
        SM utilisation would; a no-op once released or when nothing changed."""
        util = min(max(int(util_pct), 0), 100)
        with self._mutex:
            if self._fd is None or util == self._util:
                return
            self._write(self._memory, util, durable=False)

    def _write(self, memory_mib: int, util_pct: int, *, durable: bool = True) -> None:
        record: dict[str, Any] = {
            "pid": os.getpid(),
            "name": self.name,
            "memory_mib": memory_mib,
            "gpu": self.device,
            "util_pct": util_pct,
            "pid_ns": pid_namespace(),
        }
        write_json_atomic(self.gpu.claims_dir / f"{self.claim_id}.json", record, durable=durable)
        self._memory = memory_mib
        self._util = util_pct

    def release(self) -> None:
        """Give the memory back and drop the lock. Safe to call twice."""
        with self._mutex:
            if self._fd is None:
                return
            # Record first, lock last: a record without a lock means "dead" to readers.
            unlink(self.gpu.claims_dir / f"{self.claim_id}.json")
            unlink(self.gpu.claims_dir / f"{self.claim_id}.lock")
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
