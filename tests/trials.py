"""A randomised trial runner: many callers do random things to a few services on one
simulated GPU host, and the invariants that make gpuctl worth trusting are checked
all along.

Each trial starts clean, fires a random sequence of actions (``ensure``, ``ensure
--no-wait``, ``stop``, ``touch``, ``status``, a caller killed with ``kill -9``, a caller
killed inside the spawn-to-record window), lets every caller finish, and checks:

- one server per service, ever (a sampler thread watches the processes all along);
- no overcommit: two services that do not fit together never run together, the
  simulated GPU's claims never pass its total, and no server dies of out-of-memory;
- the records match the processes once the callers are done: a ``running`` record names
  a live server of its service (or, when a start's caller died before recording it and
  a touch saw the server answer, has no handle and one runs); a live server is named by
  its service's record, or the record is such a start (``starting`` or ``running``, no
  handle); never ``stopped`` or ``failed`` with a server running.

Actions are registered by name with a weight (``@action("name", weight)``), and
end-of-trial invariants with ``@check``, so later work (reclaim, preemption, ``run``)
adds its own without touching the loop. Used by
``tests/test_trials.py`` (bounded in time) and ``bench/trials.py`` (``--trials N``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import model_server_command, server_pids, service_toml

GIB = 1024
TOTAL_MIB = 128 * GIB


@dataclass(frozen=True)
class Svc:
    name: str
    port: int
    memory_gib: int
    load_time: str
    # Priorities for preemption (tests/trials_priority.py): higher wins.
    priority: int = 50
    extra: str = ""


@dataclass
class Caller:
    action: str
    service: str
    proc: subprocess.Popen[str]


@dataclass
class Trial:
    """One host, its services, and the callers in flight."""

    host: SimHost
    cfg: Path
    services: list[Svc]
    rng: random.Random
    callers: list[Caller] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def spawn(self, action: str, svc: Svc, *args: str, env: dict[str, str] | None = None) -> None:
        # The host's environment (its sim dir and GPU), not ours: a server started with
        # another sim dir would claim memory on another simulated GPU.
        full = self.host.env()
        full["GPUCTL_CONFIG"] = str(self.cfg)
        full.pop("GPUCTL_DEBUG", None)
        full.update(env or {})
        proc = subprocess.Popen(
            [gpuctl_exe(), *args],
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.callers.append(Caller(action, svc.name, proc))

    def live_callers(self) -> list[Caller]:
        return [c for c in self.callers if c.proc.poll() is None]

    def record(self, name: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(
                (self.host.state_dir / "records" / f"{name}.json").read_text()
            )
        except (OSError, ValueError):
            return {}
        return data


Action = Callable[[Trial, Svc], None]
ACTIONS: dict[str, tuple[float, Action]] = {}
# What to forget between trials (later work registers its own: tests/trials_reclaim.py);
# its invariants register with @check below.
RESETS: list[Callable[[Trial], None]] = []


def action(name: str, weight: float) -> Callable[[Action], Action]:
    """Register an action the runner may pick, ``weight`` times as often as weight 1."""

    def register(fn: Action) -> Action:
        ACTIONS[name] = (weight, fn)
        return fn

    return register


@action("ensure", 4)
def _ensure(t: Trial, s: Svc) -> None:
    t.spawn("ensure", s, "ensure", s.name, "--json", "--timeout", "20s")


@action("ensure --no-wait", 2)
def _ensure_no_wait(t: Trial, s: Svc) -> None:
    t.spawn("ensure --no-wait", s, "ensure", s.name, "--json", "--no-wait")


@action("stop", 1.5)
def _stop(t: Trial, s: Svc) -> None:
    t.spawn("stop", s, "stop", s.name, "--json")


@action("touch", 1)
def _touch(t: Trial, s: Svc) -> None:
    t.spawn("touch", s, "touch", s.name)


@action("status", 1)
def _status(t: Trial, s: Svc) -> None:
    t.spawn("status", s, "status", "--json")


@action("kill -9", 2)
def _kill(t: Trial, s: Svc) -> None:
    live = [c for c in t.live_callers() if c.action != "status"]
    if live:
        with contextlib.suppress(ProcessLookupError):
            t.rng.choice(live).proc.kill()


@action("kill -9 in the window", 1.5)
def _kill_in_window(t: Trial, s: Svc) -> None:
    """An ensure that lingers between spawning its server and recording it, killed
    there if it gets that far within a moment (otherwise it carries on)."""
    env = {"GPUCTL_FAILPOINTS": "ensure.after_spawn=sleep:1.5"}
    t.spawn("ensure (window)", s, "ensure", s.name, "--json", "--timeout", "20s", env=env)
    caller = t.callers[-1]

    def later() -> None:
        time.sleep(t.rng.uniform(0.5, 1.5))
        with contextlib.suppress(ProcessLookupError):
            caller.proc.kill()

    threading.Thread(target=later, daemon=True).start()


def servers_of(names: list[str]) -> dict[str, list[int]]:
    """The live model-server pids of each service, in one pass over the processes."""
    import psutil

    out: dict[str, list[int]] = {n: [] for n in names}
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        argv = p.info["cmdline"] or []
        if p.info["status"] == psutil.STATUS_ZOMBIE or "model-server" not in argv:
            continue
        for n in names:
            if n in argv:
                out[n].append(p.info["pid"])
    return out


class Sampler:
    """Watches the invariants that must hold at every moment, not just at the end."""

    def __init__(self, trial: Trial, exclusive: list[tuple[str, str]]) -> None:
        self.t = trial
        self.exclusive = exclusive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from gpuctl.sim.gpu import SimGpu

        gpu = SimGpu(self.t.host.sim_dir)
        while not self._stop.is_set():
            self.samples += 1
            alive = servers_of([s.name for s in self.t.services])
            for name, pids in alive.items():
                if len(pids) > 1:
                    self.t.violations.append(f"{len(pids)} servers of {name}: {pids}")
            for a, b in self.exclusive:
                if alive[a] and alive[b]:
                    self.t.violations.append(f"{a} and {b} run together (they do not fit)")
            with contextlib.suppress(OSError, ValueError):
                used = sum(c.memory_mib for c in gpu.claims())
                if used > TOTAL_MIB:
                    self.t.violations.append(f"overcommit: {used} MiB claimed of {TOTAL_MIB}")
            self._stop.wait(0.05)


Check = Callable[[Trial], None]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Register an end-of-trial invariant: it appends to ``trial.violations``."""
    CHECKS.append(fn)
    return fn


