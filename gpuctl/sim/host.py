"""A throw-away simulated GPU host: a sim directory, an agent on loopback, and helpers
to start real simulated workloads on it. Used by ``gpuctl demo``, the tests and the
benches.

Every process it starts is a real process (``python -m gpuctl ...``), so what the
agent reports is what a real host would report: real pids, real command lines. Like
the rest of ``gpuctl.sim`` it needs only the standard library (the agent's readiness is
asked with ``urllib``), so it runs in a bare container.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from gpuctl.sim.errors import SimError


class SimHostError(SimError):
    """The simulated host's agent did not come up."""


def _limit_nofile(n: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


# ``LO-HI``: the block of loopback ports ``free_port`` hands out, instead of the kernel's
# pick. The test suite gives each of its parallel workers a block of its own, below the
# kernel's ephemeral range (``tests/conftest.py``): a port picked there is never the one
# another worker just picked, nor one that an outgoing connection took meanwhile, both of
# which happen with the kernel's pick, since the port is free again once it is returned.
PORTS_ENV = "GPUCTL_SIM_PORTS"
_cursor: list[int] = []  # this process's next port in its block


def free_port() -> int:
    """A loopback port nothing is bound to now, for a server about to start.

    Raises:
        SimError: ``GPUCTL_SIM_PORTS`` is not ``LO-HI``, or every port of it is taken.
    """
    block = os.environ.get(PORTS_ENV)
    if not block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    lo, _, hi = block.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 1024 <= int(lo) <= int(hi) <= 65535):
        raise SimError(f"{PORTS_ENV}={block[:40]!r}: expected LO-HI, ports from 1024 to 65535")
    first, last = int(lo), int(hi)
    if not _cursor:  # processes sharing a block start apart, and go round it in turn
        _cursor.append(first + secrets.randbelow(last - first + 1))
    for _ in range(last - first + 1):
        port = _cursor[0]
        _cursor[0] = first if port >= last else port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SimError(f"every port of {PORTS_ENV}={block} is taken")


@dataclass
class SimHost:
    """A simulated GPU host in a temporary directory.

    Args:
        gpu_memory: the simulated GPU's total, e.g. ``128GiB``.
        root: where to put it; a fresh temp dir by default (removed on exit).
    """

    gpu_memory: str = "128GiB"
    root: Path | None = None
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    agent_port: int = 0
    # The agent's --health-ports: its model servers listen on ports ``free_port`` picks
    # (the kernel's, or a ``GPUCTL_SIM_PORTS`` block), so it may fetch any unprivileged
    # port of loopback. The agent's own rule (this machine only) still holds.
    health_ports: str = "1024-65535"
    # The loopback address its agent listens on: several simulated hosts on one machine
    # each take their own (127.0.0.2, ...), so a pool's ``{host}`` tells them apart.
    address: str = "127.0.0.1"
    _own_root: bool = False

    def __enter__(self) -> SimHost:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="gpuctl-sim-"))
            self._own_root = True
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def base(self) -> Path:
        assert self.root is not None
        return self.root

    @property
    def sim_dir(self) -> Path:
        return self.base / "sim"

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    @property
    def agent_url(self) -> str:
        return f"http://{self.address}:{self.agent_port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            GPUCTL_SIM_DIR=str(self.sim_dir),
            GPUCTL_SIM_GPU_MEMORY=self.gpu_memory,
            GPUCTL_STATE_DIR=str(self.state_dir),
            PYTHONUNBUFFERED="1",
        )
        return env

    def command_prefix(self) -> list[str]:
        """What runs each of its processes (none here; a host in a network namespace
        says ``ip netns exec NAME``, which execs the command: the pid stays its own)."""
        return []

    def spawn(
        self,
        args: Sequence[str],
        log_name: str,
        extra_env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``python -m gpuctl ARGS`` detached from our terminal, logging to a file.
        ``nofile``: its descriptor limit, soft and hard (a service manager's, for the
        flood tests)."""
        log = open(self.base / f"{log_name}.log", "ab")  # noqa: SIM115  (the child owns it)
        env = self.env()
        if extra_env:
            env.update(extra_env)
        proc = subprocess.Popen(
            [*self.command_prefix(), sys.executable, "-m", "gpuctl", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if nofile is None else lambda: _limit_nofile(nofile),  # noqa: PLW1509  (setrlimit only)
        )
        log.close()
        self.procs.append(proc)
        return proc

    def start_agent(
        self, timeout_s: float = 20.0, args: Sequence[str] = (), nofile: int | None = None
    ) -> None:
        """Start ``gpuctl agent --probe sim [ARGS]`` on a free loopback port and wait for
        /healthz. ``nofile``: the agent's descriptor limit (``spawn``). ``--health-ports``
        is ``health_ports`` unless ARGS name it."""
        import urllib.error
        import urllib.request

        self.agent_port = free_port()
        proc = self.spawn(
            [
                "agent",
                "--probe",
                "sim",
                "--listen",
                f"{self.address}:{self.agent_port}",
                "--sim-dir",
                str(self.sim_dir),
                "--state-dir",
                str(self.state_dir),
                "--cache-ttl",
                "0.2s",
                *([] if "--health-ports" in args else ["--health-ports", self.health_ports]),
                *args,
            ],
            "agent",
            {"GPUCTL_AGENT_TOKEN": self.token},
            nofile,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SimHostError(
                    f"the simulated host's agent exited: {self.log_tail('agent')}",
                    hint="run again with GPUCTL_DEBUG=1",
                )
            try:
                with urllib.request.urlopen(f"{self.agent_url}/healthz", timeout=0.5) as r:  # noqa: S310  (our loopback agent)
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise SimHostError("the simulated host's agent did not start in time")

    def hold(self, name: str, memory: str) -> subprocess.Popen[bytes]:
        return self.spawn(["sim", "hold", "--name", name, "--memory", memory], name)

    def model_server(
        self, name: str, memory: str, load_time: str, port: int, *extra: str
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            [
                "sim",
                "model-server",
                "--name",
                name,
                "--memory",
                memory,
                "--load-time",
                load_time,
                "--port",
                str(port),
                *extra,
            ],
            name,
        )

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.base / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def write_config(self, services_toml: str, token_env: str = "GPUCTL_DEMO_TOKEN") -> Path:  # noqa: S107
        """A config with one host ``sim`` (this agent) and the given ``[services.*]`` tables."""
        os.environ[token_env] = self.token
        path = self.base / "config.toml"
        path.write_text(
            f'[hosts.sim]\nagent = "{self.agent_url}"\ntoken_env = "{token_env}"\n\n{services_toml}'
        )
        return path

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()
        self.stop_claimants()

    def stop_claimants(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (then SIGKILL) every process that holds memory on this simulated GPU,
        such as servers that ``gpuctl ensure`` launched detached."""
        from gpuctl.sim.gpu import SimGpu

        if not self.sim_dir.exists():
            return
        pids = {c.pid for c in SimGpu(self.sim_dir, define=False).claims()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and SimGpu(self.sim_dir, define=False).claims():
                time.sleep(0.1)
            if not SimGpu(self.sim_dir, define=False).claims():
                return
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def sim_hosts(hosts: Iterable[SimHost]) -> Iterator[list[SimHost]]:
    """Each of ``hosts`` made and its agent started, in order (a pool of simulated hosts
    on one machine, each on its own address); all closed on the way out, also when one
    fails to start."""
    started: list[SimHost] = []
    try:
        for h in hosts:
            h.__enter__()
            started.append(h)
            h.start_agent()
        yield started
    finally:
        for h in started:
            h.close()
