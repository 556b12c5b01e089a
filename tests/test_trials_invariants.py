"""The trial runner's invariants can fail: broken outcomes fed to the pure checker
(tests/trials_invariants.py) are each caught, and a clean one passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.trials_invariants import (
    CallerFacts,
    Job,
    Observation,
    Outcome,
    Service,
    Verdict,
    check_outcome,
)

GIB = 1024
CHAT = Service("chat", 80 * GIB, 100)
BATCH = Service("batch", 30 * GIB, 50)
PEER = Service("peer", 20 * GIB, 100)
WHISPER = Job("whisper", 60, False, 15 * GIB, 30.0, spawned=0.0)
SCRAPS = Job("scraps", 40, True, 15 * GIB, 30.0, spawned=0.0)
PIDS = {"chat": 100, "batch": 200, "peer": 300, "whisper": 400, "scraps": 500}


def rec(phase: str, pid: int | None = None, memory_mib: int | None = None) -> dict[str, Any]:
    handle = None if pid is None else {"pid": pid, "memory_mib": memory_mib}
    return {"phase": phase, "handle": handle}


def obs(at: float, running: dict[str, str], **extra: Any) -> Observation:
    """A sample: ``running`` maps each name to its record's phase; services and jobs in a
    live phase (or ``stopping``) have their process alive."""
    servers: dict[str, tuple[int, ...]] = {s.name: () for s in (CHAT, BATCH, PEER)}
    jobs: dict[str, tuple[int, ...]] = {}
    records: dict[str, dict[str, Any]] = {}
    for name, phase in running.items():
        alive = phase in ("starting", "running", "stopping")
        if name in PIDS and name in ("whisper", "scraps"):
            records[f"run.{name}"] = rec(phase, PIDS[name], 15 * GIB)
            if alive:
                jobs[name] = (PIDS[name],)
        else:
            records[name] = rec(phase, PIDS[name] if alive else None)
            if alive:
                servers[name] = (PIDS[name],)
    servers.update(extra.pop("servers", {}))
    return Observation(at, servers, jobs, records, **extra)


def ensure_output(service: str, notes: list[str]) -> str:
    return "starting…\n" + json.dumps({"service": service, "notes": notes}, indent=2) + "\n"


def clean() -> Outcome:
    """Chat preempts the batch (permitted); the peer and whisper stay."""
    return Outcome(
        services=[CHAT, BATCH, PEER],
        total_mib=120 * GIB,
        observations=[
            obs(1.0, {"batch": "running", "peer": "running", "whisper": "running"}),
            obs(2.0, {"batch": "preempted", "peer": "running", "whisper": "running"}),
            obs(3.0, {"chat": "starting", "batch": "preempted", "peer": "running"} | {"whisper": "running"}),
        ],
        callers=[
            CallerFacts(
                "ensure", "chat", 0.5, 3.5, preempts=100,
                output=ensure_output("chat", ["preempted batch to make room (their stops took 0.1s)"]),
            ),
        ],
        jobs={"whisper": WHISPER, "scraps": SCRAPS},
        logs={"log chat.log": "INFO loading\nINFO ready\n"},
    )  # fmt: skip


def judged(o: Outcome) -> Verdict:
    return check_outcome(o)


def test_a_clean_outcome_passes_and_counts_its_preemption() -> None:
    v = judged(clean())
    assert v.violations == []
    assert v.counts["preemptions"] == 1
    assert v.counts["victims named by their preemptor"] == 1
    assert v.checked["only permitted victims preempted"] == 1
    assert v.checked["every stop explained"] == 1  # the batch's server ended


def test_two_servers_of_one_service_are_caught() -> None:
    o = clean()
    o.observations = [
        *o.observations,
        obs(4.0, {"chat": "running", "peer": "running"}, servers={"chat": (100, 101)}),
    ]
    assert any("2 servers of chat" in x for x in judged(o).violations)


def test_admitted_memory_over_the_total_is_caught() -> None:
    o = clean()
    # chat 80 + batch 30 + peer 20 + whisper 15 = 145 GiB admitted on a 120 GiB GPU.
    everything = {"chat": "running", "batch": "running", "peer": "running", "whisper": "running"}
    o.observations = [*o.observations, obs(4.0, everything)]
    (hit,) = [x for x in judged(o).violations if x.startswith("admitted")]
    assert f"admitted {145 * GIB} MiB of {120 * GIB}" in hit
    # Not judged where the records moved while the processes were read.
    o.observations = [*o.observations[:-1], obs(4.0, everything, consistent=False)]
    assert not any(x.startswith("admitted") for x in judged(o).violations)


def test_claims_over_the_total_are_caught() -> None:
    o = clean()
    o.observations = [*o.observations, obs(4.0, {"chat": "running"}, claimed_mib=121 * GIB)]
    assert any(x.startswith("overcommit") for x in judged(o).violations)


def test_an_out_of_memory_line_is_caught_in_a_log_and_in_a_callers_output() -> None:
    o = clean()
    o.logs = {"log chat.log": "INFO loading\nERROR CUDA out of memory. Tried to allocate\n"}
    assert any("CUDA out of memory" in x for x in judged(o).violations)
    o = clean()
    o.callers = [
        *o.callers,
        CallerFacts("run", "chat", 1.0, 2.0, output="torch.OutOfMemoryError: x"),
    ]
    assert any("OutOfMemoryError" in x for x in judged(o).violations)


def test_an_equal_priority_service_preempted_is_caught() -> None:
    o = clean()
    # The peer (priority 100) turns preempted while only chat (100) was under way.
    o.observations = [
        obs(1.0, {"peer": "running"}),
        obs(2.0, {"peer": "preempted"}),
    ]
    v = judged(o)
    assert any("peer (priority 100) was preempted with no preemptor" in x for x in v.violations)


def test_a_preemption_with_no_preemptor_under_way_is_caught() -> None:
    o = clean()
    o.callers = [CallerFacts("ensure", "chat", 0.1, 0.5, preempts=100)]  # gone before
    assert any("batch (priority 50) was preempted" in x for x in judged(o).violations)


def test_a_non_preemptible_job_preempted_is_caught() -> None:
    o = clean()
    o.observations = [obs(1.0, {"whisper": "running"}), obs(2.0, {"whisper": "preempted"})]
    v = judged(o)
    assert any("job whisper was preempted, but it is not --preemptible" in x for x in v.violations)
    assert any("whisper's CMD 400 ended before its 30s" in x for x in v.violations)


def test_a_preemptor_naming_a_non_victim_is_caught() -> None:
    o = clean()
    o.callers = [
        CallerFacts(
            "ensure --preempt", "chat", 0.5, 3.5, preempts=100,
            output=ensure_output("chat", ["preempted peer, run.whisper to make room (…)"]),
        )
    ]  # fmt: skip
    v = judged(o)
    assert any("preempted peer (priority 100)" in x for x in v.violations)
    assert any("preempted job whisper, not --preemptible" in x for x in v.violations)


@pytest.mark.parametrize(
    ("caller", "explained"),
    [
        (None, False),
        (CallerFacts("stop", "peer", 1.5, 2.5), True),
        (CallerFacts("stop", "batch", 1.5, 2.5), False),  # a stop of another service
        (CallerFacts("reclaim", "chat", 1.5, 2.5), True),
        (CallerFacts("ensure", "chat", 1.5, 2.5, preempts=100), False),  # not above 100
        (CallerFacts("touch", "peer", 1.5, 2.5), False),
    ],
)
def test_a_server_that_ends_unexplained_is_caught(
    caller: CallerFacts | None, explained: bool
) -> None:
    o = clean()
    o.observations = [obs(1.0, {"peer": "running"}), obs(2.0, {"peer": "stopped"})]
    o.callers = [caller] if caller else []
    v = judged(o)
    hit = [x for x in v.violations if "peer's server 300 ended" in x]
    assert (hit == []) is explained, v.violations


def test_a_preemptible_job_ended_early_needs_a_preemptor_above_it() -> None:
    o = clean()
    o.observations = [obs(1.0, {"scraps": "running"}), obs(2.0, {"scraps": "preempted"})]
    o.callers = [CallerFacts("ensure", "peer", 0.5, 2.5, preempts=None)]
    v = judged(o)
    assert any("run.scraps's CMD 500 ended" in x for x in v.violations)
    o.callers = [CallerFacts("ensure", "chat", 0.5, 2.5, preempts=100)]
    assert judged(o).violations == []
    # A CMD that ran its course ended on its own.
    o.callers = []
    o.jobs = {"scraps": Job("scraps", 40, True, 15 * GIB, 1.0, spawned=0.0)}
    o.observations = [obs(1.0, {"scraps": "running"}), obs(2.0, {"scraps": "stopped"})]
    assert judged(o).violations == []


def run_preempt_output(victims: str) -> str:
    """What ``gpuctl run --preempt`` prints (no JSON), around its CMD's own output."""
    return (
        f"gpuctl run: preempting {victims} (priority 50, 30.0 GiB) to make room\n"
        f"gpuctl run: preempted {victims} to make room (their stops took 0.10s)\n"
        "holding 15GiB\n"
    )


