"""An Ollama model as a gpuctl service, end to end: ``ensure``, ``status``, ``stop``.

The real CLI against a simulated Ollama on a simulated GPU, with the store on disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import gpuctl
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
    st = gpuctl(config, "status", "--json")
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

    st = json.loads(gpuctl(config, "status", "--json").stdout)
    (svc,) = st["services"]
    assert svc["decision"] == "READY"
    assert svc["memory_mib"] == 20 * GIB  # from /api/ps: Ollama's model has no process

    stop = gpuctl(config, "stop", "qwen")
    assert stop.returncode == 0, stop.stderr
    assert srv.ps() == {}
    assert claims_mib(sim_dir) == {}
    st = json.loads(gpuctl(config, "status", "--json").stdout)
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
