"""The simulated GPU's errors, standard library only.

``gpuctl.sim`` runs in a bare container, so it cannot import ``gpuctl.errors``; these carry
the same ``message`` / ``hint`` / ``exit_code`` and the CLI turns them into its own errors.
"""

from __future__ import annotations


class SimError(Exception):
    """The simulated GPU cannot do what was asked (a bad setting, an unwritable directory).

    Attributes:
        message: one line saying what went wrong.
        hint: one line naming the fix, or empty.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


def cuda_size(mib: float) -> str:
    """PyTorch's way of writing sizes in its OOM message: ``8.00 GiB``, ``20.00 MiB``."""
    if abs(mib) >= 1024:
        return f"{mib / 1024:.2f} GiB"
    return f"{mib:.2f} MiB"


class SimOutOfMemory(SimError):
    """A claim did not fit: the simulated ``torch.OutOfMemoryError``.

    Attributes:
        requested_mib: what the failed step tried to allocate on top of what it held.
        free_mib: what was free on the simulated GPU (total minus every live claim).
        total_mib: the simulated GPU's total.
        holders: (pid, memory_mib) of the other live claims on that GPU, largest first.
        gpu: the simulated GPU it did not fit on.
    """

    def __init__(
        self,
        requested_mib: int,
        free_mib: int,
        total_mib: int,
        holders: tuple[tuple[int, int], ...] = (),
        gpu: int = 0,
    ) -> None:
        self.gpu = gpu
        self.requested_mib = requested_mib
        self.free_mib = max(0, free_mib)
        self.total_mib = total_mib
        self.holders = holders
        msg = (
            f"CUDA out of memory. Tried to allocate {cuda_size(requested_mib)}. "
            f"GPU {gpu} has a total capacity of {cuda_size(total_mib)} of which "
            f"{cuda_size(self.free_mib)} is free."
        )
        # Real PyTorch names the other processes too; that is what makes the message useful.
        msg += "".join(
            f" Process {pid} has {cuda_size(mib)} memory in use." for pid, mib in holders
        )
        super().__init__(msg, hint="free GPU memory first; `gpuctl sim ls` shows who holds it")
