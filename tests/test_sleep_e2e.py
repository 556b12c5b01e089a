"""``stop = "sleep"``: a vLLM in sleep mode is SLEEPING, and ``ensure`` wakes it safely.

Real CLI, real agent, the fake vLLM on a simulated GPU (``--enable-sleep-mode``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl, gpuctl_in_process, tagged
from tests.ensure_helpers import (
    agent_host,
    kill_servers,
    model_server_command,
    service_toml,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name("sleepy")
    yield name
    kill_servers(name)


def decision(cfg: Path, svc: str) -> dict[str, Any]:
    st = json.loads(gpuctl_in_process(cfg, "status", "--json").stdout)
    (s,) = [x for x in st["services"] if x["name"] == svc]
    return dict(s)


def sleepy_config(host: SimHost, svc: str, port: int, level: int) -> Path:
    cmd = model_server_command(svc, port, memory="40GiB", load_time="1s") + " --enable-sleep-mode"
    return host.write_config(
        service_toml(svc, port, cmd, extra=f'stop = "sleep"\nsleep_level = {level}\n').replace(
            'memory = "20GiB"', 'memory = "40GiB"'
        )
    )


@pytest.mark.parametrize("level", [1, 2])
def test_ensure_wakes_a_sleeping_server(host: SimHost, svc: str, level: int) -> None:
    port = free_port()
    cfg = sleepy_config(host, svc, port, level)
    first = gpuctl(cfg, "ensure", svc, "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        assert http.post("/sleep", params={"level": level}).status_code == 200
        assert [c.memory_mib for c in _claims(host, svc)] in ([], [0]), "asleep, it holds none"
        s = decision(cfg, svc)
        assert s["decision"] == "SLEEPING", s

        woke = gpuctl(cfg, "ensure", svc, "--json")
        assert woke.returncode == 0, woke.stdout + woke.stderr
        out = json.loads(woke.stdout)
        assert out["outcome"] == "ready" and not out["launched"]
        assert any("woke it" in n for n in out["notes"])
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert [c.memory_mib for c in _claims(host, svc)] == [40 * 1024]
        reply = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ).json()
        # Level 2 discarded the weights: the wake reloaded them, or this would be "!!!!".
        assert "simulated reply" in reply["choices"][0]["message"]["content"]
        assert decision(cfg, svc)["decision"] == "READY"
    finally:
        http.close()


def test_a_wake_that_does_not_fit_is_busy_and_leaves_it_asleep(host: SimHost, svc: str) -> None:
    port = free_port()
    cfg = sleepy_config(host, svc, port, 1)
    assert gpuctl(cfg, "ensure", svc, "--json").returncode == 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        squatter = host.hold(tagged("squatter"), "100GiB")
        try:
            r = gpuctl(cfg, "ensure", svc, "--json")
            assert r.returncode == 3, r.stdout + r.stderr
            out = json.loads(r.stdout)
            assert out["outcome"] == "busy" and "waking needs" in out["reason"]
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        finally:
            host.stop(squatter)
        assert gpuctl(cfg, "ensure", svc, "--json").returncode == 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def _claims(host: SimHost, name: str) -> list[Any]:
    from gpuctl.sim.gpu import SimGpu

    return [c for c in SimGpu(host.sim_dir).claims() if c.name == name]
