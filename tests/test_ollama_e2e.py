"""An Ollama model as a gpuctl service, end to end: ``ensure``, ``status``, ``stop``.

The real CLI against a simulated Ollama on a simulated GPU, with the store on disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Closing, gpuctl, gpuctl_in_process
from tests.ollama_helpers import SimOllama, claims_mib

GIB = 1024


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, SimOllama]]:
    sim_dir = tmp_path / "sim"
    srv = SimOllama(sim_dir, tmp_path, "-m", "qwen3:32b=20GiB", "--load-time", "1s")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[hosts.box]\nprobe = "sim"\nsim_dir = "{sim_dir}"\nollama = "{srv.url}"\n\n'
        '[services.qwen]\nhost = "box"\nlauncher = "ollama"\nmodel = "qwen3:32b"\n'
        'memory = "20GiB"\nidle_timeout = "30m"\nhealth_timeout = "60s"\n'
    )
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    yield config, srv
    srv.kill()


@pytest.mark.slow
def test_ensure_loads_the_model_once_status_shows_it_and_stop_unloads_it(
    setup: tuple[Path, SimOllama], tmp_path: Path
) -> None:
    config, srv = setup
    sim_dir = tmp_path / "sim"
    st = gpuctl_in_process(config, "status", "--json")
    assert st.returncode == 0, st.stderr
    (svc,) = json.loads(st.stdout)["services"]
    assert svc["decision"] == "IDLE"

    first = gpuctl(config, "ensure", "qwen", "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    out = json.loads(first.stdout)
    assert out["outcome"] == "ready" and out["launched"] is True
    assert claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}
    # The load asked Ollama to keep the model as long as gpuctl's idle timeout.
    assert srv.output().count("INFO loading qwen3:32b") == 1

    again = json.loads(gpuctl(config, "ensure", "qwen", "--json").stdout)
    assert again["outcome"] == "ready" and not again.get("launched")
    assert srv.output().count("INFO loading qwen3:32b") == 1

    st = json.loads(gpuctl_in_process(config, "status", "--json").stdout)
    (svc,) = st["services"]
    assert svc["decision"] == "READY"
    assert svc["memory_mib"] == 20 * GIB  # from /api/ps: Ollama's model has no process

    stop = gpuctl_in_process(config, "stop", "qwen")
    assert stop.returncode == 0, stop.stderr
    assert srv.ps() == {}
    assert claims_mib(sim_dir) == {}
    st = json.loads(gpuctl_in_process(config, "status", "--json").stdout)
    assert st["services"][0]["decision"] == "IDLE"


def test_a_model_ollama_lacks_fails_with_the_pull_hint(
    setup: tuple[Path, SimOllama],
) -> None:
    config, _ = setup
    config.write_text(config.read_text().replace('model = "qwen3:32b"', 'model = "nope:7b"'))
    r = gpuctl(config, "ensure", "qwen", "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["outcome"] == "failed"
    assert "ollama pull nope:7b" in out["hint"]


def test_ensure_ready_loads_a_model_whose_daemon_answers_its_health_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Ollama model with a `health` URL (the daemon's root, which answers 200 whether
    or not the model is loaded): `gpuctl.api.ensure_ready_sync` does not call it READY
    on that 200, as the proxy does not; it loads the model through the ensure flow."""
    from gpuctl.api import ensure_ready_sync

    sim_dir = tmp_path / "sim"
    srv = SimOllama(sim_dir, tmp_path, "-m", "qwen3:32b=20GiB", "--load-time", "1s")
    try:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[hosts.box]\nprobe = "sim"\nsim_dir = "{sim_dir}"\nollama = "{srv.url}"\n\n'
            '[services.qwen]\nhost = "box"\nlauncher = "ollama"\nmodel = "qwen3:32b"\n'
            f'memory = "20GiB"\nhealth = "{srv.url}/"\nhealth_timeout = "60s"\n'
        )
        monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
        assert claims_mib(sim_dir) == {}
        r = ensure_ready_sync("qwen", config=config)
        assert r.ready and r.launched, r
        assert claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}
    finally:
        srv.kill()


def test_through_the_proxy_a_list_loads_nothing_and_status_counts_all_ollama_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closing: Closing
) -> None:
    """The official ollama client on ``/services/qwen/``: ``list()`` loads no model; a
    chat loads the service's; a model the client asked for besides counts in the
    service's memory too, as Ollama reports it (2 + 1 GiB, not 2)."""
    import os
    import subprocess

    import httpx
    import ollama

    from gpuctl.sim.host import free_port
    from tests.conftest import config_env, gpuctl_exe
    from tests.ollama_helpers import wait_until

    sim_dir = tmp_path / "sim"
    srv = SimOllama(
        sim_dir, tmp_path, "-m", "qwen3:32b=2GiB", "-m", "small:1b=1GiB", "--load-time", "0.2s"
    )
    config = tmp_path / "config.toml"
    config.write_text(
        f'[hosts.box]\nprobe = "sim"\nsim_dir = "{sim_dir}"\nollama = "{srv.url}"\n\n'
        '[services.qwen]\nhost = "box"\nlauncher = "ollama"\nmodel = "qwen3:32b"\n'
        'memory = "2GiB"\nidle_timeout = "30m"\nhealth_timeout = "60s"\n'
    )
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    port = free_port()
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(
            [gpuctl_exe(), "proxy", "--listen", f"127.0.0.1:{port}"],
            env={**os.environ, **config_env(config)}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until("the proxy to listen", up, 60)
        client = closing(ollama.Client(host=f"{url}/services/qwen"))
        names = {m.model for m in client.list().models}
        assert names == {"qwen3:32b", "small:1b"}
        assert srv.ps() == {} and claims_mib(sim_dir) == {}  # nothing loaded for a list
        assert client.ps().models == []

        reply = client.chat(model="qwen3:32b", messages=[{"role": "user", "content": "hi"}])
        assert reply.message.content
        client.generate(model="small:1b", prompt="hi")  # any model Ollama has
        assert set(srv.ps()) == {"qwen3:32b", "small:1b"}

        st = json.loads(gpuctl_in_process(config, "status", "--json").stdout)
        (svc,) = st["services"]
        assert svc["memory_mib"] == 3 * GIB, svc
    finally:
        proxy.terminate()
        proxy.wait(30)
        srv.kill()
