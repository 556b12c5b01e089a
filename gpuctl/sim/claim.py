"""One process's memory claim on the simulated GPU: grow it (if it fits), shrink it, release it."""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gpuctl.sim.errors import SimOutOfMemory
from gpuctl.sim.fs import unlink, write_json_atomic
from gpuctl.sim.liveness import pid_namespace

if TYPE_CHECKING:
    from gpuctl.sim.gpu import SimGpu


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
