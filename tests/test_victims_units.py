"""Victim facts of the flows (pure over an observation): what the planner is told of
the other services' records."""

from __future__ import annotations

from pathlib import Path

from gpuctl.adapters.machine import ThisMachine
from gpuctl.core.plan import VictimFacts, why_not
from gpuctl.core.record import Phase, Record
from gpuctl.flows.look import Observation, victim_facts
from tests.flow_fakes import config

TWO = """
[hosts.dgx]
agent = "http://127.0.0.1:9"

[services.chat]
host = "dgx"
launcher = "process"
command = "vllm serve m"
health = "http://127.0.0.1:8000/health"
memory = "80GiB"
priority = 100

[services.low]
host = "dgx"
launcher = "process"
command = "batch"
health = "http://127.0.0.1:8001/health"
memory = "30GiB"
priority = 10
"""


def test_a_service_another_caller_is_preempting_is_named_as_under_way(tmp_path: Path) -> None:
    """The loser of two concurrent `ensure --preempt` saw the winner's victim (just
    marked `preempted`, its stop under way) as 'not started by gpuctl'."""
    conf = config(tmp_path, TWO)
    chat, low = conf.services["chat"], conf.services["low"]
    for handle in ({"kind": "process", "pid": 4242}, None):
        obs = Observation(records={"low": Record("low", Phase.PREEMPTED, handle=handle)})
        facts = victim_facts(obs, [chat, low], chat, counts=dict, machine=ThisMachine())
        assert why_not(facts.get("low"), 100) == "a start or stop of it is under way"
    # A running one is still a victim; a stopped one is no candidate at all.
    run = Observation(records={"low": Record("low", Phase.RUNNING, handle={"pid": 4242})})
    assert (
        why_not(
            victim_facts(run, [chat, low], chat, counts=dict, machine=ThisMachine())["low"], 100
        )
        is None
    )
    gone = Observation(records={"low": Record("low", Phase.STOPPED)})
    assert "low" not in victim_facts(gone, [chat, low], chat, counts=dict, machine=ThisMachine())


def test_a_server_whose_requests_cannot_be_read_never_yields(tmp_path: Path) -> None:
    """Idle is known only where the server says nothing is in flight: a server with no
    metrics to read (not vLLM) would have a request sent straight to it cut by a yield.
    A strictly lower priority is still a victim, as before."""
    from gpuctl.core.plan import yields

    conf = config(tmp_path, TWO.replace("priority = 100", 'priority = 100\nyield_after = "1s"'))
    chat, low = conf.services["chat"], conf.services["low"]
    idle = Record("chat", Phase.RUNNING, since=1.0, last_used=1.0, handle={"pid": 4242})
    obs = Observation(records={"chat": idle})
    for metric, yielded in ((0, True), (None, False)):
        facts = victim_facts(
            obs,
            [chat, low],
            low,
            counts=dict,
            server_in_flight=lambda s, m=metric: m,
            machine=ThisMachine(),
            now=1000.0,
        )
        assert yields(facts["chat"]) is yielded, (metric, facts["chat"])


def test_whether_a_server_yields_is_its_records_word(tmp_path: Path) -> None:
    """`yield_after` rides in the promise: another config's shorter one never makes a
    server its starter said never yields a victim."""
    from gpuctl.core.plan import yields
    from gpuctl.core.promise import Promise

    conf = config(tmp_path, TWO.replace("priority = 100", 'priority = 100\nyield_after = "1s"'))
    chat, low = conf.services["chat"], conf.services["low"]
    said = Promise(81920, 100, yield_after_s=None)
    idle = Record("chat", Phase.RUNNING, 1.0, 1.0, handle={"pid": 4242}, promise=said)
    facts = victim_facts(
        Observation(records={"chat": idle}), [chat, low], low, counts=dict,
        server_in_flight=lambda s: 0, machine=ThisMachine(), now=1000.0,
    )  # fmt: skip
    assert not yields(facts["chat"]) and facts["chat"].yield_after_s is None


