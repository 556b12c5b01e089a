"""schemathesis against the real agent on loopback, driven by the agent's own /openapi.json.

Every operation gets generated requests, ones that fit its schema and ones that do not,
with the token: the agent must never answer 5xx, and every answer must match what the
document declares (status code, content type, body, headers). A fixed seed and a
bounded number of examples keep the run repeatable and short (well under a minute on
two cores).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis.generation.modes import GenerationMode

from gpuctl.agent.app import AgentSettings, create_app
from gpuctl.agent.openapi import openapi_document
from gpuctl.core.snapshot import GpuProcess
from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Per operation and mode; raise it (and change the seed) for a deeper run by hand:
# GPUCTL_SCHEMATHESIS_EXAMPLES=200 GPUCTL_SCHEMATHESIS_SEED=7 pytest tests/test_agent_schemathesis.py
EXAMPLES = int(os.environ.get("GPUCTL_SCHEMATHESIS_EXAMPLES", "15"))
SEED = int(os.environ.get("GPUCTL_SCHEMATHESIS_SEED", "20261130"))
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
# The test ids only; each test reads the operation from the running agent's document.
# Invalid requests only where there is an input to make invalid (a parameter, a body).
CASES = [
    pytest.param(f"{method.upper()} {path}", mode, id=f"{method.upper()} {path} {mode.value}")
    for path, item in openapi_document()["paths"].items()
    # The document itself: schemathesis reads it to run at all.
    if path != "/openapi.json"
    for method, op in item.items()
    if method in HTTP_METHODS
    for mode in GenerationMode
    if mode is GenerationMode.POSITIVE
    or item.get("parameters")
    or op.get("parameters")
    or op.get("requestBody")
]


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state: Path = tmp_path_factory.mktemp("schemathesis") / "state"
    probe = FakeProbe(
        reading_of(GpuProcess(pid=4242, command="vllm serve x", memory_mib=8200), used=8200)
    )
    app = create_app(AgentSettings(token=TOKEN, cache_ttl_s=1.0, state_dir=str(state)), probe)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def agent_schema(agent_url: str) -> schemathesis.schemas.BaseSchema:
    return schemathesis.openapi.from_url(f"{agent_url}/openapi.json")


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_the_agent_keeps_its_own_contract(
    agent_url: str, agent_schema: schemathesis.schemas.BaseSchema, label: str, mode: GenerationMode
) -> None:
    [operation] = [r.ok() for r in agent_schema.get_all_operations() if r.ok().label == label]

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=agent_url, headers=AUTH)

    run()
