"""schemathesis against the real proxy on loopback, driven by the proxy's own /openapi.json.

The proxy (with a client key) fronts a witness upstream (tests/test_proxy_wire.py) that
answers every forwarded request with 200, and a service whose server refuses
connections (502), so every status that comes back is the proxy's own or the witness's.
Every operation gets generated requests, ones that fit the document and ones that do
not: no answer may be a 500, and each must match what the document declares (status,
content type, body, the Retry-After header). A fixed seed and a bounded number of
examples keep the run repeatable and short.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from gpuctl.proxy.openapi import openapi_document
from gpuctl.sim.host import SimHost, free_port
from tests.proxy_helpers import Proxy
from tests.test_proxy_wire import KEY, WITNESS_MODEL, Witness

AUTH = {"Authorization": f"Bearer {KEY}"}
# GPUCTL_SCHEMATHESIS_EXAMPLES=200 GPUCTL_SCHEMATHESIS_SEED=7 for a deeper run by hand.
EXAMPLES = int(os.environ.get("GPUCTL_SCHEMATHESIS_EXAMPLES", "15"))
SEED = int(os.environ.get("GPUCTL_SCHEMATHESIS_SEED", "20261130"))
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
_DOC = openapi_document(sorted([WITNESS_MODEL, "refused-model"]), ["refused", "witness"])
CASES = [
    pytest.param(f"{method.upper()} {path}", mode, id=f"{method.upper()} {path} {mode.value}")
    for path, item in _DOC["paths"].items()
    if path != "/openapi.json"  # schemathesis reads it to run at all
    for method, op in item.items()
    if method in HTTP_METHODS
    for mode in GenerationMode
    if mode is GenerationMode.POSITIVE or op.get("parameters") or op.get("requestBody")
]


def no_500(ctx: object, response: object, case: schemathesis.Case) -> bool:
    """502/503/504 are the proxy's documented refusals; a 500 is a bug."""
    status = response.status_code  # type: ignore[attr-defined]
    assert status != 500, f"500 for {case.method} {case.formatted_path}: {response.text[:300]}"  # type: ignore[attr-defined]
    return True


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base: Path = tmp_path_factory.mktemp("proxy-schemathesis")
    witness = Witness()
    server = witness.serve()
    with SimHost(gpu_memory="100GiB", root=base / "simhost") as host:
        host.start_agent()
        keys = base / "keys"
        keys.write_text(f"{KEY}\n")
        health = f"http://127.0.0.1:{witness.port}/health"
        conf = host.write_config(
            f'[services.witness]\nhealth = "{health}"\nmodels = ["{WITNESS_MODEL}"]\n\n'
            f'[services.refused]\nurl = "http://127.0.0.1:{free_port()}"\nhealth = "{health}"\n'
            'models = ["refused-model"]\n\n'
            f'[proxy]\nmax_body = "1MiB"\napi_keys_file = "{keys}"\n'
        )
        proxy = Proxy(host, conf)
        try:
            yield proxy.url
            log = proxy.log()
            assert "Traceback" not in log, log[-3000:]
        finally:
            proxy.stop()
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def proxy_schema(proxy_url: str) -> schemathesis.schemas.BaseSchema:
    return schemathesis.openapi.from_url(f"{proxy_url}/openapi.json", headers=AUTH)


def test_the_served_document_is_the_one_the_cases_come_from(proxy_url: str) -> None:
    import httpx

    served = httpx.get(f"{proxy_url}/openapi.json", headers=AUTH, timeout=10).json()
    assert served == _DOC
    assert httpx.get(f"{proxy_url}/openapi.json", timeout=10).status_code == 401


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_the_proxy_keeps_its_own_contract(
    proxy_url: str, proxy_schema: schemathesis.schemas.BaseSchema, label: str, mode: GenerationMode
) -> None:
    [operation] = [r.ok() for r in proxy_schema.get_all_operations() if r.ok().label == label]

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
        case.call_and_validate(
            base_url=proxy_url,
            headers=AUTH,
            excluded_checks=[not_a_server_error],
            additional_checks=[no_500],
        )

    run()
