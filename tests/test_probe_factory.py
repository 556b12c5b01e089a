"""make_probe: names, and what ``auto`` picks."""

from __future__ import annotations

import ctypes
import shutil
import stat
from pathlib import Path

import pynvml
import pytest

from gpuctl.adapters.probes.factory import AutoProbe, make_probe
from gpuctl.adapters.probes.nvidia_smi import NvidiaSmiProbe
from gpuctl.adapters.probes.nvml import NvmlProbe
from gpuctl.errors import ExitCode, NoGpuFound, ProbeError, UsageError


def _gpu_here() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return shutil.which("nvidia-smi") is not None
    return True


def test_unknown_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown probe 'nvm'") as exc:
        make_probe("nvm")
    assert exc.value.exit_code == ExitCode.USAGE
    assert "nvidia-smi" in exc.value.hint


def test_named_probes_are_built_without_touching_the_gpu() -> None:
    nvml = make_probe("nvml", gpu_memory_mib=1000)
    assert isinstance(nvml, NvmlProbe) and nvml.name == "nvml"
    smi = make_probe("nvidia-smi")
    assert isinstance(smi, NvidiaSmiProbe) and smi.name == "nvidia-smi"


@pytest.mark.skipif(_gpu_here(), reason="this machine has an NVIDIA driver or nvidia-smi")
def test_auto_on_this_machine_finds_no_gpu() -> None:
    with pytest.raises(NoGpuFound) as exc:
        make_probe("auto")
    assert exc.value.message == (
        "no NVIDIA GPU found on this machine (no NVML library, no nvidia-smi)"
    )
    assert exc.value.hint == "try `gpuctl demo`, or `--probe sim` for a simulated GPU"
    assert exc.value.exit_code == ExitCode.UNKNOWN


def _no_nvml(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def init() -> None:
        raise pynvml.NVMLError(code)

    monkeypatch.setattr(pynvml, "nvmlInit", init)


def test_auto_without_nvml_or_smi_raises_no_gpu_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_nvml(monkeypatch, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NoGpuFound, match="no NVML library, no nvidia-smi") as exc:
        make_probe("auto")
    assert "gpuctl demo" in exc.value.hint


def test_auto_falls_back_to_nvidia_smi_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_nvml(monkeypatch, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert isinstance(make_probe("auto", gpu_memory_mib=5), NvidiaSmiProbe)


def test_auto_keeps_a_broken_nvml_error_when_there_is_no_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_nvml(monkeypatch, pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProbeError, match="failed to initialise") as exc:
        make_probe("auto")
    assert not isinstance(exc.value, NoGpuFound)


def test_auto_prefers_nvml_when_it_initialises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: object())
    probe = make_probe("auto")
    assert isinstance(probe, AutoProbe) and probe.name == "nvml"
    probe.close()


def test_auto_falls_back_to_nvidia_smi_when_nvml_reads_fail_on_an_old_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NVML loads, but the driver lacks the process lists a read needs: nvidia-smi (which
    ships with that driver) reads the GPU instead, from then on."""
    from tests.test_probe_nvml import Device, FakeDriver

    fake = FakeDriver(monkeypatch, Device())
    fake.missing = {f"nvmlDeviceGetComputeRunningProcesses{s}" for s in ("_v3", "_v2", "")}
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=*) echo "0, GPU-a, 81559, 4000, NVIDIA H100, 5, 40, 70.2" ;;\n'
        '  --query-compute-apps=*) echo "GPU-a, 4194000, 3900" ;;\n'
        "esac\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    probe = make_probe("auto")
    assert probe.name == "nvml"
    r = probe.read()
    assert (r.probe, probe.name) == ("nvidia-smi", "nvidia-smi")
    assert [(p.pid, p.memory_mib) for p in r.processes] == [(4194000, 3900)]
    assert any("NVML failed on this driver" in n for n in r.notes)
    inits = fake.calls["nvmlInit"]
    assert probe.read().probe == "nvidia-smi"
    assert fake.calls["nvmlInit"] == inits  # for good: NVML is not tried again
    probe.close()


def test_auto_without_smi_keeps_the_nvml_mismatch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.test_probe_nvml import Device, FakeDriver

    fake = FakeDriver(monkeypatch, Device())
    fake.missing = {f"nvmlDeviceGetComputeRunningProcesses{s}" for s in ("_v3", "_v2", "")}
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProbeError, match="compute process list"):
        make_probe("auto").read()


def test_sim_probe_gets_dir_and_total(tmp_path: Path) -> None:
    probe = make_probe("sim", sim_dir=tmp_path, gpu_memory_mib=4096)
    assert probe.name == "sim"
    r = probe.read()
    assert (r.probe, r.memory_total_mib, r.processes) == ("sim", 4096, ())
    probe.close()


@pytest.mark.parametrize(
    ("used", "total", "unified"),
    [(None, None, True), (None, 131072, True), (9000, 81920, False), (None, None, False)],
)
def test_agent_and_direct_path_build_the_same_snapshot(
    used: int | None, total: int | None, unified: bool
) -> None:
    """One way to observe a host: the agent's /status and the agent-less path agree on
    memory (the processes' sum where the device has no figure; the configured total where
    it has none). Where the device has no figure and a process's memory is unknown,
    its used memory is unknown on both paths: never that process counted as 0."""
    import httpx

    from gpuctl.adapters.local import build_snapshot
    from gpuctl.agent.app import AgentSettings, create_app
    from gpuctl.core.snapshot import GpuProcess
    from tests.agent_helpers import FakeProbe, reading_of, serve_in_thread

    procs = (
        GpuProcess(pid=4194000, command=None, memory_mib=700),
        GpuProcess(pid=4194001, command=None, memory_mib=None),
        GpuProcess(pid=4194002, command=None, memory_mib=300),
    )
    reading = reading_of(*procs, used=used, total=total, unified=unified)
    settings = AgentSettings(token=None, gpu_memory_mib=65536)
    with serve_in_thread(create_app(settings, FakeProbe(reading))) as url:
        remote = httpx.get(f"{url}/status").json()
    local = build_snapshot(reading, None, gpu_memory_mib=65536).to_wire()
    keys = ("memory_used_mib", "memory_total_mib", "unified_memory", "gpus", "processes")
    assert {k: remote[k] for k in keys} == {k: local[k] for k in keys}
    assert remote["devices"][0]["error"] == local["devices"][0]["error"]
    if used is not None:
        assert local["memory_used_mib"] == used
        assert local["memory_total_mib"] == (total if total is not None else 65536)
        return
    assert local["devices"][0]["error"] and "4194001" in local["devices"][0]["error"]
    assert remote["is_idle"] is False and local["is_idle"] is False
    # Every process's memory known: the device's used memory is their sum, both ways.
    known = reading_of(procs[0], procs[2], used=None, total=total, unified=unified)
    with serve_in_thread(create_app(settings, FakeProbe(known))) as url:
        remote = httpx.get(f"{url}/status").json()
    local = build_snapshot(known, None, gpu_memory_mib=65536).to_wire()
    assert {k: remote[k] for k in keys} == {k: local[k] for k in keys}
    assert local["memory_used_mib"] == 1000
    assert local["memory_total_mib"] == (total if total is not None else 65536)
