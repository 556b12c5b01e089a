"""The model scheduler of the simulated Ollama (``gpuctl.sim.ollama``): what is loaded.

Ollama's rules as its ``server/sched.go`` applies them: one load at a time, a model
held by its requests (``refCount``) never unloads, ``keep_alive`` counts from the end
of the last request, and a model that does not fit first evicts this server's idle
models, shortest ``keep_alive`` first, then offloads the rest to the CPU.

Standard library and ``gpuctl.core`` / ``gpuctl.sim`` only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuctl.core.units import format_mib, parse_size_mib
from gpuctl.sim.console import log
from gpuctl.sim.errors import SimOutOfMemory
from gpuctl.sim.gpu import Claim, SimGpu

DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER = math.inf
# Go's time.ParseDuration units, which Ollama's keep_alive strings use.
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def normalize_model(name: str) -> str:
    """Ollama's model names: ``qwen3`` means ``qwen3:latest``."""
    name = name.strip()
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def parse_keep_alive(value: object) -> float:
    """Ollama's ``keep_alive``: seconds; negative means forever (``inf``); 0 means unload now.

    A number is seconds; a string is a Go duration (``"5m"``, ``"1h30m"``, ``"-1m"``) or a
    number of seconds (``"300"``).

    Raises:
        ValueError: anything else (Ollama answers 400).
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"keep_alive: expected a finite duration, got {value!r}")
        return FOREVER if value < 0 else float(value)
    if not isinstance(value, str):
        raise ValueError(f"keep_alive: expected a duration, got {type(value).__name__}")
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(number):
            raise ValueError(f"keep_alive: expected a finite duration, got {value!r}")
        return FOREVER if number < 0 else number
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    total, pos = 0.0, 0
    for m in _GO_DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f"keep_alive: time: invalid duration {value!r}")
    return FOREVER if sign < 0 and total > 0 else total


def iso_time(ts: float) -> str:
    """Go's RFC 3339 with nanoseconds and the local offset, as Ollama writes times."""
    if ts == FOREVER:
        # Ollama's "forever" is the largest duration from now: far in the future.
        ts = time.time() + 290 * 365.25 * 86400
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="microseconds")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model in the simulated library (``/api/tags``): its name and its size."""

    name: str
    memory_mib: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()

    @property
    def size_bytes(self) -> int:
        return self.memory_mib * 2**20

    def details(self) -> dict[str, Any]:
        family = self.name.split(":", 1)[0].split("/")[-1]
        return {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": "Q4_K_M",
        }


def parse_model_spec(text: str) -> ModelSpec:
    """``NAME=SIZE`` (``qwen3:32b=20GiB``) for ``--model``.

    Raises:
        ValueError: no ``=``, an empty name, or a size that does not parse.
    """
    name, sep, size = text.rpartition("=")
    if not sep or not name.strip():
        raise ValueError(f"--model: expected NAME=SIZE like 'qwen3:32b=20GiB', got {text!r}")
    try:
        mib = parse_size_mib(size)
    except ValueError as err:
        raise ValueError(f"--model {text!r}: {err}") from None
    if mib <= 0:
        raise ValueError(f"--model {text!r}: the size must be more than 0")
    return ModelSpec(normalize_model(name), mib)


@dataclass(slots=True)
class Runner:
    """A loaded (or loading) model: Ollama's runnerRef."""

    spec: ModelSpec
    claim: Claim
    vram_mib: int
    session_s: float
    loaded: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    refs: int = 0
    expires_at: float = FOREVER  # wall clock; set when the last request ends