def test_a_run_preempt_job_is_a_preemptor_of_its_priority() -> None:
    o = clean()
    # A `gpuctl run --preempt` job at 60, not chat, stops the batch (50): permitted.
    o.callers = [
        CallerFacts("run --preempt", "batch", 0.5, 3.5, preempts=60,
                    output=run_preempt_output("batch")),
    ]  # fmt: skip
    v = judged(o)
    assert v.violations == []
    assert v.counts["preemptions"] == 1 and v.counts["victims named by their preemptor"] == 1
    assert v.counts["victims named by a run --preempt"] == 1
    assert judged(clean()).counts["victims named by a run --preempt"] == 0  # an ensure's
    # Without --preempt the same job explains nothing.
    o.callers = [CallerFacts("run", "batch", 0.5, 3.5, preempts=None)]
    v = judged(o)
    assert any("batch (priority 50) was preempted with no preemptor" in x for x in v.violations)
    assert any("batch's server 200 ended" in x for x in v.violations)


def test_a_run_preempt_job_stopping_the_peer_or_a_non_preemptible_job_is_caught() -> None:
    o = clean()
    o.observations = [
        obs(1.0, {"peer": "running", "whisper": "running"}),
        obs(2.0, {"peer": "preempted", "whisper": "preempted"}),
    ]
    o.callers = [
        CallerFacts("run --preempt", "peer", 0.5, 3.5, preempts=100,
                    output=run_preempt_output("peer, run.whisper")),
    ]  # fmt: skip
    v = judged(o)
    assert any("peer (priority 100) was preempted with no preemptor" in x for x in v.violations)
    assert any("run --preempt peer (priority 100) preempted peer" in x for x in v.violations)
    assert any("job whisper was preempted, but it is not --preemptible" in x for x in v.violations)
    assert any("preempted job whisper, not --preemptible" in x for x in v.violations)


