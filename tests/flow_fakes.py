"""Fakes for driving the flows as pure units: a manual clock, a scripted health endpoint,
a scripted agent and a launcher that records what it was asked. The store is the real
``DirectStore`` on ``tmp_path`` (files are cheap and real), on the fake clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.machine import ThisMachine
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.config import Config, ServiceConfig, load_config
from gpuctl.core.decision import Health
from gpuctl.core.snapshot import GpuProcess, HostIdentity, Snapshot, StartingProcess
from gpuctl.errors import AgentUnavailable
from gpuctl.flows.deps import EnsureDeps
from gpuctl.flows.ports import Launchers, Probe, ServerChecks

GIB = 1024


class Elsewhere(ThisMachine):
    """This process, on a machine that says it is ``here`` (holders stay this process's
    own, so the store judges their leases as it judges any)."""

    def __init__(self, here: HostIdentity) -> None:
        self._here = here

    @property
    def here(self) -> HostIdentity:
        return self._here


class Clock:
    """A manual clock; ``sleep`` advances it (no test ever waits in real time)."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


@dataclass
class Agent:
    """A scripted agent: the processes on the GPU, or an error; records what it was asked."""

    total_mib: int = 128 * GIB
    processes: list[GpuProcess] = field(default_factory=list)
    starting: list[StartingProcess] = field(default_factory=list)
    error: str | None = None
    taken_at: str = "2027-01-15T08:00:00.000Z"
    asked: list[tuple[list[str], list[int]]] = field(default_factory=list)

    def read(self, keywords: Sequence[str], pids: Sequence[int]) -> Snapshot:
        self.asked.append((list(keywords), list(pids)))
        if self.error:
            raise AgentUnavailable(self.error, hint="is the agent up?")
        used = sum(p.memory_mib or 0 for p in self.processes)
        return Snapshot(
            memory_used_mib=used,
            memory_total_mib=self.total_mib,
            unified_memory=False,
            probe="fake",
            taken_at=self.taken_at,
            processes=tuple(self.processes),
            starting=tuple(self.starting),
            host=HostIdentity("gpu-host", "boot-1"),
        )

    @property
    def taken_epoch(self) -> float:
        from datetime import datetime

        return datetime.fromisoformat(self.taken_at).timestamp()


class Health_:
    """A health endpoint that answers ``refused`` until told otherwise."""

    def __init__(self) -> None:
        self.answers: list[Health] = []
        self.default = Health("refused", "connection refused")
        self.calls = 0

    def ready_after(self, n: int) -> None:
        self.answers = [self.default] * n + [Health("ready", "HTTP 200", 200)]

    def __call__(self) -> Health:
        self.calls += 1
        if self.answers:
            h = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            return h
        return self.default


@dataclass
class Launcher:
    """Records starts and stops; ``dies`` makes the started server exit at once."""

    kind: str = "process"
    dies: bool = False
    started: list[str] = field(default_factory=list)
    stopped: list[Handle] = field(default_factory=list)
    on_start: Callable[[], None] | None = None
    nonces: list[str | None] = field(default_factory=list)
    finds: list[str | None] = field(default_factory=list)
    found: Handle | None = None  # what find() answers
    dead_pids: set[int] = field(default_factory=set)  # alive() says False for these

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        self.started.append(service.name)
        self.nonces.append(start_nonce)
        if self.on_start:
            self.on_start()
        return Handle(kind=self.kind, pid=4242, pid_start=1.0)

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        self.finds.append(start_nonce)
        return self.found

    def alive(self, handle: Handle) -> bool | None:
        if handle.pid in self.dead_pids:
            return False
        return not self.dies

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        self.stopped.append(handle)

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        return "loading weights\nCUDA out of memory" if self.dies else "loading weights"

    def close(self) -> None:
        pass


SERVICES = """
[hosts.dgx]
agent = "http://127.0.0.1:9"

[services.vllm]
host = "dgx"
launcher = "process"
command = "vllm serve m"
health = "http://127.0.0.1:8000/health"
match = ["vllm"]
memory = "80GiB"
health_timeout = "60s"

[services.photos]
host = "dgx"
match = ["photo-batch"]
memory = "30GiB"
"""


def config(tmp_path: Path, text: str = SERVICES) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path)


@dataclass
class World:
    """One service's deps, all fakes but the store."""

    config: Config
    clock: Clock
    agent: Agent
    health: Health_
    launcher: Launcher
    store: DirectStore

    def deps(self, service: str = "vllm") -> EnsureDeps:
        svc = self.config.service(service)
        return EnsureDeps(
            config=self.config,
            service=svc,
            host=self.config.host(svc.host),
            store=self.store,
            probe=Probe(self.agent.read),
            launchers=Launchers(lambda snap: self.launcher),
            servers=ServerChecks(self.health),
            machine=ThisMachine(),
            clock=self.clock,
            sleep=self.clock.sleep,
        )


def world(tmp_path: Path) -> World:
    clock = Clock()
    return World(
        config=config(tmp_path),
        clock=clock,
        agent=Agent(),
        health=Health_(),
        launcher=Launcher(),
        store=DirectStore(tmp_path / "state", clock=clock),
    )
