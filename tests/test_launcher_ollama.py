"""The ``ollama`` launcher against a real (simulated) Ollama server on a simulated GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.ollama import OllamaLauncher, keep_alive_for, normalize_model
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed
from gpuctl.sim.host import free_port
from tests.conftest import Closing
from tests.ollama_helpers import SimOllama, claims_mib, wait_until

GIB = 1024
SVC = ServiceConfig(name="qwen", host="local", launcher="ollama", health_timeout_s=60.0)


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    return tmp_path / "sim"


@pytest.fixture
def server(sim_dir: Path, tmp_path: Path) -> Iterator[SimOllama]:
    srv = SimOllama(sim_dir, tmp_path, "-m", "qwen3:32b=20GiB", "--load-time", "1s")
    yield srv
    srv.kill()


@pytest.fixture
def launcher(server: SimOllama, tmp_path: Path) -> Iterator[OllamaLauncher]:
    lx = OllamaLauncher(server.url, "qwen3:32b", keep_alive_s=1800, log_dir=tmp_path / "logs")
    yield lx
    lx.close()


def test_names_and_keep_alive() -> None:
    assert normalize_model("qwen3") == "qwen3:latest"
    assert keep_alive_for(1800.0) == 1800
    assert keep_alive_for(0.2) == 1
    assert keep_alive_for(None) == -1
    assert keep_alive_for(float("inf")) == -1


def test_start_loads_detached_and_health_follows_api_ps(
    launcher: OllamaLauncher, server: SimOllama, sim_dir: Path
) -> None:
    assert launcher.health().state == "refused"
    assert launcher.find(SVC) is None
    handle = launcher.start(SVC)
    assert handle.kind == "ollama" and handle.pid
    # While our load runs, a listed model is loading, not ready.
    first = launcher.health()
    assert not first.ok, first
    assert launcher.alive(handle) is True
    ready = wait_until("the model to be ready", lambda: launcher.health().ok)
    assert ready
    health = launcher.health()
    assert "20.0 GiB on the GPU" in health.detail
    assert claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}
    assert server.ps()["qwen3:32b"]["size_vram"] == 20 * 2**30
    assert "loaded: load" in launcher.log_tail(handle)
    assert launcher.find(SVC) == Handle(kind="ollama", proof="qwen3:32b")
    assert launcher.ps()["qwen3:32b"].vram_mib == 20 * GIB


def test_stop_unloads_and_frees_the_memory(
    launcher: OllamaLauncher, server: SimOllama, sim_dir: Path
) -> None:
    handle = launcher.start(SVC)
    wait_until("ready", lambda: launcher.health().ok)
    launcher.stop(handle, 10)
    assert server.ps() == {}
    assert claims_mib(sim_dir) == {}
    assert launcher.alive(handle) is False
    launcher.stop(handle, 10)  # idempotent


def test_stop_waits_for_requests_in_flight_and_says_so_when_they_outlast_it(
    server: SimOllama, tmp_path: Path, closing: Closing
) -> None:
    lx = OllamaLauncher(server.url, "qwen3:32b", log_dir=tmp_path)
    client = closing(ollama.Client(host=server.url))
    try:
        client.generate(model="qwen3:32b", prompt="")
        started = threading.Event()

        def long_request() -> None:
            for _ in client.generate(
                model="qwen3:32b", prompt="x", stream=True, options={"num_predict": 60}
            ):
                started.set()

        t = threading.Thread(target=long_request)
        t.start()
        assert started.wait(10)
        with pytest.raises(LauncherError, match="still has qwen3:32b loaded") as e:
            lx.stop(Handle(kind="ollama"), 0.3)
        assert "requests in flight" in e.value.hint
        assert "qwen3:32b" in server.ps()  # the request was not cut
        t.join(30)
        lx.stop(Handle(kind="ollama"), 10)
        assert server.ps() == {}
    finally:
        client.close()
        lx.close()


def test_a_model_ollama_does_not_have_fails_at_start_with_the_pull_hint(
    server: SimOllama, tmp_path: Path
) -> None:
    lx = OllamaLauncher(server.url, "nope:7b", log_dir=tmp_path)
    with pytest.raises(StartFailed) as e:
        lx.start(SVC)
    assert "ollama pull nope:7b" in e.value.hint
    lx.close()


def test_ollama_down(tmp_path: Path) -> None:
    lx = OllamaLauncher(f"http://127.0.0.1:{free_port()}", "qwen3:32b", timeout_s=1)
    health = lx.health()
    assert health.state == "refused" and "ollama serve" not in health.detail
    assert lx.alive(Handle(kind="ollama")) is None
    with pytest.raises(StartFailed, match="did not answer"):
        lx.start(SVC)
    with pytest.raises(LauncherError):
        lx.stop(Handle(kind="ollama"), 1)
    lx.close()


def test_the_load_goes_on_when_the_caller_exits_at_once(
    server: SimOllama, sim_dir: Path, tmp_path: Path
) -> None:
    """``ensure --no-wait`` or a killed caller: the detached loader finishes the load."""
    script = textwrap.dedent(
        f"""
        import os
        from gpuctl.adapters.launchers.ollama import OllamaLauncher
        from gpuctl.config import ServiceConfig
        lx = OllamaLauncher({server.url!r}, "qwen3:32b", log_dir=None)
        lx.start(ServiceConfig(name="qwen", host="local", launcher="ollama"))
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    wait_until("the model loaded after its caller left", lambda: "qwen3:32b" in server.ps())
    wait_until(
        "its memory on the GPU", lambda: claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}
    )


def test_the_loader_reports_what_ollama_refused(
    server: SimOllama, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuctl.adapters.launchers.ollama_loader import load, main

    assert load(server.url, "nope:7b", 60, 10) == 1
    assert "HTTP 404" in capsys.readouterr().out
    assert load(server.url, "qwen3:32b", 60, 10) == 0
    assert "loaded: load" in capsys.readouterr().out
    assert main(["too", "few"]) == 2
    assert main([server.url, "qwen3:32b", "soon", "10"]) == 2
