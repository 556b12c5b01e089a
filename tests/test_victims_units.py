"""Victim facts of the flows (pure over an observation): what the planner is told of
the other services' records."""

from __future__ import annotations

from pathlib import Path

from gpuctl.core.plan import why_not
from gpuctl.core.record import Phase, Record
from gpuctl.flows.observe import Observation
from gpuctl.flows.victims import victim_facts
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
        facts = victim_facts(obs, [chat, low], chat, counts=dict)
        assert why_not(facts.get("low"), 100) == "a start or stop of it is under way"
    # A running one is still a victim; a stopped one is no candidate at all.
    run = Observation(records={"low": Record("low", Phase.RUNNING, handle={"pid": 4242})})
    assert why_not(victim_facts(run, [chat, low], chat, counts=dict)["low"], 100) is None
    gone = Observation(records={"low": Record("low", Phase.STOPPED)})
    assert "low" not in victim_facts(gone, [chat, low], chat, counts=dict)