# --------------------------------------------------------------------------- an idle server yields


def yielding_outcome(
    last_used: float | None, peer: Service | None = None, *, since: float = 0.0
) -> Outcome:
    """The peer (priority 100, ``yield_after`` 10 s) turns preempted in (21, 22] while
    chat (100) preempts; its record at 21 says it was last used at ``last_used``."""
    peer = peer or Service("peer", 20 * GIB, 100, yield_after_s=10.0)
    first = obs(21.0, {"peer": "running"})
    first.records["peer"].update({"last_used": last_used, "since": since})
    return Outcome(
        services=[CHAT, BATCH, peer],
        total_mib=120 * GIB,
        observations=[first, obs(22.0, {"peer": "preempted"})],
        callers=[
            CallerFacts(
                "ensure --preempt", "chat", 20.5, 23.0, preempts=100,
                output=ensure_output("chat", ["preempted peer to make room (their stops took 0.1s)"]),
            ),
        ],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("last_used", "since", "peer", "permitted"),
    [
        (11.0, 0.0, None, True),  # unused 11 s of 10 by 22
        (12.0, 0.0, None, True),  # exactly its yield_after
        (12.5, 0.0, None, False),  # used 9.5 s before: not yet
        (None, 11.0, None, True),  # never used: idle since it began running
        (None, 15.0, None, False),
        (1.0, 0.0, Service("peer", 20 * GIB, 100), False),  # yield_after = "never"
        (1.0, 0.0, Service("peer", 20 * GIB, 100, 10.0, kind="batch"), False),
    ],
)
def test_an_equal_priority_server_preempted_is_permitted_only_where_it_yielded(
    last_used: float | None, since: float, peer: Service | None, permitted: bool
) -> None:
    """docs/explanation/priorities.md, "An idle server yields": the one exception to "never
    equal or higher priority", judged from the victim's own record, for the preemption, the name its
    preemptor gives, and the stop of its server."""
    v = judged(yielding_outcome(last_used, peer, since=since))
    if permitted:
        assert v.violations == [] and v.counts["idle servers yielded"] == 1
        return
    assert v.counts["idle servers yielded"] == 0
    assert any("peer (priority 100) was preempted with no preemptor" in x for x in v.violations)
    assert any("preempted peer (priority 100)" in x for x in v.violations)
    assert any("peer's server 300 ended" in x for x in v.violations)


