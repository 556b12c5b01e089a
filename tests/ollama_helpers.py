"""A simulated Ollama (``gpuctl sim ollama``) as a real process, for the tests that use one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.host import free_port

T = TypeVar("T")


def wait_until(what: str, pred: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``pred`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def claims_mib(sim_dir: Path) -> dict[str, int]:
    """The simulated GPU's live claims with memory, by claim name."""
    return {c.name: c.memory_mib for c in SimGpu(sim_dir).claims() if c.memory_mib > 0}


class SimOllama:
    """``python -m gpuctl sim ollama`` on a free loopback port, killed at the end."""

    def __init__(self, sim_dir: Path, logs: Path, *args: str, port: int | None = None) -> None:
        self.sim_dir = sim_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"ollama-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_SIM")}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuctl", "sim", "ollama", "--port", str(self.port),
                 "--sim-dir", str(sim_dir), *args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        wait_until("the simulated Ollama to listen", self._up)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.output()
        try:
            return httpx.get(self.url + "/", timeout=2).text == "Ollama is running"
        except httpx.TransportError:
            return False

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ps(self) -> dict[str, dict[str, object]]:
        models = httpx.get(self.url + "/api/ps", timeout=5).json()["models"]
        return {m["name"]: m for m in models}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
