"""Table tests of the victim planner (gpuctl.core.plan) and PREEMPTABLE in classify."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuctl.core.accounting import GpuRoom
from gpuctl.core.decision import Decision, Health, classify
from gpuctl.core.idle import short_duration
from gpuctl.core.jobs import job_route, unreachable
from gpuctl.core.plan import VictimFacts, held_back, plan_victims, why_not
from gpuctl.core.snapshot import GpuProcess, HostIdentity, Snapshot

GiB = 1024


def room(index: int, total_gib: int | None, **shares_gib: int) -> GpuRoom:
    """A GPU where each named service holds its share, and ``_foreign`` a foreign process."""
    committed = sum(shares_gib.values()) * GiB
    shares = tuple((n, g * GiB) for n, g in shares_gib.items() if n != "_foreign")
    return GpuRoom(index, None if total_gib is None else total_gib * GiB, committed, shares=shares)


def f(name: str, priority: int = 50, **kw: object) -> VictimFacts:
    return VictimFacts(name, priority, **kw)  # type: ignore[arg-type]


FACTS = {
    "batch": f("batch", 50, restart_s=20.0, last_used=100.0),
    "small": f("small", 40, restart_s=5.0, last_used=300.0),
    "small2": f("small2", 40, restart_s=5.0, last_used=200.0),
    "slow": f("slow", 40, restart_s=300.0, last_used=50.0),
    "whisper": f("whisper", 60, job=True, preemptible=False),
    "pjob": f("pjob", 30, job=True, preemptible=True),
    "farjob": f("farjob", 30, job=True, unreachable="a run job on ws, which neither … can signal"),
    "chat": f("chat", 100),
    "peer": f("peer", 100),
    "busy": f("busy", 10, in_flight=2),
    "blind": f("blind", 10, in_flight=None),
    "leased": f("leased", 10, leased=True),
    "foreign": f("foreign", 0, managed=False),
}

PLAN_CASES = [
    # (id, need GiB, rooms, priority, force, expected victims or None, expected gpu)
    (
        "the batch makes room; whisper stays",
        80,
        [room(0, 120, batch=30, whisper=15)],
        100,
        False,
        ("batch",),
        0,
    ),
    (
        "nothing fits even with every victim",
        110,
        [room(0, 120, batch=30, whisper=15)],
        100,
        False,
        None,
        None,
    ),
    (
        "a non-preemptible run job is never a victim",
        110,
        [room(0, 120, whisper=15)],
        100,
        False,
        None,
        None,
    ),
    ("a preemptible run job is", 110, [room(0, 120, pjob=15)], 100, False, ("pjob",), 0),
    (
        "a preemptible run job nobody can signal is not, even with --force",
        110,
        [room(0, 120, farjob=15)],
        100,
        True,
        None,
        None,
    ),
    ("equal priority never", 80, [room(0, 120, peer=50)], 100, False, None, None),
    ("higher priority never", 80, [room(0, 120, chat=50)], 50, False, None, None),
    ("foreign never", 80, [room(0, 120, foreign=50)], 100, False, None, None),
    ("unregistered foreign memory never", 80, [room(0, 120, _foreign=50)], 100, False, None, None),
    ("in flight: not without --force", 80, [room(0, 120, busy=50)], 100, False, None, None),
    ("in flight: with --force", 80, [room(0, 120, busy=50)], 100, True, ("busy",), 0),
    (
        "in flight unknown: not without --force",
        80,
        [room(0, 120, blind=50)],
        100,
        False,
        None,
        None,
    ),
    (
        "a lease held: never, even with --force",
        80,
        [room(0, 120, leased=50)],
        100,
        True,
        None,
        None,
    ),
    (
        "fewest stops beats cheapest",
        80,
        [room(0, 120, slow=40, small=20, small2=20)],
        100,
        False,
        ("slow",),
        0,
    ),
    (
        "cheapest to bring back among equals",
        80,
        [room(0, 120, slow=40, batch=40)],
        100,
        False,
        ("batch",),
        0,
    ),
    (
        "least recently used among equal costs",
        40,
        [room(0, 120, small=30, small2=30, _foreign=50)],
        100,
        False,
        ("small2",),
        0,
    ),
    (
        "per GPU: the GPU where one stop suffices",
        60,
        [room(0, 80, small=20, small2=20, _foreign=30), room(1, 80, batch=40)],
        100,
        False,
        ("batch",),
        1,
    ),
    (
        "per GPU: never the sum over two GPUs",
        100,
        [room(0, 80, batch=40), room(1, 80, slow=40)],
        100,
        False,
        None,
        None,
    ),
    (
        "an unreadable GPU offers nothing",
        80,
        [GpuRoom(0, None, 0, error="lost")],
        100,
        False,
        None,
        None,
    ),
    ("total unknown offers nothing", 80, [room(0, None, batch=30)], 100, False, None, None),
]


@pytest.mark.parametrize(
    ("need", "rooms", "prio", "force", "want", "gpu"),
    [c[1:] for c in PLAN_CASES],
    ids=[c[0] for c in PLAN_CASES],
)
def test_plan(
    need: int,
    rooms: list[GpuRoom],
    prio: int,
    force: bool,
    want: tuple[str, ...] | None,
    gpu: int | None,
) -> None:
    plan = plan_victims(need * GiB, rooms, FACTS, priority=prio, force=force)
    if want is None:
        assert plan is None
        return
    assert plan is not None
    assert plan.names == want
    assert plan.gpu == gpu
    free = next(r for r in rooms if r.index == gpu).free_mib
    assert free is not None and free + plan.frees_mib >= need * GiB


@pytest.mark.parametrize(
    ("facts", "prio", "force", "words"),
    [
        (FACTS["whisper"], 100, False, "not --preemptible"),
        (FACTS["peer"], 100, False, "not below 100"),
        (FACTS["busy"], 100, False, "2 requests in flight"),
        (FACTS["blind"], 100, False, "cannot be read"),
        (FACTS["leased"], 100, True, "under way"),
        (FACTS["foreign"], 100, True, "not started by gpuctl"),
        (None, 100, True, "not started by gpuctl"),
        (FACTS["farjob"], 100, True, "a run job on ws"),
    ],
)
def test_why_not(facts: VictimFacts | None, prio: int, force: bool, words: str) -> None:
    why = why_not(facts, prio, force)
    assert why is not None and words in why


def test_why_not_permits() -> None:
    assert why_not(FACTS["batch"], 100) is None
    assert why_not(FACTS["pjob"], 100) is None
    assert why_not(FACTS["busy"], 100, force=True) is None


def test_held_back_names_each_once() -> None:
    rooms = [room(0, 120, whisper=15, batch=30), room(1, 120, whisper=15)]
    assert held_back(rooms, FACTS, priority=100) == ["whisper: a run job, not --preemptible"]


def test_many_victims_stays_bounded() -> None:
    # 40 equal victims: the least number of stops is found without trying every subset.
    shares = {f"v{i:02d}": 3 for i in range(40)}
    facts = {n: f(n, 10) for n in shares}
    plan = plan_victims(100 * GiB, [room(0, 120, **shares)], facts, priority=50)
    assert plan is not None and len(plan.victims) == 34


# ---- PREEMPTABLE in classify, from a snapshot


@dataclass(frozen=True)
class Spec:
    name: str
    memory_mib: int | None = None
    priority: int = 50
    match: tuple[str, ...] = ()
    health_timeout_s: float = 600.0
    devices: tuple[int, ...] | None = None

    @property
    def keywords(self) -> tuple[str, ...]:
        return self.match or (self.name,)

    @property
    def default_match(self) -> bool:
        return not self.match


CHAT = Spec("chat", 80 * GiB, 100, ("vllm",))
BATCH = Spec("batch", 30 * GiB, 50, ("photo-batch",))
WHISPER = Spec("whisper", 15 * GiB, 60, ("whisper",))
REFUSED = Health("refused", "connection refused")


def scene(*procs: GpuProcess, total_gib: int = 120) -> Snapshot:
    used = sum(p.memory_mib or 0 for p in procs)
    return Snapshot(used, total_gib * GiB, False, "sim", "t", tuple(procs), ())


BATCH_P = GpuProcess(30, "python photo-batch.py", 30 * GiB)
WHISPER_P = GpuProcess(40, "whisper-job --model large", 15 * GiB)
STRANGER = GpuProcess(50, "python train.py", 30 * GiB)


def decide(snapshot: Snapshot, victims: dict[str, VictimFacts] | None, force: bool = False):  # type: ignore[no-untyped-def]
    return classify(
        CHAT,
        REFUSED,
        snapshot,
        others=[BATCH, WHISPER],
        now=1000.0,
        servers={30: "batch", 40: "whisper"},
        victims=victims,
        force=force,
    )


VICTIMS = {
    "batch": VictimFacts("batch", 50, restart_s=20.0),
    "whisper": VictimFacts("whisper", 60, job=True, preemptible=False),
}


def test_classify_preemptable_names_the_plan() -> None:
    v = decide(scene(BATCH_P, WHISPER_P), VICTIMS)
    assert v.decision is Decision.PREEMPTABLE
    assert v.plan is not None and v.plan.names == ("batch",)
    assert v.gpu == 0
    assert "batch (priority 50, 30.0 GiB)" in v.reason
    assert "whisper" not in v.reason.split("fits once")[1]


def test_classify_without_victim_facts_stays_busy() -> None:
    v = decide(scene(BATCH_P, WHISPER_P), None)
    assert v.decision is Decision.BUSY
    # BUSY names who holds the GPU, and the service and priority when it is ours.
    assert "pid 30 (python photo-batch.py, 30.0 GiB) = batch, priority 50" in v.reason


def test_classify_busy_when_only_foreign_and_unstoppable() -> None:
    v = decide(scene(STRANGER, WHISPER_P), VICTIMS)
    assert v.decision is Decision.BUSY
    assert "pid 50 (python train.py" in v.reason
    assert "whisper: a run job, not --preemptible" in v.reason


def test_classify_in_flight_needs_force() -> None:
    busy = {**VICTIMS, "batch": VictimFacts("batch", 50, in_flight=3)}
    assert decide(scene(BATCH_P, WHISPER_P), busy).decision is Decision.BUSY
    assert decide(scene(BATCH_P, WHISPER_P), busy, force=True).decision is Decision.PREEMPTABLE


def test_classify_fits_is_never_preemptable() -> None:
    v = decide(scene(WHISPER_P), VICTIMS)
    assert v.decision is Decision.FITS


def test_classify_preemptable_hints_how_to_ask() -> None:
    v = decide(scene(BATCH_P, WHISPER_P), VICTIMS)
    assert v.hint == (
        "`gpuctl ensure chat --preempt` stops batch to make room (or set preempt = true "
        "in [services.chat]); or wait and try again"
    )


def test_classify_busy_tells_which_holders_are_ours() -> None:
    """By the record's pid (whatever the command line) and by keyword; a stranger is
    nobody's. Biggest first, for the hint's `gpuctl stop`."""
    v = decide(scene(STRANGER, WHISPER_P, BATCH_P), None)
    assert v.decision is Decision.BUSY
    assert v.ours == ((30, "batch"), (40, "whisper"))


def test_classify_busy_names_up_to_four_holders() -> None:
    many = [GpuProcess(100 + i, f"python job{i}.py", (10 + i) * GiB) for i in range(6)]
    v = decide(scene(*many), None)
    assert v.decision is Decision.BUSY
    named = [p.pid for p in many if f"pid {p.pid} (" in v.reason]
    assert named == [102, 103, 104, 105] and "; 2 more" in v.reason


HERE = HostIdentity("laptop", "b-laptop")
AGENT = HostIdentity("dgx", "b-dgx")


@pytest.mark.parametrize(
    ("where", "agent", "route", "words"),
    [
        (("laptop", "b-laptop"), AGENT, "here", None),
        (("laptop", "b-laptop"), None, "here", None),
        (("dgx", "b-dgx"), AGENT, "agent", None),
        # The agent's machine, but read without an agent: nobody here can signal it.
        (("dgx", "b-dgx"), None, None, "which this machine (laptop) cannot signal (no agent)"),
        # The agent's hostname in another boot: that pid is gone, or another process's.
        (("dgx", "b-old"), AGENT, None, "neither this machine (laptop) nor the agent (dgx)"),
        (("ws", "b-ws"), AGENT, None, "a run job on ws"),
        ((None, None), AGENT, None, "a run job on another machine"),
    ],
)
def test_job_route(
    where: tuple[str | None, str | None],
    agent: HostIdentity | None,
    route: str | None,
    words: str | None,
) -> None:
    handle = {"kind": "run", "pid": 42, "host": where[0], "boot_id": where[1]}
    assert job_route(handle, HERE, agent) == route
    why = unreachable(handle, HERE, agent)
    assert (why is None) == (words is None)
    assert why is None or (words is not None and words in why)


# --------------------------------------------------------------------------- an idle server yields

MIN = 60.0


def idle(
    name: str, priority: int, idle_m: float, after_m: float | None = 10, **kw: object
) -> VictimFacts:
    """A server unused for ``idle_m`` minutes whose ``yield_after`` is ``after_m``."""
    after = None if after_m is None else after_m * MIN
    return f(name, priority, idle_s=idle_m * MIN, yield_after_s=after, **kw)


YIELD_CASES = [
    # (id, facts of "chat" at priority 100, force, victim for a job at 60?, words when not)
    ("idle 12m of 10m: yields whatever the priorities", idle("chat", 100, 12), False, True, None),
    ("idle exactly its yield_after: yields", idle("chat", 100, 10), False, True, None),
    (
        "used 3m ago: not yet",
        idle("chat", 100, 3),
        False,
        False,
        "priority 100 is not below 60 (used 3m ago; it yields once idle 10m)",
    ),
    ("yield_after never", idle("chat", 100, 600, None), False, False, 'yield_after = "never"'),
    ("a batch never yields", idle("chat", 100, 600, kind="batch"), False, False, "not below 60"),
    (
        "a run job never yields",
        idle("chat", 100, 600, job=True, preemptible=True),
        False,
        False,
        "not below 60",
    ),
    (
        "a request in flight is a use, even with --force",
        idle("chat", 100, 12, in_flight=1),
        True,
        False,
        "idle, but 1 in flight",
    ),
    (
        "in-flight unknown: not idle",
        idle("chat", 100, 12, in_flight=None),
        True,
        False,
        "cannot be read",
    ),
    ("a lease held: not idle", idle("chat", 100, 12, leased=True), True, False, "under way"),
    ("idle unknown: not idle", f("chat", 100, yield_after_s=600.0), False, False, "not below"),
    ("not gpuctl's: never", idle("chat", 100, 12, managed=False), False, False, "not started"),
]


@pytest.mark.parametrize(
    ("facts", "force", "victim", "words"),
    [c[1:] for c in YIELD_CASES],
    ids=[c[0] for c in YIELD_CASES],
)
def test_an_idle_server_yields(
    facts: VictimFacts, force: bool, victim: bool, words: str | None
) -> None:
    """Issue 16: an idle chat at 100 no longer refuses an 80 GiB job at 60 for 30 minutes."""
    plan = plan_victims(
        80 * GiB, [room(0, 120, chat=80)], {"chat": facts}, priority=60, force=force
    )
    assert (plan is not None) == victim
    why = why_not(facts, 60, force)
    assert (why is None) == victim
    if words is not None:
        assert why is not None and words in why, why
    if plan is not None:
        (v,) = plan.victims
        assert (
            v.yielded
            and v.describe()
            == f"chat (priority 100, idle for {short_duration(facts.idle_s or 0)}, 80.0 GiB)"
        )


def test_a_lower_priority_victim_is_not_marked_as_yielded() -> None:
    """Below the asker's priority it is a victim anyway: stopping it needs no idle re-check."""
    plan = plan_victims(
        80 * GiB, [room(0, 120, chat=80)], {"chat": idle("chat", 50, 12)}, priority=60
    )
    assert plan is not None
    (v,) = plan.victims
    assert (v.yielded, v.idle_s) == (False, 12 * MIN)
    assert "idle for 12m" in v.describe()


