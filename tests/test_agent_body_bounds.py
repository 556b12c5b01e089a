"""The agent's request-body bounds come first and answer: 200 KiB of whitespace was
taken as ``{}``, and a 10 MiB body got a connection reset instead of 413. A real agent
on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gpuctl.agent.wire import MAX_BODY_BYTES
from gpuctl.sim.host import SimHost


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimHost]:
    """One agent for the module: every request here is refused (413, 400) before it
    reaches the store, so no test changes what the next one finds."""
    with SimHost(root=tmp_path_factory.mktemp("simhost")) as h:
        h.start_agent()
        yield h


@pytest.mark.parametrize(
    "body",
    [b" " * (MAX_BODY_BYTES + 200 * 1024), b"\n" * (MAX_BODY_BYTES + 1), b"a" * (10 * 1024 * 1024)],
    ids=["limit+200KiB-spaces", "limit+1-newlines", "10MiB"],
)  # fmt: skip
def test_an_oversized_body_is_413(host: SimHost, body: bytes) -> None:
    r = httpx.post(
        f"{host.agent_url}/records/svc/touch",
        headers={"Authorization": f"Bearer {host.token}", "Content-Type": "application/json"},
        content=body,
        timeout=60,
    )
    assert r.status_code == 413, (r.status_code, r.text[:200])
    assert "request body over" in r.text


@pytest.mark.parametrize("pid", ["1.5", "4242.25", "1e-3"])
def test_a_pid_with_a_fraction_is_400(host: SimHost, pid: str) -> None:
    """docs/reference/agent.md: ``1.5`` is not a pid (``1.0`` is the integer 1: JSON has one
    number type)."""
    from gpuctl.adapters.store import holder_here

    h = holder_here("test").to_dict()
    raw = '{"holder": ' + __import__("json").dumps({**h, "pid": 7}).replace(
        '"pid": 7', f'"pid": {pid}'
    )
    r = httpx.post(
        f"{host.agent_url}/records/svc/lease",
        headers={"Authorization": f"Bearer {host.token}", "Content-Type": "application/json"},
        content=(raw + ', "ttl_s": 60}').encode(),
        timeout=60,
    )
    assert r.status_code == 400 and "holder.pid" in r.text, r.text
