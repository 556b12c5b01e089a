"""Victim planning for preemption: which running work to stop so a service fits.

``plan_victims`` is pure. A service that fits on no GPU it may use is PREEMPTABLE when
stopping some *victims* on one GPU would free enough memory there. A victim is:

- a managed service (gpuctl started it, and its record names its server) of strictly
  lower priority than the one asking, with no start, stop or wake under way (no lease)
  and no request in flight (unless ``force``: then in-flight work may be cut short), or
- a ``gpuctl run`` job started with ``--preemptible``, of strictly lower priority, whose
  CMD runs where the caller or the host's agent can signal it.

Never a foreign process (it has no share: ``GpuRoom.shares`` lists services only), never
a ``run`` job that is not preemptible, never equal or higher priority, with one
exception: a server that has *yielded* (``yields``). Unused for at least its
``yield_after``, with no request in flight and no lease, it is a victim whatever the
priorities, even under ``force`` only when nothing is in flight (a request in flight
means it is in use, not idle). An idle chat at priority 100 would otherwise hold 80 GiB
against a job at 60 until its 30-minute idle timeout. A batch and a ``run`` job never
yield: they answer no requests, so they would look idle while they work.

Among the sets of victims that free enough on one GPU, the plan takes:

1. the fewest stops;
2. then the fewest victims that are not idle (``yields``): stopping an idle server
   cuts no work short, and its price (a cold start when next used) comes later;
3. then the cheapest to bring back: the recorded start durations (a victim never started
   successfully costs more than any measured one);
4. then the least recently used (the most recent use among the victims is the oldest);
5. then the lowest GPU index, then names in order (a stable answer).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import msgspec

from gpuctl.core.accounting import GpuRoom
from gpuctl.core.idle import short_duration
from gpuctl.core.units import format_mib

# Above this many subsets of the least size, the greedy choice (largest first) is taken:
# a host runs a handful of services, so this bounds the work, not the answers.
MAX_SUBSETS = 5000


class VictimFacts(msgspec.Struct, frozen=True):
    """What the planner knows of a running service (or ``gpuctl run`` job) beyond its share.

    ``managed``: gpuctl can stop it (a launcher, and a record naming its server).
    ``preemptible``: a job's ``--preemptible``; a managed service always is (by priority).
    ``in_flight``: requests in flight (server metric + store counts); None: unknown.
    ``leased``: a lease is held on it (a start, stop or wake under way).
    ``restart_s``: the median of its recorded start durations; None: never measured.
    ``unreachable``: why nobody who could act on it can stop it (a run job whose CMD runs
    on a machine neither the caller nor the host's agent can signal); None: it can be.
    ``in_config``: the caller's config names it; a service only another config names is
    counted at its record's promise but never stopped from here (nothing here says how).
    ``idle_s``: seconds since its last use (since it began running, if never used);
    None: unknown. ``yield_after_s``: its ``yield_after`` (None: never). ``kind``:
    "server" or "batch". The caller reads these from wherever it knows the service
    (its config, or the promise its record carries): the rule is keyed on them alone.
    """

    name: str
    priority: int
    managed: bool = True
    job: bool = False
    preemptible: bool = True
    in_flight: int | None = 0
    leased: bool = False
    restart_s: float | None = None
    last_used: float | None = None
    unreachable: str | None = None
    in_config: bool = True
    idle_s: float | None = None
    yield_after_s: float | None = None
    kind: str = "server"


class Victim(msgspec.Struct, frozen=True):
    """A planned stop. ``idle_s`` is set where it is idle (``yields``); ``yielded``: it
    is a victim only because it is idle (its priority is not below the asker's), so
    whoever stops it checks again under its lease that it is still unused."""

    name: str
    gpu: int
    frees_mib: int
    priority: int
    job: bool = False
    restart_s: float | None = None
    last_used: float | None = None
    idle_s: float | None = None
    yield_after_s: float | None = None
    yielded: bool = False

    def describe(self) -> str:
        what = "run job " if self.job else ""
        idle = f", idle for {short_duration(self.idle_s)}" if self.idle_s is not None else ""
        return f"{what}{self.name} (priority {self.priority}{idle}, {format_mib(self.frees_mib)})"


class Plan(msgspec.Struct, frozen=True):
    """Stop ``victims`` (all on ``gpu``); then ``need_mib`` fits there."""

    gpu: int
    victims: tuple[Victim, ...]
    need_mib: int
    free_mib: int  # free there now
    mig: int | None = None  # the MIG instance of ``gpu`` it is on (MIG on)

    @property
    def frees_mib(self) -> int:
        return sum(v.frees_mib for v in self.victims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.victims)

    def describe(self) -> str:
        return ", ".join(v.describe() for v in self.victims)


def yields(f: VictimFacts) -> bool:
    """Whether ``f`` is an idle server, a victim for any start that asks to preempt: a
    managed server (never a batch or a run job), unused for at least its
    ``yield_after``, with no lease and nothing in flight (known to be 0)."""
    return (
        f.managed
        and not f.job
        and f.kind != "batch"
        and f.yield_after_s is not None
        and f.idle_s is not None
        and f.idle_s >= f.yield_after_s
        and not f.leased
        and f.in_flight == 0
        and f.unreachable is None
    )


def _not_idle(f: VictimFacts) -> str:
    """Why a server of equal or higher priority has not yielded, for BUSY's reason."""
    if f.job or f.kind == "batch" or not f.managed:
        return ""
    if f.yield_after_s is None:
        return ' (yield_after = "never")'
    if f.idle_s is None:
        return ""
    if f.idle_s < f.yield_after_s:
        used = short_duration(f.idle_s)
        return f" (used {used} ago; it yields once idle {short_duration(f.yield_after_s)})"
    if f.leased:
        return " (idle, but a start or stop of it is under way)"
    if f.in_flight is None:
        return " (idle, but its requests in flight cannot be read)"
    if f.in_flight > 0:
        return f" (idle, but {f.in_flight} in flight)"
    return ""


def why_not(f: VictimFacts | None, priority: int, force: bool = False) -> str | None:
    """None when ``f`` may be stopped for work of ``priority``; else why not, in words."""
    if f is not None and not f.in_config:
        return "not in this config (stop it from a config that names it)"
    if f is None or not f.managed:
        return "not started by gpuctl"
    if f.job and not f.preemptible:
        return "a run job, not --preemptible"
    if f.priority >= priority and not yields(f):
        return f"priority {f.priority} is not below {priority}{_not_idle(f)}"
    if f.unreachable:
        return f.unreachable
    if f.leased:
        return "a start or stop of it is under way"
    if not force:
        if f.in_flight is None:
            return "its requests in flight cannot be read"
        if f.in_flight > 0:
            n = f.in_flight
            return f"{n} request{'s' if n != 1 else ''} in flight (--force stops it anyway)"
    return None


def plan_victims(
    need_mib: int,
    rooms: Sequence[GpuRoom],
    facts: Mapping[str, VictimFacts],
    *,
    priority: int,
    force: bool = False,
) -> Plan | None:
    """The best plan over ``rooms`` (the GPUs the service may use), or None when no set of
    permitted victims frees enough on any one of them. A GPU that cannot be read, or
    whose total is unknown, offers no plan: nobody knows what stopping would give back."""
    best: tuple[tuple[object, ...], Plan] | None = None
    for room in rooms:
        free = room.free_mib
        if room.error is not None or free is None:
            continue
        short = need_mib - free
        if short <= 0:
            continue  # it fits there already: not the planner's question
        pool = [
            _victim(name, room.index, mib, f, priority)
            for name, mib in room.shares
            if mib > 0
            and (f := facts.get(name)) is not None
            and why_not(f, priority, force) is None
        ]
        chosen = _cheapest(pool, short)
        if chosen is None:
            continue
        key = (*_cost(chosen), room.index, room.mig or 0)
        plan = Plan(room.index, chosen, need_mib, free, room.mig)
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1] if best else None


def _victim(name: str, gpu: int, mib: int, f: VictimFacts, priority: int) -> Victim:
    idle = yields(f)
    return Victim(
        name,
        gpu,
        mib,
        f.priority,
        f.job,
        f.restart_s,
        f.last_used,
        idle_s=f.idle_s if idle else None,
        yield_after_s=f.yield_after_s if idle else None,
        yielded=f.priority >= priority,
    )


def held_back(
    rooms: Sequence[GpuRoom],
    facts: Mapping[str, VictimFacts],
    *,
    priority: int,
    force: bool = False,
) -> list[str]:
    """Each running service on ``rooms`` that may not be stopped, and why (for BUSY)."""
    out: dict[str, str] = {}
    for room in rooms:
        for name, _mib in room.shares:
            why = why_not(facts.get(name), priority, force)
            if why is not None:
                out.setdefault(name, f"{name}: {why}")
    return list(out.values())


def _cheapest(pool: list[Victim], short: int) -> tuple[Victim, ...] | None:
    if sum(v.frees_mib for v in pool) < short:
        return None
    greedy = sorted(pool, key=lambda v: (-v.frees_mib, v.name))
    k, acc = 0, 0
    while acc < short:
        acc += greedy[k].frees_mib
        k += 1
    # k is the least number of stops (the k largest shares are the most k stops can free).
    if _n_subsets(len(pool), k) > MAX_SUBSETS:
        return tuple(sorted(greedy[:k], key=lambda v: v.name))
    ordered = sorted(pool, key=lambda v: v.name)
    enough = (c for c in itertools.combinations(ordered, k) if sum(v.frees_mib for v in c) >= short)
    return min(enough, key=_cost)


def _cost(victims: Sequence[Victim]) -> tuple[object, ...]:
    busy = sum(1 for v in victims if v.idle_s is None)
    unmeasured = sum(1 for v in victims if v.restart_s is None)
    restart = sum(v.restart_s or 0.0 for v in victims)
    # Never used sorts as the oldest use.
    latest_use = max((v.last_used or 0.0) for v in victims)
    return (len(victims), busy, unmeasured, restart, latest_use, tuple(v.name for v in victims))


def _n_subsets(n: int, k: int) -> int:
    return math.comb(n, k)


def plan_cost(plan: Plan) -> tuple[float, ...]:
    """What a plan costs, as the plans of one host are compared (the fewest stops, then
    the fewest not idle, the unmeasured, the shortest restarts, the oldest use): a pool
    carries out the cheapest of its hosts' plans."""
    n, busy, unmeasured, restart, latest, _names = _cost(plan.victims)
    return (float(n), float(busy), float(unmeasured), float(restart), float(latest))  # type: ignore[arg-type]
