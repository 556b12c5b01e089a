"""The fake vLLM's sleep mode frees and re-claims its memory as vLLM does, level by level."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuctl.sim.host import free_port
from tests.conftest import tagged
from tests.ollama_helpers import claims_mib, wait_until

GIB = 1024


# The server's name is this run's own: a stray "vllm" of another run matches nothing here.
VLLM = tagged("vllm")


class Server:
    def __init__(self, sim_dir: Path, log: Path, *args: str) -> None:
        self.port = free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_SIM")}
        env["PYTHONUNBUFFERED"] = "1"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuctl", "sim", "model-server", "--name", VLLM,
                 "--memory", "8GiB", "--load-time", "0.2s", "--port", str(self.port),
                 "--sim-dir", str(sim_dir), "--enable-sleep-mode", *args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=20)
        wait_until("the model server to answer", self._healthy)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def reply(self, **extra: object) -> dict[str, object]:
        r = self.http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra}
        )
        assert r.status_code == 200, r.text
        out: dict[str, object] = r.json()
        return out

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    return tmp_path / "sim"


@pytest.fixture
def server(sim_dir: Path, tmp_path: Path) -> Iterator[Server]:
    srv = Server(sim_dir, tmp_path / "vllm.log", "--token-delay", "20ms")
    yield srv
    srv.close()


def content(reply: dict[str, object]) -> str:
    choices = reply["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["message"]["content"])


def test_level_1_parks_the_weights_in_cpu_memory(server: Server, sim_dir: Path) -> None:
    assert claims_mib(sim_dir) == {VLLM: 8 * GIB}
    r = server.http.post("/sleep", params={"level": 1})
    assert r.json() == {"status": "sleeping", "level": 1}
    assert claims_mib(sim_dir) == {}, "level 1 gives the GPU memory back"
    assert "4.00 GiB of weights in CPU memory" in server.log.read_text()
    assert (
        server.http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ).status_code
        == 503
    )
    assert server.http.post("/wake_up").json()["status"] == "awake"
    assert claims_mib(sim_dir) == {VLLM: 8 * GIB}
    assert "simulated reply" in content(server.reply())


def test_level_2_discards_the_weights_until_reload(server: Server, sim_dir: Path) -> None:
    assert server.http.post("/sleep", params={"level": 2}).status_code == 200
    assert claims_mib(sim_dir) == {}
    assert "0.00 GiB of weights in CPU memory" in server.log.read_text()
    # vLLM's documented order: weights, reload_weights, then the KV cache.
    r = server.http.post("/wake_up", params={"tags": "weights"})
    assert r.json() == {"status": "sleeping", "tags": ["weights"]}
    assert claims_mib(sim_dir) == {VLLM: 4 * GIB}
    assert server.http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert server.http.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert server.http.post("/wake_up", params={"tags": "kv_cache"}).json()["status"] == "awake"
    assert claims_mib(sim_dir) == {VLLM: 8 * GIB}
    assert "simulated reply" in content(server.reply())


def test_level_2_woken_without_reload_answers_nonsense(server: Server) -> None:
    server.http.post("/sleep", params={"level": 2})
    server.http.post("/wake_up")
    assert "!!!!" in content(server.reply())
    assert server.http.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert "simulated reply" in content(server.reply())


def test_level_0_keeps_the_memory(server: Server, sim_dir: Path) -> None:
    server.http.post("/sleep", params={"level": 0})
    assert claims_mib(sim_dir) == {VLLM: 8 * GIB}
    assert server.http.get("/is_sleeping").json() == {"is_sleeping": True}


def stream_tokens(server: Server, n: int, started: threading.Event) -> list[str]:
    """A streaming request of ``n`` tokens; returns its tokens and, last, its finish reason."""
    got: list[str] = []
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": n, "stream": True}
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                got.append(choice["delta"]["content"])
                started.set()
            if choice["finish_reason"]:
                got.append(f"<{choice['finish_reason']}>")
    return got


@pytest.mark.parametrize(("mode", "cut"), [("abort", True), ("wait", False)])
def test_sleep_mode_abort_cuts_requests_and_wait_lets_them_finish(
    server: Server, mode: str, cut: bool
) -> None:
    started = threading.Event()
    result: list[list[str]] = []
    t = threading.Thread(target=lambda: result.append(stream_tokens(server, 50, started)))
    t.start()
    assert started.wait(20)
    assert server.http.post("/sleep", params={"level": 1, "mode": mode}).status_code == 200
    t.join(30)
    (tokens,) = result
    if cut:
        assert tokens[-1] == "<abort>" and len(tokens) < 51
    else:
        assert tokens[-1] == "<length>" and len(tokens) == 51


def test_bad_sleep_requests_are_400(server: Server) -> None:
    for params in ({"level": 3}, {"level": "x"}, {"level": 1, "mode": "keep"}):
        assert server.http.post("/sleep", params=params).status_code == 400
    assert server.http.post("/wake_up", params={"tags": "nope"}).status_code == 400
    assert server.http.post("/collective_rpc", content=b"[").status_code == 400
