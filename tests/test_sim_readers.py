"""A read never changes the simulated hardware: the sim probe (the agent's, and the local
path's with a config ``gpu_memory``) and ``gpuctl sim ls`` read the GPUs that ``gpu.json``
names, whatever total they were given, and write nothing; only the ``gpuctl sim``
commands that make the host set its GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from gpuctl.adapters.probes.sim import SimProbe
from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl_exe, gpuctl_in_process_env

GIB = 1024
TWO_GPUS = (80 * GIB, 40 * GIB)


def _two_gpu_dir(path: Path) -> bytes:
    """A sim directory of two GPUs (80 and 40 GiB) as ``gpuctl sim`` makes it; its gpu.json."""
    SimGpu(path, totals_mib=TWO_GPUS)
    return (path / "gpu.json").read_bytes()


@pytest.fixture
def no_sim_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUCTL_SIM_GPUS", "GPUCTL_SIM_GPU_MEMORY", "GPUCTL_SIM_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("no_sim_env")
def test_the_probe_with_another_total_reads_gpu_json_and_writes_nothing(tmp_path: Path) -> None:
    d = tmp_path / "sim"
    before = _two_gpu_dir(d)
    probe = SimProbe(d, total_mib=128 * GIB)
    reading = probe.read()
    assert tuple(dev.memory_total_mib for dev in reading.devices) == TWO_GPUS
    assert any("not the 128.0 GiB asked" in n for n in reading.notes), reading.notes
    assert (d / "gpu.json").read_bytes() == before


@pytest.mark.usefixtures("no_sim_env")
def test_the_probe_with_the_env_total_reads_gpu_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "sim"
    before = _two_gpu_dir(d)
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "128GiB")
    reading = SimProbe(d).read()
    assert tuple(dev.memory_total_mib for dev in reading.devices) == TWO_GPUS
    assert (d / "gpu.json").read_bytes() == before


@pytest.mark.usefixtures("no_sim_env")
def test_a_reader_of_a_new_directory_uses_its_total_and_creates_nothing(tmp_path: Path) -> None:
    d = tmp_path / "sim"
    reading = SimProbe(d, total_mib=64 * GIB).read()
    assert [dev.memory_total_mib for dev in reading.devices] == [64 * GIB]
    assert not reading.notes
    assert not (d / "gpu.json").exists()
    # Once a sim command makes the host, the reader follows it.
    probe = SimProbe(d, total_mib=64 * GIB)
    _two_gpu_dir(d)
    assert tuple(dev.memory_total_mib for dev in probe.read().devices) == TWO_GPUS


@pytest.mark.usefixtures("no_sim_env")
def test_the_sim_commands_that_make_the_host_still_set_its_gpus(tmp_path: Path) -> None:
    d = tmp_path / "sim"
    _two_gpu_dir(d)
    SimGpu(d, total_mib=128 * GIB)  # a workload told one 128 GiB GPU: it defines the host
    assert tuple(dev.memory_total_mib for dev in SimProbe(d).read().devices) == (128 * GIB,)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_SIM_")}
    env.pop("GPUCTL_DEBUG", None)
    env.update(extra)
    return env


@pytest.mark.e2e
def test_an_agent_with_gpu_memory_reports_the_two_gpus(tmp_path: Path) -> None:
    """``gpuctl agent --probe sim --gpu-memory 128GiB`` (and GPUCTL_SIM_GPU_MEMORY in its
    environment, as SimHost sets it) over a two-GPU sim directory."""
    with SimHost(root=tmp_path / "host", gpu_memory="128GiB") as host:
        before = _two_gpu_dir(host.sim_dir)
        host.start_agent(args=["--gpu-memory", "128GiB"])
        req = urllib.request.Request(
            f"{host.agent_url}/status?fresh=1", headers={"Authorization": f"Bearer {host.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
        assert [d["memory_total_mib"] for d in body["devices"]] == list(TWO_GPUS)
        assert body["memory_total_mib"] == sum(TWO_GPUS)
        assert (host.sim_dir / "gpu.json").read_bytes() == before


@pytest.mark.e2e
def test_status_with_a_config_gpu_memory_reports_the_two_gpus(tmp_path: Path) -> None:
    d = tmp_path / "sim"
    before = _two_gpu_dir(d)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[hosts.local]\nprobe = "sim"\nsim_dir = "{d}"\ngpu_memory = "128GiB"\n\n'
        '[services.readersvc]\nmatch = ["no-such-process-readersvc"]\nmemory = "60GiB"\n'
    )
    # Spawned: the warning below is said once a process, and this worker may have said it.
    r = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=_env(GPUCTL_CONFIG=str(cfg), GPUCTL_STATE_DIR=str(tmp_path / "state")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (host,) = json.loads(r.stdout)["hosts"]
    assert [dev["memory_total_mib"] for dev in host["devices"]] == list(TWO_GPUS)
    assert "not the 128.0 GiB asked" in r.stderr  # the warning
    # and the note, in the host's JSON too (the direct path: no agent)
    assert any("not the 128.0 GiB asked" in n for n in host["notes"]), host["notes"]
    assert (d / "gpu.json").read_bytes() == before
    r = subprocess.run(
        [gpuctl_exe(), "sim", "ls", "--json", "--sim-dir", str(d), "--gpu-memory", "128GiB"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (d / "gpu.json").read_bytes() == before


@pytest.mark.e2e
def test_status_notes_a_gpu_json_that_overrides_the_agents_gpu_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuctl agent --probe sim --gpu-memory 64GiB`, then a sim workload makes the host
    128 GiB (its gpu.json): the agent reads 128 GiB, as the workloads' out-of-memory
    checks do, and `gpuctl status` says why it is not the 64 GiB asked, in its text and in
    --json's host `notes` (it showed 128 GiB with no word of it)."""
    with SimHost(root=tmp_path / "host", gpu_memory="128GiB") as host:
        host.start_agent(args=["--gpu-memory", "64GiB"])
        assert not (host.sim_dir / "gpu.json").exists()
        holder = host.hold("sim-note-holder", "1GiB")  # defines the host: 128 GiB
        deadline = time.monotonic() + 30
        while not SimGpu(host.sim_dir, define=False).claims():
            assert holder.poll() is None and time.monotonic() < deadline, host.log_tail("holder")
            time.sleep(0.05)
        monkeypatch.setenv("GPUCTL_DEMO_TOKEN", host.token)
        cfg = host.write_config("")
        env = _env(GPUCTL_CONFIG=str(cfg), COLUMNS="200", NO_COLOR="1")
        r = gpuctl_in_process_env(env, "status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        (h,) = json.loads(r.stdout)["hosts"]
        assert h["memory_total_mib"] == 128 * GIB
        (note,) = h["notes"]
        assert "128.0 GiB, not the 64.0 GiB asked" in note and "gpu.json" in note, note
        r = gpuctl_in_process_env(env, "status")
        assert r.returncode == 0, r.stdout + r.stderr
        text = " ".join(r.stdout.replace("│", " ").split())
        assert "note: the simulated GPUs in" in text and "not the 64.0 GiB asked" in text, text
