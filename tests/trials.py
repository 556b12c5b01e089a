"""A randomised trial runner: many callers do random things to a few services on one
simulated GPU host, and the invariants that make gpuctl worth trusting are checked
all along.

The scenario is sized so that preemption happens often: a 120 GiB GPU; ``chat`` (80 GiB,
priority 100, ``preempt = true``); ``batch`` (30 GiB, priority 50, ``resume = true``);
``peer`` (20 GiB, priority 100: a victim of chat only once it has sat idle for its
``yield_after`` of 1 s, shorter than the 2 s idle timeout that lets reclaim stop it,
docs/explanation/priorities.md, "An idle server yields"); and ``gpuctl run`` jobs of
15 GiB at priority 40, 60 or 100, preemptible or not (tests/trials_priority.py). Chat
does not fit beside the batch and a job: it must stop the batch, or a preemptible job
below it, or find itself BUSY.

Each trial starts clean, opens with the batch (and often a preemptible job and the
peer), fires a random sequence of actions (``ensure``, ``ensure --no-wait``, ``stop``,
``touch``, ``status``, a caller killed with ``kill -9``, a caller killed inside the
spawn-to-record window, and what tests/trials_priority.py and tests/trials_reclaim.py
register), lets every caller finish, and checks:

- what tests/trials_invariants.py judges from the samples a sampler thread takes all
  along (one server per service; no admitted memory over the total; no claims over it;
  no out-of-memory line in any log; nothing preempted that was not a permitted victim,
  by whom; every stop explained), and counts preemptions, resumes and kills;
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

from gpuctl.config.values import DEFAULT_YIELD_AFTER_S
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import model_server_command, server_pids, service_toml
from tests.trials_invariants import (
    CallerFacts,
    Job,
    Observation,
    Outcome,
    Service,
    check_outcome,
)

GIB = 1024
# The hosts the runner is given (tests/test_trials.py, bench/trials.py) have this GPU.
TRIAL_GPU = "120GiB"
TOTAL_MIB = 120 * GIB
SAMPLE_S = 0.05


@dataclass(frozen=True)
class Svc:
    name: str
    port: int
    memory_gib: int
    load_time: str
    # Priorities for preemption (tests/trials_priority.py): higher wins.
    priority: int = 50
    preempt: bool = False  # `preempt = true`: any ensure of it may stop lower priorities
    resume: bool = False
    weight: float = 1.0  # how often actions pick it
    # Only the second laptop's config names it (tests/trials_configs.py): the main
    # config's callers count it by its record's promise alone.
    only_b: bool = False
    yield_after: float | None = DEFAULT_YIELD_AFTER_S  # seconds; None: "never"


@dataclass
class Caller:
    action: str
    service: str
    proc: subprocess.Popen[str]
    spawned: float = field(default_factory=time.time)
    ended: float | None = None  # when the sampler first saw it gone
    out: Path | None = None  # its stdout and stderr (and its CMD's, for gpuctl run)
    preempts: int | None = None  # the priority it may preempt for; None: never

    def facts(self) -> CallerFacts:
        text = ""
        if self.out is not None:
            with contextlib.suppress(OSError):
                text = self.out.read_text(errors="replace")
        return CallerFacts(
            self.action, self.service, self.spawned, self.ended, self.preempts, text, self.proc.pid
        )


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
    checked: Counter[str] = field(default_factory=Counter)  # invariant -> times judged
    jobs: dict[str, Job] = field(default_factory=dict)  # gpuctl run jobs (trials_priority)
    observations: list[Observation] = field(default_factory=list)
    # What every name of this trial starts with (its services and jobs).
    prefix: str = ""
    # A second laptop's config (names chat and the services only it knows), and the
    # same host read without its agent (the direct store): tests/trials_configs.py.
    cfg_b: Path | None = None
    cfg_direct: Path | None = None

    @property
    def out_dir(self) -> Path:
        return self.host.base / "trial-callers"

    def spawn(
        self,
        action: str,
        svc: Svc,
        *args: str,
        env: dict[str, str] | None = None,
        preempts: int | None = None,
        cfg: Path | None = None,
    ) -> None:
        """``cfg``: the caller's config (default: the one that names ``svc``)."""
        # The host's environment (its sim dir and GPU), not ours: a server started with
        # another sim dir would claim memory on another simulated GPU.
        full = self.host.env()
        if cfg is None:
            cfg = self.cfg_b if svc.only_b and self.cfg_b is not None else self.cfg
        full["GPUCTL_CONFIG"] = str(cfg)
        full.pop("GPUCTL_DEBUG", None)
        full.update(env or {})
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = self.out_dir / f"{len(self.callers)}.out"
        # A file, not a pipe: a gpuctl run's CMD inherits it and may outlive its caller.
        with out.open("w") as f:
            proc = subprocess.Popen(
                [gpuctl_exe(), *args],
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self.callers.append(Caller(action, svc.name, proc, out=out, preempts=preempts))

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


def preempts(s: Svc, asked: bool = False) -> int | None:
    """The priority an ensure of ``s`` may preempt for (``--preempt`` or its config)."""
    return s.priority if asked or s.preempt else None


@action("ensure", 4)
def _ensure(t: Trial, s: Svc) -> None:
    t.spawn("ensure", s, "ensure", s.name, "--json", "--timeout", "20s", preempts=preempts(s))


@action("ensure --no-wait", 2)
def _ensure_no_wait(t: Trial, s: Svc) -> None:
    t.spawn("ensure --no-wait", s, "ensure", s.name, "--json", "--no-wait", preempts=preempts(s))


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
            t.counts["kills"] += 1


@action("kill -9 in the window", 1.5)
def _kill_in_window(t: Trial, s: Svc) -> None:
    """An ensure that lingers between spawning its server and recording it, killed
    there if it gets that far within a moment (otherwise it carries on)."""
    env = {"GPUCTL_FAILPOINTS": "ensure.after_spawn=sleep:1.5"}
    t.spawn(
        "ensure (window)", s, "ensure", s.name, "--json", "--timeout", "20s",
        env=env, preempts=preempts(s),
    )  # fmt: skip
    caller = t.callers[-1]
    pause = t.rng.uniform(0.5, 1.5)

    def later() -> None:
        time.sleep(pause)
        if caller.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                caller.proc.kill()
                t.counts["kills"] += 1

    threading.Thread(target=later, daemon=True).start()


def scan(
    names: list[str], prefix: str = "\0"
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The live model-server pids of each service, and the live ``gpuctl run`` CMDs
    (``gpuctl.sim.hold --name JOB``, JOB starting with ``prefix``) by job name, in one
    pass over the processes."""
    import psutil

    servers: dict[str, list[int]] = {n: [] for n in names}
    jobs: dict[str, list[int]] = {}
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        argv = p.info["cmdline"] or []
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if "model-server" in argv:
            for n in names:
                if n in argv:
                    servers[n].append(p.info["pid"])
        elif argv[1:3] == ["-m", "gpuctl.sim.hold"] and "--name" in argv[:-1]:
            # CMD itself (its gpuctl run carries the same words in its own argv).
            job = argv[argv.index("--name") + 1]
            if job.startswith(prefix):  # this trial's own
                jobs.setdefault(job, []).append(p.info["pid"])
    return (
        {n: tuple(p) for n, p in servers.items()},
        {n: tuple(p) for n, p in jobs.items()},
    )


def servers_of(names: list[str]) -> dict[str, list[int]]:
    """The live model-server pids of each service, in one pass over the processes."""
    return {n: list(p) for n, p in scan(names)[0].items()}


def read_records(state_dir: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in sorted((state_dir / "records").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(f.read_text())
            if isinstance(data, dict):
                out[f.name[: -len(".json")]] = data
    return out


class Sampler:
    """Samples the host all along (tests/trials_invariants.py judges the samples), and
    notes when each caller is seen gone."""

    def __init__(self, trial: Trial) -> None:
        self.t = trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the end state, once every caller is done
        for c in self.t.callers:
            if c.ended is None and c.proc.poll() is not None:
                c.ended = time.time()

    def sample(self) -> None:
        from gpuctl.sim.gpu import SimGpu

        names = [s.name for s in self.t.services]
        state = self.t.host.state_dir
        before = read_records(state)
        at = time.time()
        servers, jobs = scan(names, self.t.prefix)
        claimed = None
        with contextlib.suppress(OSError, ValueError):
            claimed = sum(c.memory_mib for c in SimGpu(self.t.host.sim_dir).claims())
        after = read_records(state)
        # The records only count with the processes if they held still while those
        # were read: then each pid's liveness was seen while the records said what
        # they say.
        self.t.observations.append(
            Observation(at, servers, jobs, after, consistent=after == before, claimed_mib=claimed)
        )
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            now = time.time()
            for c in self.t.callers:
                if c.ended is None and c.proc.poll() is not None:
                    c.ended = now
            self._stop.wait(SAMPLE_S)


Check = Callable[[Trial], None]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Register an end-of-trial invariant: it appends to ``trial.violations``."""
    CHECKS.append(fn)
    return fn


def outcome(t: Trial) -> Outcome:
    """What the trial saw, for tests/trials_invariants.py."""
    logs = {}
    for f in sorted((t.host.state_dir / "logs").glob("*.log")):
        with contextlib.suppress(OSError):
            logs[f"log {f.name}"] = f.read_text(errors="replace")
    return Outcome(
        services=[
            Service(s.name, s.memory_gib * GIB, s.priority, yield_after_s=s.yield_after)
            for s in t.services
        ],
        total_mib=TOTAL_MIB,
        observations=t.observations,
        callers=[c.facts() for c in t.callers],
        jobs=t.jobs,
        logs=logs,
        agent=bool(t.host.agent_port),  # its loop heals without a caller (phases heal)
    )


@check
def check_observed(t: Trial) -> None:
    """The invariants over the samples (tests/trials_invariants.py), and its counts."""
    verdict = check_outcome(outcome(t))
    t.violations += verdict.violations
    t.checked.update(verdict.checked)
    t.counts.update(verdict.counts)


@check
def check_records(t: Trial) -> None:
    """Once every caller is done: do the records tell the truth about the processes?"""
    t.checked["service records match the processes"] += len(t.services)
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
                f"({json.dumps({k: rec.get(k) for k in ('since', 'attempts', 'start_nonce', 'lease')})}; "
                f"callers: {[(c.action, c.proc.returncode) for c in t.callers if c.service == s.name]})"
            )
        for pid in pids:
            if phase not in ("starting", "running", "stopping"):
                t.violations.append(f"{s.name}'s server {pid} runs, its record says {phase}")
            elif handle_pid is not None and handle_pid != pid:
                t.violations.append(f"{s.name}'s server {pid} runs, its record names {handle_pid}")


def reset(t: Trial) -> None:
    """Back to a clean host: no callers, no servers, no records, no logs."""
    for c in t.callers:
        with contextlib.suppress(ProcessLookupError):
            c.proc.kill()
        c.proc.wait()
    t.callers.clear()
    t.observations.clear()
    t.jobs.clear()
    for s in t.services:
        for pid in server_pids(s.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # A job's CMD runs in its own session: killing its `gpuctl run` leaves it to finish
    # on its own, which it would do in the next trial, under a name that trial reuses
    # but never started (an unexplained death there).
    for pids in scan([], t.prefix)[1].values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(server_pids(s.name) for s in t.services) and time.monotonic() < deadline:
        time.sleep(0.05)
    for d in (t.host.state_dir / "records", t.host.state_dir / "logs", t.out_dir):
        for f in d.glob("*"):
            with contextlib.suppress(OSError):
                f.unlink()


# What a report counts (tests/test_trials.py asserts each happened at least once).
COUNTED = ("preemptions", "victims named by their preemptor", "resumes", "kills")


@dataclass
class Report:
    seed: int
    trials: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)  # COUNTED, over all trials
    checked: Counter[str] = field(default_factory=Counter)  # invariant -> times judged

    def summary(self) -> str:
        lines = [
            f"seed {self.seed}: {self.trials} trials, {sum(self.actions.values())} actions "
            f"in {self.seconds:.0f} s, {self.samples} samples",
            "  " + ", ".join(f"{k}: {self.counts[k]}" for k in COUNTED),
            "  of them by a gpuctl run --preempt: "
            f"{self.counts['victims named by a run --preempt']} victims named "
            f"({self.actions['run --preempt']} run --preempt callers)",
            # Not required to happen: the peer must sit idle past its yield_after while
            # a preemptor needs its room.
            f"  idle servers yielded: {self.counts['idle servers yielded']}",
            "  invariants checked (times judged):",
        ]
        lines += [f"    {name}: {n}" for name, n in sorted(self.checked.items())]
        return "\n".join(lines)


def scenario(prefix: str) -> list[Svc]:
    """The services of a trial (see the module's docstring): chat preempts the batch;
    ``guest`` is known to the second laptop's config only."""
    return [
        Svc(f"{prefix}chat", free_port(), 80, "1.5s", 100, preempt=True, weight=3),
        Svc(f"{prefix}batch", free_port(), 30, "0.5s", 50, resume=True, weight=2),
        Svc(f"{prefix}peer", free_port(), 20, "0.5s", 100, weight=1, yield_after=1.0),
        Svc(f"{prefix}guest", free_port(), 25, "0.5s", 60, weight=1, only_b=True),
    ]


def service_tables(services: list[Svc]) -> str:
    """The ``[services.*]`` tables of ``services``, as every config of a trial has them."""
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
        toml += f"priority = {s.priority}\n"
        toml += "preempt = true\n" if s.preempt else ""
        toml += "resume = true\n" if s.resume else ""
        after = "never" if s.yield_after is None else f"{s.yield_after:g}s"
        toml += f'yield_after = "{after}"\n'
        toml += "\n"
    return toml


def opening(t: Trial, report: Report) -> None:
    """The batch (mostly), often a preemptible job and the peer: the room chat needs is
    then taken, and chat must preempt (or is BUSY)."""
    _chat, batch, peer = t.services[:3]
    first = [("ensure", batch)] if t.rng.random() < 0.9 else []
    if t.rng.random() < 0.7 and "run --preemptible" in ACTIONS:
        first.append(("run --preemptible", t.rng.choice(t.services)))
    if t.rng.random() < 0.5:
        first.append(("ensure --no-wait", peer))
    for name, s in first:
        ACTIONS[name][1](t, s)
        report.actions[name] += 1
    time.sleep(t.rng.uniform(0.3, 1.5))


# CI replays one fixed seed, so a red CI run is the code's doing and replays as it stands;
# elsewhere each run draws a new seed, so runs on laptops keep hunting new sequences.
CI_SEED = 180_418


def trial_seed(given: int | None = None) -> int:
    """The seed for a run: ``given`` (``--seed``), else ``GPUCTL_TRIALS_SEED``, else
    CI_SEED where ``CI`` is set (as CI services and ``./scripts/test`` there set it), else
    a fresh one. The report prints it with any violation, for a replay."""
    if given is not None:
        return given
    if os.environ.get("GPUCTL_TRIALS_SEED"):
        return int(os.environ["GPUCTL_TRIALS_SEED"])
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return CI_SEED
    return time.time_ns() % 1_000_000


def run_trials(
    host: SimHost,
    *,
    seed: int,
    trials: int | None = None,
    budget_s: float | None = None,
    until_counted_s: float | None = None,
    actions_per_trial: int = 8,
) -> Report:
    """Run ``trials`` trials, or as many as fit in ``budget_s`` (at least one); with
    ``until_counted_s``, go on past the budget (up to that long in all) while one of
    COUNTED has not happened yet."""
    from gpuctl.core.units import parse_size_mib

    if parse_size_mib(host.gpu_memory) != TOTAL_MIB:
        raise ValueError(f"the trials are sized for a {TRIAL_GPU} GPU, not {host.gpu_memory}")
    rng = random.Random(seed)
    # Names no other run on this machine carries (servers are told apart by name).
    prefix = f"t{secrets.token_hex(4)}"
    services = scenario(prefix)
    mine = [s for s in services if not s.only_b]
    trial = Trial(host, host.write_config(service_tables(mine)), services, rng, prefix=prefix)
    # The second laptop: chat (as the first names it) and what only it knows, through
    # the same agent; and the first laptop's services on the host without the agent.
    b = [s for s in services if s.only_b or s.preempt]
    agent_head = trial.cfg.read_text().split("[services.", 1)[0]
    trial.cfg_b = host.base / "laptop-b.toml"
    trial.cfg_b.write_text(agent_head + service_tables(b))
    trial.cfg_direct = host.base / "on-host.toml"
    trial.cfg_direct.write_text(
        f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{host.sim_dir}"\n\n' + service_tables(mine)
    )
    report = Report(seed)
    names = list(ACTIONS)
    weights = [ACTIONS[n][0] for n in names]
    t0 = time.monotonic()
    try:
        while True:
            with Sampler(trial) as sampler:
                opening(trial, report)
                for _ in range(actions_per_trial):
                    name = rng.choices(names, weights)[0]
                    svc = rng.choices(services, [s.weight for s in services])[0]
                    ACTIONS[name][1](trial, svc)
                    report.actions[name] += 1
                    time.sleep(rng.uniform(0.0, 0.4))
                for c in list(trial.callers):
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
            report.counts.update(trial.counts)
            report.checked.update(trial.checked)
            trial.counts.clear()
            trial.checked.clear()
            if trial.violations:
                tag = f"trial {report.trials} (seed {seed})"
                report.violations += [f"{tag}: {v}" for v in dict.fromkeys(trial.violations)]
                trial.violations.clear()
            reset(trial)
            for forget in RESETS:
                forget(trial)
            elapsed = time.monotonic() - t0
            if trials is not None and report.trials >= trials:
                break
            if budget_s is not None and elapsed >= budget_s:
                short = any(report.counts[k] == 0 for k in COUNTED)
                if not (short and until_counted_s is not None and elapsed < until_counted_s):
                    break
            if trials is None and budget_s is None:
                break
    finally:
        reset(trial)
        report.seconds = time.monotonic() - t0
    return report