class Ollama:
    """The server's state, shared by the request threads.

    Args:
        sim: the simulated GPU.
        models: the library; requests for other models get 404.
        load_time_s: how long a load takes.
        keep_alive_s: the default ``keep_alive`` (``inf``: forever; 0: unload at once).
        token_delay_s: the time each generated token takes.
        steps: the memory of a load grows in this many steps.
    """

    def __init__(
        self,
        sim: SimGpu,
        models: list[ModelSpec],
        *,
        load_time_s: float = 2.0,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        token_delay_s: float = 0.02,
        steps: int = 5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sim = sim
        self.library = {m.name: m for m in models}
        self.load_time_s = load_time_s
        self.keep_alive_s = keep_alive_s
        self.token_delay_s = token_delay_s
        self.steps = max(1, steps)
        self.clock = clock
        self.lock = threading.Lock()  # guards runners and their refs
        self.load_lock = threading.Lock()  # one load at a time, like Ollama's scheduler
        self.runners: dict[str, Runner] = {}

    # -- scheduling

    @contextlib.contextmanager
    def use(self, name: str, keep_alive_s: float | None) -> Iterator[Runner]:
        """Load ``name`` if needed and hold it for the block (it cannot unload meanwhile).

        Raises:
            KeyError: not in the library.
            RuntimeError: the load failed (the message is Ollama's error text).
        """
        runner = self._acquire(name, keep_alive_s)
        try:
            yield runner
        finally:
            self._release(runner)

    def _acquire(self, name: str, keep_alive_s: float | None) -> Runner:
        spec = self.library[name]
        session = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        with self.lock:
            runner = self.runners.get(name)
            if runner is not None:
                self._ref(runner, session)
        if runner is None:
            runner = self._load(spec, session)
        runner.loaded.wait()
        if runner.error is None:
            return runner
        self._release(runner)
        raise RuntimeError(runner.error)

    @staticmethod
    def _ref(runner: Runner, session_s: float) -> None:
        """One more request on ``runner`` (under ``self.lock``): its clock stops meanwhile."""
        runner.refs += 1
        runner.session_s = session_s
        runner.expires_at = FOREVER

    def _release(self, runner: Runner) -> None:
        with self.lock:
            runner.refs -= 1
            if runner.refs == 0:
                runner.expires_at = self.clock() + runner.session_s
        self.expire()

    def _load(self, spec: ModelSpec, session_s: float) -> Runner:
        """Load ``spec`` (or join the load that got there first); returns it with a ref held."""
        with self.load_lock:
            with self.lock:
                existing = self.runners.get(spec.name)
                if existing is not None:
                    self._ref(existing, session_s)
                    return existing  # another request loaded it while we waited our turn
            claim = self.sim.claim(f"ollama {spec.name}")
            try:
                vram = self._make_room(spec.memory_mib)
            except BaseException:
                claim.release()
                raise
            runner = Runner(spec, claim, vram, session_s, refs=1)
            with self.lock:
                self.runners[spec.name] = runner  # listed in /api/ps from now on
            where = "" if vram == spec.memory_mib else f" ({format_mib(vram)} on the GPU)"
            log(f"INFO loading {spec.name}: {format_mib(spec.memory_mib)}{where}")
            t0 = time.monotonic()
            try:
                for i in range(1, self.steps + 1):
                    time.sleep(max(0.0, t0 + self.load_time_s * i / self.steps - time.monotonic()))
                    claim.set(vram * i // self.steps)
            except SimOutOfMemory as err:
                runner.error = (
                    "llama runner process has terminated: cudaMalloc failed: out of memory "
                    f"({err.message})"
                )
                log(f"ERROR {runner.error}", err=True)
                with self.lock:
                    self.runners.pop(spec.name, None)
                claim.release()
            else:
                log(f"INFO loaded {spec.name} in {time.monotonic() - t0:.2f} seconds")
            runner.loaded.set()
            return runner

    def _make_room(self, need_mib: int) -> int:
        """How much of the model goes on the GPU, evicting our idle models first if needed."""
        while True:
            free = self.sim.total_mib - self.sim.used_mib()
            if need_mib <= free:
                return need_mib
            with self.lock:
                idle = [
                    r
                    for r in self.runners.values()
                    if r.refs == 0 and r.loaded.is_set() and r.error is None
                ]
                # Ollama unloads the runner with the shortest keep_alive first.
                victim = min(idle, key=lambda r: r.session_s, default=None)
                if victim is not None:
                    self.runners.pop(victim.spec.name, None)
            if victim is None:
                return max(0, free)  # the rest goes to the CPU
            log(f"INFO unloading {victim.spec.name} to make room")
            victim.claim.release()

    def expire(self) -> None:
        """Unload every model whose keep_alive has run out and that serves no request."""
        now = self.clock()
        with self.lock:
            gone = [
                r
                for r in self.runners.values()
                if r.refs == 0 and r.loaded.is_set() and r.expires_at <= now
            ]
            for r in gone:
                self.runners.pop(r.spec.name, None)
        for r in gone:
            r.claim.release()
            log(f"INFO unloaded {r.spec.name}")

    def unload(self, name: str) -> None:
        """``keep_alive: 0`` with nothing to do: unload now, or when its requests end.

        A model that is loading holds its loader's reference, so it unloads as soon as
        that load (and every other request on it) is over.
        """
        with self.lock:
            runner = self.runners.get(name)
            if runner is None:
                return
            runner.session_s = 0.0
            if runner.refs == 0:
                runner.expires_at = 0.0
        self.expire()

    def release_all(self) -> None:
        with self.lock:
            runners = list(self.runners.values())
            self.runners.clear()
        for r in runners:
            r.claim.release()

    # -- views

    def ps(self) -> list[dict[str, Any]]:
        with self.lock:
            runners = sorted(self.runners.values(), key=lambda r: r.spec.name)
            rows = []
            for r in runners:
                expires = r.expires_at
                if expires == FOREVER and r.session_s != FOREVER:
                    # In use (or loading): Ollama shows now + the session, not "forever".
                    expires = self.clock() + r.session_s
                rows.append(
                    {
                        "name": r.spec.name,
                        "model": r.spec.name,
                        "size": r.spec.size_bytes,
                        "digest": r.spec.digest,
                        "details": r.spec.details(),
                        "expires_at": iso_time(expires),
                        "size_vram": r.vram_mib * 2**20,
                        "context_length": 4096,
                    }
                )
        return rows

    def tags(self) -> list[dict[str, Any]]:
        return [
            {
                "name": m.name,
                "model": m.name,
                "modified_at": iso_time(0.0),
                "size": m.size_bytes,
                "digest": m.digest,
                "details": m.details(),
            }
            for m in sorted(self.library.values(), key=lambda m: m.name)
        ]
