"""Whether this machine has an NVIDIA GPU that answers: NVML first, then ``nvidia-smi -L``.

Used by ``gpuctl config init`` to choose between "this machine is the GPU host, probed
directly" and "the GPU is elsewhere, behind an agent". It never raises: anything that
does not answer is no GPU.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess


def local_gpu_answers(timeout_s: float = 5.0) -> bool:
    """True when NVML initialises and counts a device, or ``nvidia-smi -L`` lists one.

    Equivalent to ``nvidia-smi -L`` printing a ``GPU 0: …`` line.
    """
    if _nvml_counts_a_device():
        return True
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return False
    try:
        r = subprocess.run(
            [binary, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and any(line.startswith("GPU ") for line in r.stdout.splitlines())


def _nvml_counts_a_device() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, driver/library mismatch: no NVML here
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):  # shutting down a library that half-failed
            pynvml.nvmlShutdown()
