"""Memory per GPU, end to end: a simulated host of two 80 GiB GPUs made of real
processes, its real agent, and the installed ``gpuctl`` (status and ensure).

The reported case: 70 GiB used on one GPU and 10 GiB on the other is not "80 GiB of
160 GiB free" for an 80 GiB service; it fits nowhere. A 60 GiB service fits on the
emptier GPU, and the decision says which; a service pinned with ``devices`` starts there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import kill_servers, run_ensure, unique_name

GIB = 1024


@pytest.fixture
def two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    # Every process of the host (agent, holds, servers) inherits the two GPUs.
    monkeypatch.setenv("GPUCTL_SIM_GPUS", "80GiB,80GiB")
    with SimHost(root=tmp_path / "host") as host:
        # What `gpuctl ensure` launches inherits our environment: it must find this sim.
        monkeypatch.setenv("GPUCTL_SIM_DIR", str(host.sim_dir))
        SimGpu(host.sim_dir)  # writes gpu.json before anyone reads it
        host.start_agent()
        yield host


def status(cfg: Path) -> dict[str, Any]:
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg)}
    r = subprocess.run(
        [gpuctl_exe(), "status", "--json"], env=env, capture_output=True, text=True, check=False
    )
    assert r.stdout, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def wait_for(
    cfg: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> dict[str, Any]:
    # It polls in process: an interpreter spawned per look would cost the CPU the servers
    # under test need; the other looks of these tests go through the installed gpuctl.
    deadline = time.monotonic() + timeout
    while True:
        r = gpuctl_in_process(cfg, "status", "--json")
        assert r.stdout, r.stderr
        obj = json.loads(r.stdout)
        if pred(obj) or time.monotonic() > deadline:
            return obj
        time.sleep(0.3)


def by_name(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in obj["services"]}


@pytest.mark.e2e
def test_memory_is_per_gpu_through_a_real_agent(two_gpus: SimHost) -> None:
    host = two_gpus
    left, right = unique_name("left"), unique_name("right")
    host.hold(left, "70GiB")  # GPU 0
    host.spawn(["sim", "hold", "--name", right, "--memory", "10GiB", "--gpu", "1"], right)
    big, mid, pinned = unique_name("big"), unique_name("mid"), unique_name("pin")
    port = free_port()
    command = (
        f"{sys.executable} -m gpuctl sim model-server --name {pinned} --memory 60GiB "
        f"--load-time 1s --port {port} --gpu 1"
    )
    cfg = host.write_config(
        f'[services.{big}]\nmatch = ["{big}"]\nmemory = "80GiB"\n\n'
        f'[services.{mid}]\nmatch = ["{mid}"]\nmemory = "60GiB"\n\n'
        f"[services.{pinned}]\n"
        f'launcher = "process"\ncommand = {json.dumps(command)}\n'
        f'health = "http://127.0.0.1:{port}/health"\nmatch = ["{pinned}"]\n'
        f'memory = "60GiB"\ndevices = [1]\nhealth_timeout = "60s"\n'
    )
    try:
        obj = wait_for(
            cfg,
            lambda o: [d["memory_used_mib"] for d in o["hosts"][0]["devices"]] == [71680, 10240],
        )
        (h,) = obj["hosts"]
        assert [
            (d["index"], d["memory_used_mib"], d["memory_total_mib"]) for d in h["devices"]
        ] == [
            (0, 70 * GIB, 80 * GIB),
            (1, 10 * GIB, 80 * GIB),
        ]
        # The host-wide figures of the original API stay: 80 of 160 GiB used ...
        assert (h["memory_used_mib"], h["memory_total_mib"]) == (80 * GIB, 160 * GIB)
        svc = by_name(obj)
        # ... but no GPU has 80 GiB free.
        assert svc[big]["decision"] == "BUSY", svc[big]["reason"]
        assert "only 70.0 GiB of 80.0 GiB free on any GPU" in svc[big]["reason"]
        assert svc[big]["gpu"] is None
        assert (svc[mid]["decision"], svc[mid]["gpu"]) == ("FITS", 1), svc[mid]["reason"]
        assert (svc[pinned]["decision"], svc[pinned]["gpu"]) == ("FITS", 1)

        # The pinned service starts on its GPU ...
        r = run_ensure(cfg, pinned, "--timeout", "60s")
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert json.loads(r.stdout)["outcome"] in ("started", "ready")
        obj = wait_for(cfg, lambda o: by_name(o)[pinned]["decision"] == "READY")
        assert by_name(obj)[pinned]["decision"] == "READY", (by_name(obj)[pinned], r.stdout)
        (h,) = obj["hosts"]
        server = [p for p in h["processes"] if p["service"] == pinned]
        assert [p["gpu"] for p in server] == [1], h["processes"]
        assert [d["memory_used_mib"] for d in h["devices"]] == [70 * GIB, 70 * GIB]
        # ... and now 60 GiB fits on neither GPU.
        svc = by_name(obj)
        assert svc[mid]["decision"] == "BUSY", svc[mid]["reason"]
        assert "only 10.0 GiB" in svc[mid]["reason"]
    finally:
        kill_servers(pinned)


@pytest.mark.e2e
def test_human_view_shows_each_gpu(two_gpus: SimHost) -> None:
    host = two_gpus
    name = unique_name("hold")
    host.spawn(["sim", "hold", "--name", name, "--memory", "20GiB", "--gpu", "1"], name)
    cfg = host.write_config("")
    deadline = time.monotonic() + 15
    while True:  # in process, as wait_for polls
        r = gpuctl_in_process(cfg, "status", "--wide", env={"COLUMNS": "120", "NO_COLOR": "1"})
        if "20.0 GiB / 80.0 GiB" in r.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    gpu0 = next(line for line in lines if "GPU 0 memory" in line)
    gpu1 = next(line for line in lines if "GPU 1 memory" in line)
    assert "0 MiB / 80.0 GiB" in gpu0 and "util 0%" in gpu0
    assert "20.0 GiB / 80.0 GiB" in gpu1
    # --wide: temperature and power, unknown on the sim, shown as unknown, not 0, on
    # their own labelled line under the GPU's bar.
    assert "temperature ?  power ?" in lines[lines.index(gpu1) + 1]


@pytest.mark.e2e
def test_an_unpinned_service_starts_on_the_gpu_admission_chose(two_gpus: SimHost) -> None:
    """FITS on GPU 1 must mean it runs on GPU 1: CUDA would put an unpinned server on
    GPU 0, where 60 GiB does not fit beside 70 (the simulated server dies of OOM there,
    as a real one would). ensure pins it with CUDA_VISIBLE_DEVICES."""
    host = two_gpus
    left, right = unique_name("left"), unique_name("right")
    host.hold(left, "70GiB")
    host.spawn(["sim", "hold", "--name", right, "--memory", "10GiB", "--gpu", "1"], right)
    name, port = unique_name("anygpu"), free_port()
    command = (
        f"{sys.executable} -m gpuctl sim model-server --name {name} --memory 60GiB "
        f"--load-time 1s --port {port}"
    )
    cfg = host.write_config(
        f'[services.{name}]\nlauncher = "process"\ncommand = {json.dumps(command)}\n'
        f'health = "http://127.0.0.1:{port}/health"\nmatch = ["{name}"]\n'
        f'memory = "60GiB"\nhealth_timeout = "60s"\n'
    )
    try:
        obj = wait_for(
            cfg,
            lambda o: [d["memory_used_mib"] for d in o["hosts"][0]["devices"]] == [71680, 10240],
        )
        assert (by_name(obj)[name]["decision"], by_name(obj)[name]["gpu"]) == ("FITS", 1)
        r = run_ensure(cfg, name, "--timeout", "60s")
        assert r.returncode == 0, (r.stdout, r.stderr)
        obj = wait_for(cfg, lambda o: by_name(o)[name]["decision"] == "READY")
        (h,) = obj["hosts"]
        assert [p["gpu"] for p in h["processes"] if p["service"] == name] == [1], h["processes"]
        assert [d["memory_used_mib"] for d in h["devices"]] == [70 * GIB, 70 * GIB]
    finally:
        kill_servers(name)