def test_the_planner_prefers_idle_victims() -> None:
    """Of two single stops that free enough, the idle one, though it is dearer to bring
    back, of higher priority, and used more recently: it cuts no work short."""
    facts = {
        "chat": idle("chat", 100, 12, restart_s=330.0, last_used=900.0),
        "batch": f("batch", 50, restart_s=20.0, last_used=100.0, idle_s=60.0, yield_after_s=600.0),
    }
    plan = plan_victims(80 * GiB, [room(0, 200, chat=80, batch=80)], facts, priority=60)
    assert plan is not None and plan.names == ("chat",)
    # Both lower than the asker, one idle: the idle one again.
    facts["chat"] = idle("chat", 40, 12, restart_s=330.0, last_used=900.0)
    plan = plan_victims(80 * GiB, [room(0, 200, chat=80, batch=80)], facts, priority=60)
    assert plan is not None and plan.names == ("chat",)


def test_fewest_stops_still_comes_before_idle() -> None:
    """One busy lower-priority stop beats two idle ones: each stop is a cold start later."""
    facts = {
        "a": idle("a", 100, 20),
        "b": idle("b", 100, 20),
        "batch": f("batch", 50),
    }
    plan = plan_victims(80 * GiB, [room(0, 160, a=40, b=40, batch=80)], facts, priority=60)
    assert plan is not None and plan.names == ("batch",)


def test_classify_reason_says_how_long_the_yielding_server_was_idle() -> None:
    chat_p = GpuProcess(60, "vllm serve chat", 80 * GiB)
    v = classify(
        Spec("job", 80 * GiB, 60, ("job",)),
        REFUSED,
        scene(chat_p),
        others=[CHAT],
        now=1000.0,
        servers={60: "chat"},
        victims={"chat": idle("chat", 100, 12)},
    )
    assert v.decision is Decision.PREEMPTABLE
    assert "fits once chat (priority 100, idle for 12m, 80.0 GiB) stops" in v.reason
    busy = classify(
        Spec("job", 80 * GiB, 60, ("job",)),
        REFUSED,
        scene(chat_p),
        others=[CHAT],
        now=1000.0,
        servers={60: "chat"},
        victims={"chat": idle("chat", 100, 3)},
    )
    assert busy.decision is Decision.BUSY
    assert (
        "chat: priority 100 is not below 60 (used 3m ago; it yields once idle 10m)" in busy.reason
    )