def lying(at: float, phase: str = "preempted", **rec_extra: Any) -> Observation:
    """The batch's server alive (pid 200) under a record that says ``phase``."""
    o = obs(at, {"peer": "running"}, servers={"batch": (PIDS["batch"],)})
    records = {**o.records, "batch": {**rec(phase, PIDS["batch"]), **rec_extra}}
    return Observation(o.at, o.servers, o.jobs, records)


def test_a_live_server_under_a_not_running_record_is_caught_after_a_look() -> None:
    looked = CallerFacts("reclaim", "", 2.0, 2.5)
    o = Outcome(
        services=[CHAT, BATCH, PEER],
        total_mib=120 * GIB,
        observations=[lying(1.0), lying(4.0), lying(8.0)],
        callers=[looked],
    )
    v = judged(o)
    assert v.checked["no live server under a not-running record"] == 3
    (msg,) = [m for m in v.violations if "not-running" in m or "live server" in m]
    assert msg.startswith("batch: a live server under a preempted record since 1.00")
    assert "6.0s after a caller looked" in msg


def test_a_lie_nobody_looked_at_or_healed_in_time_passes() -> None:
    base = {"services": [CHAT, BATCH, PEER], "total_mib": 120 * GIB}
    # Nobody looked: no verdict yet.
    o = Outcome(**base, observations=[lying(1.0), lying(20.0)], callers=[])  # type: ignore[arg-type]
    assert not [m for m in judged(o).violations if "live server" in m]
    # Looked at 2.0, healed (running) by 5.0.
    healed = obs(5.0, {"batch": "running", "peer": "running"})
    o = Outcome(
        **base,  # type: ignore[arg-type]
        observations=[lying(1.0), lying(3.0), healed, lying(30.0)],
        callers=[CallerFacts("ensure", "chat", 2.0, 3.0)],
    )
    assert not [m for m in judged(o).violations if "live server" in m]
    # A lease on the record whose holder lives: it is mid-way (a preemptor between
    # marking and signalling its victim).
    lease = {"holder": "x", "pid": 77, "expires": 100.0}
    preemptor = CallerFacts("ensure", "chat", 0.5, None, preempts=100, pid=77)
    o = Outcome(
        **base,  # type: ignore[arg-type]
        observations=[lying(1.0, lease=lease), lying(9.0, lease=lease)],
        callers=[preemptor, CallerFacts("status", "", 1.5, 2.0)],
    )
    assert not [m for m in judged(o).violations if "live server" in m]


def test_a_dead_preemptors_lease_excuses_nothing() -> None:
    """The file keeps the lease of a preemptor killed mid-way: it is no excuse."""
    lease = {"holder": "x", "pid": 77, "expires": 100.0}
    killed = CallerFacts("ensure", "chat", 0.5, 1.5, preempts=100, pid=77)
    o = Outcome(
        services=[CHAT, BATCH, PEER],
        total_mib=120 * GIB,
        observations=[lying(2.0, lease=lease), lying(9.0, lease=lease)],
        callers=[killed, CallerFacts("reclaim", "", 2.5, 3.0)],
    )
    (msg,) = [m for m in judged(o).violations if "live server" in m]
    assert "since 2.00" in msg


def test_with_an_agent_the_clock_runs_from_the_lie() -> None:
    o = Outcome(
        services=[CHAT, BATCH, PEER],
        total_mib=120 * GIB,
        observations=[lying(1.0, "stopped"), lying(7.0, "stopped")],
        callers=[],
        agent=True,
    )
    (msg,) = [m for m in judged(o).violations if "live server" in m]
    assert "under a stopped record" in msg and "after the agent looked" in msg