def test_a_server_is_idle_from_its_last_use_or_from_when_it_began_running() -> None:
    """A start marks a use when it begins: a load longer than ``yield_after`` must not
    leave the server idle the moment it answers (found by the trials: a server healed
    from starting to running was preempted as idle within the same sample)."""
    from gpuctl.flows.look import idle_seconds

    loaded = Record("chat", Phase.RUNNING, since=700.0, last_used=100.0)
    assert idle_seconds(loaded, 701.0) == 1.0
    used = Record("chat", Phase.RUNNING, since=700.0, last_used=900.0)
    assert idle_seconds(used, 960.0) == 60.0
    never = Record("chat", Phase.RUNNING, since=700.0)
    assert idle_seconds(never, 760.0) == 60.0


SLURM_BESIDE = """
[hosts.dgx]
agent = "http://127.0.0.1:9"

[hosts.dgx.slurm]

[services.chat]
host = "dgx"
launcher = "process"
command = "vllm serve m"
health = "http://127.0.0.1:8000/health"
memory = "80GiB"
priority = 100
preempt = true

[services.low]
host = "dgx"
launcher = "slurm"
command = "batch-server"
health = "http://{node}:8001/health"
memory = "30GiB"
priority = 10
yield_after = "1s"
"""


def test_a_slurm_service_is_never_a_victim(tmp_path: Path) -> None:
    """Preemption of a server Slurm placed is Slurm's (its priority, its QoS): a lower
    priority and ``preempt = true`` on the other side still name no Slurm job to stop,
    and it never yields either, however long it sat idle."""
    from gpuctl.core.decision import Decision, Health
    from gpuctl.core.snapshot import GpuProcess, Snapshot
    from gpuctl.flows.look import decide, yielding

    conf = config(tmp_path, SLURM_BESIDE)
    chat, low = conf.services["chat"], conf.services["low"]
    job = {"kind": "slurm", "job_id": "7", "proof": "n1"}
    rec = Record("low", Phase.RUNNING, handle=job, since=0.0, last_used=0.0)
    gib = 1024
    # The job runs on this very GPU (a node that is a gpuctl host too), found by the
    # agent by its start nonce: 30 GiB of 100 held, so chat's 80 GiB does not fit.
    snap = Snapshot(
        30 * gib,
        100 * gib,
        False,
        "sim",
        "t",
        (GpuProcess(4242, "batch-server --port 8001", 30 * gib),),
        (),
        servers=((4242, "low"),),
    )
    seen = Observation(records={"low": rec}, snapshot=snap)
    facts = victim_facts(seen, [chat, low], chat, counts=dict, machine=ThisMachine(), now=1e6)
    assert "low" not in facts
    verdict = decide(
        chat,
        Health("refused", "connection refused"),
        seen,
        others=[chat, low],
        now=1e6,
        victims=facts,
    )
    assert verdict.decision is not Decision.PREEMPTABLE, verdict.reason
    assert verdict.plan is None
    # Nor with the facts a planner unaware of Slurm would have handed it.
    forged = {"low": stoppable_facts("low")}
    verdict = decide(
        chat, Health("refused", "refused"), seen, others=[chat, low], now=1e6, victims=forged
    )
    assert verdict.decision is not Decision.PREEMPTABLE, verdict.reason
    # A record the config does not name, with a Slurm job's handle, is none either.
    stray = Observation(records={"gone": Record("gone", Phase.RUNNING, handle=job)}, snapshot=snap)
    assert "gone" not in victim_facts(
        stray, [chat, low], chat, counts=dict, machine=ThisMachine(), now=1e6
    )
    assert yielding(seen, [chat, low], counts=dict, server_in_flight=None, now=1e6) == {}


def stoppable_facts(name: str) -> VictimFacts:
    """The facts of a stoppable, idle, low-priority server (what a process would get)."""
    return VictimFacts(name, 10, managed=True, in_flight=0, idle_s=1e6, yield_after_s=1.0)