@check
def check_records(t: Trial) -> None:
    """Once every caller is done: do the records tell the truth about the processes?"""
    for s in t.services:
        rec = t.record(s.name)
        pids = server_pids(s.name)
        phase = rec.get("phase", "stopped")
        handle_pid = (rec.get("handle") or {}).get("pid")
        # `running` names a live server of its service; or, for a start whose caller went
        # before recording it (no handle) and that a touch saw answer, one runs.
        if phase == "running" and (handle_pid not in pids if handle_pid else not pids):
            t.violations.append(
                f"{s.name} is running by its record, but pid {handle_pid} is not "
                f"({json.dumps({k: rec.get(k) for k in ('since', 'attempts', 'start_nonce')})}; "
                f"callers: {[(c.action, c.proc.returncode) for c in t.callers if c.service == s.name]})"
            )
        for pid in pids:
            if phase not in ("starting", "running", "stopping"):
                t.violations.append(f"{s.name}'s server {pid} runs, its record says {phase}")
            elif handle_pid is not None and handle_pid != pid:
                t.violations.append(f"{s.name}'s server {pid} runs, its record names {handle_pid}")
        log = t.host.state_dir / "logs" / f"{s.name}.log"
        with contextlib.suppress(OSError):
            if "CUDA out of memory" in log.read_text(errors="replace"):
                t.violations.append(f"{s.name} died of out-of-memory")


def reset(t: Trial) -> None:
    """Back to a clean host: no callers, no servers, no records, no logs."""
    for c in t.callers:
        with contextlib.suppress(ProcessLookupError):
            c.proc.kill()
        c.proc.wait()
    t.callers.clear()
    for s in t.services:
        for pid in server_pids(s.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(server_pids(s.name) for s in t.services) and time.monotonic() < deadline:
        time.sleep(0.05)
    for d in ("records", "logs"):
        for f in (t.host.state_dir / d).glob("*"):
            with contextlib.suppress(OSError):
                f.unlink()


@dataclass
class Report:
    seed: int
    trials: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0


def run_trials(
    host: SimHost,
    *,
    seed: int,
    trials: int | None = None,
    budget_s: float | None = None,
    actions_per_trial: int = 8,
) -> Report:
    """Run ``trials`` trials, or as many as fit in ``budget_s`` (at least one)."""
    rng = random.Random(seed)
    # Names no other run on this machine carries (servers are told apart by name).
    prefix = f"t{secrets.token_hex(4)}"
    services = [
        Svc(f"{prefix}big", free_port(), 80, "1.5s", 100),
        Svc(f"{prefix}rival", free_port(), 80, "1s", 60),
        Svc(f"{prefix}small", free_port(), 20, "0.5s", 40, "resume = true"),
    ]
    toml = ""
    for s in services:
        t = service_toml(
            s.name, s.port, model_server_command(s.name, s.port, f"{s.memory_gib}GiB", s.load_time)
        )
        toml += t.replace('memory = "20GiB"', f'memory = "{s.memory_gib}GiB"').replace(
            'health_timeout = "60s"',
            # A short idle timeout gives reclaim (tests/trials_reclaim.py) work to do.
            'health_timeout = "20s"\nstop_timeout = "3s"\nidle_timeout = "2s"',
        )
        toml += f"priority = {s.priority}\n{s.extra}\n"
    trial = Trial(host, host.write_config(toml), services, rng)
    report = Report(seed)
    names = list(ACTIONS)
    weights = [ACTIONS[n][0] for n in names]
    t0 = time.monotonic()
    try:
        while True:
            with Sampler(trial, [(services[0].name, services[1].name)]) as sampler:
                for _ in range(actions_per_trial):
                    name = rng.choices(names, weights)[0]
                    ACTIONS[name][1](trial, rng.choice(services))
                    report.actions[name] += 1
                    time.sleep(rng.uniform(0.0, 0.4))
                for c in trial.callers:
                    try:
                        c.proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        trial.violations.append(f"{c.action} {c.service} still runs after 60 s")
                        c.proc.kill()
                        c.proc.wait()
            report.samples += sampler.samples
            for end_check in CHECKS:
                end_check(trial)
            report.trials += 1
            if trial.violations:
                tag = f"trial {report.trials} (seed {seed})"
                report.violations += [f"{tag}: {v}" for v in dict.fromkeys(trial.violations)]
                trial.violations.clear()
            reset(trial)
            for forget in RESETS:
                forget(trial)
            if trials is not None and report.trials >= trials:
                break
            if budget_s is not None and time.monotonic() - t0 >= budget_s:
                break
            if trials is None and budget_s is None:
                break
    finally:
        reset(trial)
        report.seconds = time.monotonic() - t0
    return report
