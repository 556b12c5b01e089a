"""The simulated GPU, tested the way it is used: with real processes.

Every workload here is a real ``python -m gpuctl sim ...`` process; the probe sees its
real pid and command line, and killing it (even with SIGKILL, even leaving a zombie)
frees its memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

import httpx
import pytest

from gpuctl.adapters.probes.sim import SimProbe
from gpuctl.core.snapshot import GpuProcess
from gpuctl.sim.gpu import DEFAULT_TOTAL_MIB, SimError, SimGpu, SimOutOfMemory
from gpuctl.sim.host import free_port
from tests.conftest import tagged

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# ---------------------------------------------------------------------------- helpers


def wait_until(what: str, pred: Callable[[], T | None], timeout: float = 15.0) -> T:
    """Poll ``pred`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def on_gpu(sim_dir: Path) -> dict[int, GpuProcess]:
    return {p.pid: p for p in SimProbe(sim_dir).read().processes}


def proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Procs:
    """Starts real processes with their output in files, and always kills them."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "GPUCTL_SIM_DIR",
                "GPUCTL_SIM_GPU_MEMORY",
                "GPUCTL_SIM_GPUS",
                "CUDA_VISIBLE_DEVICES",
                "GPUCTL_DEBUG",
            )
        }
        self.env["PYTHONUNBUFFERED"] = "1"

    def start(
        self,
        *args: str | Path,
        argv0: tuple[str, ...] = ("-m", "gpuctl"),
        exe: str = sys.executable,
    ) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        out: IO[bytes]
        with open(self.logs / f"{n}.out", "wb") as out, open(self.logs / f"{n}.err", "wb") as err:
            proc = subprocess.Popen(
                [exe, *argv0, *map(str, args)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env,
                cwd=self.logs,
            )
        self.procs.append(proc)
        return proc

    def cli(self, *args: str | Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run ``gpuctl ARGS`` to completion."""
        return subprocess.run(
            [sys.executable, "-m", "gpuctl", *map(str, args)],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )

    def out(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.logs / f"{self.procs.index(proc)}.out").read_text(errors="replace")

    def err(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.logs / f"{self.procs.index(proc)}.err").read_text(errors="replace")

    def logs_of(self, proc: subprocess.Popen[bytes]) -> str:
        return f"stdout:\n{self.out(proc)}\nstderr:\n{self.err(proc)}"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(autouse=True)
def _no_sim_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCTL_SIM_DIR", raising=False)
    monkeypatch.delenv("GPUCTL_SIM_GPU_MEMORY", raising=False)
    monkeypatch.delenv("GPUCTL_SIM_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    logs = tmp_path / "logs"
    logs.mkdir()
    p = Procs(logs)
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    return tmp_path / "sim"  # missing on purpose: it is created on first use


def hold(
    procs: Procs, sim_dir: Path, name: str, memory: str, *extra: str
) -> subprocess.Popen[bytes]:
    return procs.start(
        "sim", "hold", "--name", name, "--memory", memory, "--sim-dir", sim_dir, *extra
    )


def hold_on_gpu(
    procs: Procs, sim_dir: Path, name: str, memory: str, *extra: str
) -> subprocess.Popen[bytes]:
    """Start a hold and wait until the probe sees it."""
    p = hold(procs, sim_dir, name, memory, *extra)

    def seen() -> bool:
        assert p.poll() is None, procs.logs_of(p)
        return p.pid in on_gpu(sim_dir)

    wait_until(f"hold {name} on the GPU", seen)
    return p


def model_server(
    procs: Procs, sim_dir: Path, name: str, memory: str, load_time: str, port: int, *extra: str
) -> subprocess.Popen[bytes]:
    return procs.start(
        "sim", "model-server", "--name", name, "--memory", memory, "--load-time", load_time,
        "--port", str(port), "--sim-dir", sim_dir, *extra,
    )  # fmt: skip


def wait_healthy(procs: Procs, proc: subprocess.Popen[bytes], port: int) -> None:
    def healthy() -> bool:
        assert proc.poll() is None, procs.logs_of(proc)
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until("the model server to be healthy", healthy)


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(10)


# ---------------------------------------------------------------------------- the GPU itself


def test_missing_or_empty_dir_is_an_idle_gpu_with_the_default_total(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for d in (tmp_path / "missing", tmp_path / "empty"):
        r = SimProbe(d).read()
        assert r.probe == "sim"
        assert r.processes == ()
        assert r.memory_total_mib == DEFAULT_TOTAL_MIB == 131072
        assert r.memory_used_mib == 0
        assert r.unified_memory is False and r.gpus == 1
        assert SimGpu(d).claims() == []
    assert not (tmp_path / "missing").exists(), "looking must not create anything"


def test_total_memory_is_agreed_through_gpu_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "sim"
    SimGpu(d, total_mib=65536)
    assert json.loads((d / "gpu.json").read_text()) == {"total_mib": 65536}
    assert SimGpu(d).total_mib == 65536
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "32GiB")
    assert SimGpu(d).total_mib == 32768
    assert json.loads((d / "gpu.json").read_text()) == {"total_mib": 32768}
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "lots")
    with pytest.raises(SimError, match="GPUCTL_SIM_GPU_MEMORY"):
        SimGpu(d)
    monkeypatch.delenv("GPUCTL_SIM_GPU_MEMORY")
    # A directory first used by a claim records the default.
    fresh = tmp_path / "fresh"
    with SimGpu(fresh).claim("x"):
        assert json.loads((fresh / "gpu.json").read_text()) == {"total_mib": DEFAULT_TOTAL_MIB}
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(fresh))
    assert SimGpu().sim_dir == fresh


def test_claims_grow_shrink_and_refuse_what_does_not_fit(sim_dir: Path) -> None:
    gpu = SimGpu(sim_dir, total_mib=10240)
    with gpu.claim("a") as a:
        a.set(6144)
        assert [(c.pid, c.name, c.memory_mib) for c in gpu.claims()] == [(os.getpid(), "a", 6144)]
        with gpu.claim("b") as b:
            with pytest.raises(SimOutOfMemory) as info:
                b.set(6144)
            e = info.value
            assert (e.requested_mib, e.free_mib, e.total_mib) == (6144, 4096, 10240)
            assert str(e).startswith(
                "CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a total capacity "
                "of 10.00 GiB of which 4.00 GiB is free."
            )
            assert f"Process {os.getpid()} has 6.00 GiB memory in use." in str(e)
            assert b.memory_mib == 0, "a failed grow keeps what it held"
            b.set(4096)
            assert gpu.used_mib() == 10240
            # Like NVML, the probe shows one process, with the sum of its claims.
            (proc,) = SimProbe(sim_dir).read().processes
            assert (proc.pid, proc.memory_mib) == (os.getpid(), 10240)
        a.set(1024)  # shrinking always fits
        assert gpu.used_mib() == 1024
    assert gpu.claims() == []
    assert os.listdir(sim_dir / "claims") == []
    with pytest.raises(RuntimeError):
        a.set(1)


def test_concurrent_claims_never_overcommit(procs: Procs, sim_dir: Path) -> None:
    """Six 3 GiB holds started at once on a 10 GiB GPU: exactly three fit."""
    ps = [hold(procs, sim_dir, f"racer{i}", "3GiB", "--gpu-memory", "10GiB") for i in range(6)]
    wait_until(
        "every hold to either fail or hold memory",
        lambda: all(p.poll() is not None or p.pid in on_gpu(sim_dir) for p in ps),
        timeout=30,
    )
    failed = [p for p in ps if p.poll() is not None]
    assert len(failed) == 3, [procs.logs_of(p) for p in failed]
    for p in failed:
        assert p.returncode == 1 and "CUDA out of memory" in procs.err(p)
    assert SimGpu(sim_dir).used_mib() == 9 * 1024
    assert sorted(on_gpu(sim_dir)) == sorted(p.pid for p in ps if p.poll() is None)


# ---------------------------------------------------------------------------- hold


def test_hold_shows_with_its_real_pid_and_goes_on_sigterm(procs: Procs, sim_dir: Path) -> None:
    p = hold_on_gpu(procs, sim_dir, "comfyui-t1", "20GiB")
    proc = on_gpu(sim_dir)[p.pid]
    assert proc.memory_mib == 20480
    assert proc.command is not None and "comfyui-t1" in proc.command and "hold" in proc.command
    assert proc.user is not None
    reading = SimProbe(sim_dir).read()
    assert reading.memory_used_mib == 20480 and reading.memory_total_mib == 131072
    assert stop(p) == 0
    assert on_gpu(sim_dir) == {}
    assert "holding 20.0 GiB" in procs.out(p)
    assert os.listdir(sim_dir / "claims") == [], "a clean stop leaves no files"


def test_hold_killed_with_sigkill_frees_its_memory(procs: Procs, sim_dir: Path) -> None:
    p = hold_on_gpu(procs, sim_dir, "crashy", "4GiB")
    p.kill()
    p.wait()
    assert on_gpu(sim_dir) == {}
    assert os.listdir(sim_dir / "claims") == [], "the first reader cleans up after the dead"


def test_hold_left_as_a_zombie_frees_its_memory(procs: Procs, sim_dir: Path) -> None:
    p = hold_on_gpu(procs, sim_dir, "zombie", "4GiB")
    p.kill()  # and do not reap it: it stays a zombie, as under a PID 1 that never reaps
    wait_until("the zombie", lambda: proc_state(p.pid) == "Z")
    assert p.pid not in on_gpu(sim_dir)


@pytest.mark.parametrize("reap", [False, True], ids=["zombie-locker", "reaped-locker"])
def test_claim_whose_locker_died_is_dead_even_if_a_fork_keeps_the_lock(
    procs: Procs, sim_dir: Path, reap: bool
) -> None:
    """A forked child inherits the lock's descriptor; the claim still dies with its process."""
    script = (
        "import os, sys, time\n"
        "from gpuctl.sim.gpu import SimGpu\n"
        "c = SimGpu(sys.argv[1]).claim('forky')\n"
        "c.set(2048)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(child, flush=True)\n"
        "time.sleep(60)\n"
    )
    p = procs.start(sim_dir, argv0=("-c", script))
    child = int(wait_until("the child's pid", lambda: procs.out(p).strip()))
    try:
        assert p.pid in on_gpu(sim_dir)
        p.kill()
        if reap:
            p.wait()
        else:
            wait_until("the zombie", lambda: proc_state(p.pid) == "Z")
        assert proc_state(child) not in (None, "Z"), "the child (and the lock) must live on"
        assert on_gpu(sim_dir) == {}
        assert SimGpu(sim_dir).claims() == []
    finally:
        os.kill(child, signal.SIGKILL)


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "-U", "-r", "-p", "-f", "--mount-proc", "true"],
        capture_output=True,
        check=False,
    )
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare_pid(), reason="cannot make a PID namespace here (unshare)")
def test_claim_from_another_pid_namespace_shows_its_host_pid(procs: Procs, sim_dir: Path) -> None:
    """As from a container: the claim records pid 1, the probe shows the real host pid."""
    box = tagged("in-a-box")
    wrapper = procs.start(
        "-U", "-r", "-p", "-f", "--mount-proc", "--kill-child",
        sys.executable, "-m", "gpuctl", "sim", "hold", "--name", box, "--memory", "2GiB",
        "--sim-dir", sim_dir,
        argv0=(),
        exe="unshare",
    )  # fmt: skip
    seen = wait_until("the namespaced hold", lambda: on_gpu(sim_dir))
    ((pid, proc),) = seen.items()
    try:
        (record,) = [json.loads(f.read_text()) for f in (sim_dir / "claims").glob("*.json")]
        assert record["pid"] == 1, "inside its namespace it is pid 1"
        assert pid not in (1, wrapper.pid) and proc.memory_mib == 2048
        assert proc.command is not None and box in proc.command
    finally:
        os.kill(pid, signal.SIGTERM)
    assert wrapper.wait(10) == 0
    assert on_gpu(sim_dir) == {}


def test_second_hold_that_does_not_fit_fails_like_cuda(procs: Procs, sim_dir: Path) -> None:
    a = hold_on_gpu(procs, sim_dir, "big", "30GiB", "--gpu-memory", "40GiB")
    b = hold(procs, sim_dir, "late", "20GiB", "--gpu-memory", "40GiB")
    assert b.wait(30) == 1
    err = procs.err(b)
    assert (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a "
        "total capacity of 40.00 GiB of which 10.00 GiB is free." in err
    )
    assert f"Process {a.pid} has 30.00 GiB memory in use." in err
    assert list(on_gpu(sim_dir)) == [a.pid]


# ---------------------------------------------------------------------------- model server


def test_model_server_refuses_while_loading_then_serves_like_vllm(
    procs: Procs, sim_dir: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    srv = model_server(procs, sim_dir, "simvllm-t", "8GiB", "2s", port, "--steps", "4")

    # Claimed (with 0 MiB) right after binding: from here the port is taken but refuses.
    wait_until("the claim", lambda: any(c.pid == srv.pid for c in SimGpu(sim_dir).claims()))
    twin = model_server(procs, sim_dir, "simvllm-twin", "1GiB", "0s", port)
    refused, seen = 0, set()
    while True:
        assert srv.poll() is None, procs.logs_of(srv)
        try:
            health = httpx.get(f"{base}/health", timeout=2)
        except httpx.ConnectError:
            refused += 1
            held = on_gpu(sim_dir).get(srv.pid)
            seen.add(held.memory_mib if held else 0)
            time.sleep(0.05)
            continue
        break
    assert health.status_code == 200 and health.content == b""
    assert refused > 0, "connections must be refused while loading"
    assert any(m is not None and 0 < m < 8192 for m in seen), f"memory grew in steps: {seen}"
    assert twin.wait(30) == 1
    assert "address already in use" in procs.err(twin)
    err = procs.err(twin).strip().splitlines()
    assert err[-2].startswith("gpuctl: error: cannot listen on 127.0.0.1:"), err
    assert err[-1].startswith("  hint: ") and "--port" in err[-1]

    proc = on_gpu(sim_dir)[srv.pid]
    assert proc.memory_mib == 8192 and proc.command is not None and "simvllm-t" in proc.command
    assert "Application startup complete." in procs.out(srv)
    assert "Loading weights step 2/4 (4.0 GiB)" in procs.out(srv)

    with httpx.Client(base_url=base, timeout=10) as client:
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["simvllm-t"]

        msgs = [{"role": "user", "content": "hello"}]
        answer = client.post("/v1/chat/completions", json={"model": "simvllm-t", "messages": msgs})
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"]

        events: list[str] = []
        with client.stream(
            "POST", "/v1/chat/completions", json={"messages": msgs, "stream": True}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert len(chunks) > 3 and all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert "simvllm-t" in text
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

        # A request in flight shows in vllm:num_requests_running.
        running = re.compile(r"^vllm:num_requests_running(\{[^}]*\})? (\S+)$", re.M)
        slow = threading.Thread(
            target=lambda: httpx.post(
                f"{base}/v1/chat/completions",
                json={"messages": msgs, "max_tokens": 60},
                timeout=30,
            )
        )
        slow.start()
        try:
            wait_until(
                "a running request in /metrics",
                lambda: float(running.search(client.get("/metrics").text).group(2)) == 1.0,  # type: ignore[union-attr]
            )
        finally:
            slow.join()
        metrics = client.get("/metrics").text
        assert float(running.search(metrics).group(2)) == 0.0  # type: ignore[union-attr]
        assert re.search(r"^vllm:num_requests_waiting(\{[^}]*\})? 0(\.0)?$", metrics, re.M)

        # Sleep mode was not asked for: its endpoints do not exist. Unknown paths are JSON 404s.
        assert client.post("/sleep", params={"level": 1}).status_code == 404
        nope = client.get("/nope")
        assert nope.status_code == 404 and nope.json() == {"detail": "Not Found"}
        wrong = client.post("/v1/chat/completions", json={"model": "other", "messages": msgs})
        assert wrong.status_code == 404

    late = model_server(procs, sim_dir, "simvllm-late", "1GiB", "0s", port)
    assert late.wait(30) == 1 and "address already in use" in procs.err(late)

    assert stop(srv) == 0
    assert on_gpu(sim_dir) == {}
    assert "Traceback" not in procs.err(srv)


def test_model_server_restarts_on_the_same_port_right_after_a_stop(
    procs: Procs, sim_dir: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    first = model_server(procs, sim_dir, "restarty", "1GiB", "0s", port)
    wait_healthy(procs, first, port)
    # A keep-alive connection still open at the stop: the server closes first, and its
    # side of the connection sits in TIME_WAIT on the port.
    with httpx.Client(timeout=5) as client:
        assert client.get(url).status_code == 200
        assert stop(first) == 0
    second = model_server(procs, sim_dir, "restarty", "1GiB", "0s", port)
    wait_healthy(procs, second, port)
    assert stop(second) == 0


def test_model_server_that_does_not_fit_dies_with_cuda_oom_and_frees_its_claim(
    procs: Procs, sim_dir: Path
) -> None:
    h = hold_on_gpu(procs, sim_dir, "squatter", "24GiB", "--gpu-memory", "40GiB")
    port = free_port()
    srv = model_server(
        procs, sim_dir, "toobig", "24GiB", "1s", port, "--steps", "4", "--gpu-memory", "40GiB"
    )
    assert srv.wait(30) == 1
    err = procs.err(srv)
    # Steps of 6 GiB: 6 and 12 fit beside 24 on 40; 18 does not (4 GiB left).
    assert (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a "
        "total capacity of 40.00 GiB of which 4.00 GiB is free." in err
    ), procs.logs_of(srv)
    assert "Loading weights step 2/4 (12.0 GiB)" in procs.out(srv)
    assert [c.pid for c in SimGpu(sim_dir).claims()] == [h.pid]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_sleep_mode_releases_memory_and_wake_up_reclaims_it(procs: Procs, sim_dir: Path) -> None:
    port = free_port()
    srv = model_server(
        procs, sim_dir, "sleepy", "8GiB", "0.5s", port,
        "--enable-sleep-mode", "--gpu-memory", "16GiB",
    )  # fmt: skip
    wait_healthy(procs, srv, port)
    assert on_gpu(sim_dir)[srv.pid].memory_mib == 8192
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        r = client.post("/sleep", params={"level": 1})
        assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}
        assert srv.pid not in on_gpu(sim_dir), "asleep, it holds no GPU memory"
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.get("/health").status_code == 200, "vLLM is healthy while asleep"

        # Someone takes the memory meanwhile: waking up runs out of memory, and it sleeps on.
        squatter = hold_on_gpu(procs, sim_dir, "squatter", "10GiB")
        r = client.post("/wake_up")
        assert r.status_code == 500 and "CUDA out of memory" in r.json()["message"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert stop(squatter) == 0

        r = client.post("/wake_up")
        assert r.status_code == 200 and r.json()["status"] == "awake"
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert on_gpu(sim_dir)[srv.pid].memory_mib == 8192
    assert stop(srv) == 0


def test_model_server_runs_with_nothing_but_the_stdlib(procs: Procs, sim_dir: Path) -> None:
    """As in a minimal container: no site-packages, only gpuctl on the path."""
    procs.env["PYTHONPATH"] = str(ROOT)
    check = subprocess.run(
        [
            sys.executable, "-S", "-c",
            "import sys, gpuctl.sim.model_server, gpuctl.sim.hold\n"
            "extra = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "print(sorted(extra - {'gpuctl', '__main__'}))",
        ],
        capture_output=True, text=True, env=procs.env, check=True,
    )  # fmt: skip
    assert check.stdout.strip() == "[]"
    port = free_port()
    srv = procs.start(
        "--name", tagged("bare"), "--memory", "1GiB", "--load-time", "0.2s", "--port", str(port),
        "--sim-dir", sim_dir,
        argv0=("-S", "-m", "gpuctl.sim.model_server"),
    )  # fmt: skip
    wait_healthy(procs, srv, port)
    assert on_gpu(sim_dir)[srv.pid].memory_mib == 1024
    assert stop(srv) == 0


# ---------------------------------------------------------------------------- CLI


def test_sim_ls_and_reset(procs: Procs, sim_dir: Path) -> None:
    a = hold_on_gpu(procs, sim_dir, "lister", "1GiB")
    r = procs.cli("sim", "ls", "--json", "--sim-dir", sim_dir)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["schema"] == 1 and data["memory_total_mib"] == 131072
    (claim,) = data["claims"]
    assert (claim["pid"], claim["name"], claim["memory_mib"]) == (a.pid, "lister", 1024)
    assert "lister" in claim["command"]
    r = procs.cli("sim", "ls", "--sim-dir", sim_dir)
    assert r.returncode == 0 and "lister" in r.stdout and "1.0 GiB" in r.stdout

    a.kill()
    a.wait()
    r = procs.cli("sim", "reset", "--sim-dir", sim_dir)
    assert r.returncode == 0 and "removed 1 dead claim " in r.stderr, r.stderr

    b = hold_on_gpu(procs, sim_dir, "victim", "1GiB")
    r = procs.cli("sim", "reset", "--all", "--sim-dir", sim_dir)
    assert r.returncode == 0, r.stderr
    assert b.wait(10) == 0
    r = procs.cli("sim", "ls", "--sim-dir", sim_dir)
    assert "no claims" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["sim", "hold", "--memory", "lots", "--name", "x"], "--memory"),
        (["sim", "hold", "--memory", "1GiB", "--name", "x", "--duration", "soon"], "--duration"),
        (
            ["sim", "model-server", "--name", "x", "--memory", "1GiB", "--load-time", "ages"],
            "--load-time",
        ),
        (["sim", "ls", "--gpu-memory", "0"], "--gpu-memory"),
    ],
)
def test_bad_sizes_and_durations_are_one_line_usage_errors(
    procs: Procs, sim_dir: Path, args: list[str], needle: str
) -> None:
    r = procs.cli(*args, "--sim-dir", sim_dir)
    assert r.returncode == 2
    assert r.stderr.startswith(f"gpuctl: error: {needle}") and "Traceback" not in r.stderr


def test_sim_imports_nothing_of_gpuctl_but_core() -> None:
    """The sim runs in a bare container; every module of it may lean on
    ``gpuctl.core`` only (run with -S: no site-packages at all)."""
    code = (
        "import importlib, pkgutil, sys, gpuctl.sim\n"
        "for m in pkgutil.iter_modules(gpuctl.sim.__path__):\n"
        "    importlib.import_module('gpuctl.sim.' + m.name)\n"
        "assert len([m for m in sys.modules if m.startswith('gpuctl.sim.')]) > 10\n"
        "print(sorted(m for m in sys.modules if m.startswith('gpuctl.')"
        " and not m.startswith(('gpuctl.sim', 'gpuctl.core'))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("xdg", [None, "/tmp/xdg-state", ""])
def test_default_sim_dir_matches_platformdirs(
    monkeypatch: pytest.MonkeyPatch, xdg: str | None
) -> None:
    """The sim computes its default without platformdirs; it must land where the CLI looks."""
    from gpuctl.config.paths import default_sim_dir as cli_default
    from gpuctl.sim.gpu import default_sim_dir

    monkeypatch.delenv("GPUCTL_SIM_DIR", raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_STATE_HOME", xdg)
    assert default_sim_dir() == cli_default()


# ---------------------------------------------------------------------------- several GPUs


def test_several_gpus_each_with_its_own_total(tmp_path: Path) -> None:
    d = tmp_path / "sim"
    sim = SimGpu(d, totals_mib=(81920, 40960))
    assert json.loads((d / "gpu.json").read_text()) == {
        "total_mib": 122880,
        "devices": [{"total_mib": 81920}, {"total_mib": 40960}],
    }
    assert SimGpu(d).totals_mib == (81920, 40960)  # every process agrees through gpu.json
    with sim.claim("big", gpu=0) as big, sim.claim("small", gpu=1) as small:
        big.set(81920)  # GPU 0 full ...
        small.set(40960)  # ... does not touch GPU 1
        small.set(1024)
        with pytest.raises(SimOutOfMemory) as exc:
            small.set(40961)
        assert "GPU 1 has a total capacity of 40.00 GiB" in exc.value.message
        assert [(c.name, c.gpu, c.memory_mib) for c in sim.claims()] == [
            ("big", 0, 81920),
            ("small", 1, 1024),
        ]
        assert (sim.used_mib(0), sim.used_mib(1), sim.used_mib()) == (81920, 1024, 82944)
    with pytest.raises(SimError, match="no GPU 2"):
        sim.claim("nowhere", gpu=2)


def test_several_gpus_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_SIM_GPUS", "80GiB, 40GiB")
    assert SimGpu(tmp_path / "a").totals_mib == (81920, 40960)
    monkeypatch.setenv("GPUCTL_SIM_GPUS", "80GiB,,40GiB")
    with pytest.raises(SimError, match="GPUCTL_SIM_GPUS"):
        SimGpu(tmp_path / "b")
    monkeypatch.setenv("GPUCTL_SIM_GPUS", "80GiB,0")
    with pytest.raises(SimError, match="GPUCTL_SIM_GPUS"):
        SimGpu(tmp_path / "c")


def test_probe_reports_each_gpu_with_its_claims(procs: Procs, sim_dir: Path) -> None:
    SimGpu(sim_dir, totals_mib=(81920, 81920))
    a = hold_on_gpu(procs, sim_dir, "left", "70GiB")
    b = hold_on_gpu(procs, sim_dir, "right", "10GiB", "--gpu", "1")
    r = SimProbe(sim_dir).read()
    assert [(d.index, d.memory_used_mib, d.memory_total_mib) for d in r.devices] == [
        (0, 71680, 81920),
        (1, 10240, 81920),
    ]
    assert {(p.pid, p.gpu) for p in r.processes} == {(a.pid, 0), (b.pid, 1)}
    # A third that fits on neither fails the way CUDA does, naming its GPU.
    c = hold(procs, sim_dir, "third", "71GiB", "--gpu", "1")
    assert c.wait(15) == 1
    assert "GPU 1 has a total capacity of 80.00 GiB" in procs.err(c)


def test_model_server_claims_the_gpu_cuda_visible_devices_names(
    procs: Procs, sim_dir: Path
) -> None:
    SimGpu(sim_dir, totals_mib=(8192, 8192))
    procs.env["CUDA_VISIBLE_DEVICES"] = "1"
    port = free_port()
    srv = model_server(procs, sim_dir, "pinned", "2GiB", "0.2s", port)
    wait_healthy(procs, srv, port)
    assert on_gpu(sim_dir)[srv.pid].gpu == 1
    assert stop(srv) == 0


def test_utilisation_while_answering_and_vllm_metrics(procs: Procs, sim_dir: Path) -> None:
    """The sim reports a model server busy while it answers (and idle after), and its
    /metrics carry what vLLM dashboards read, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    srv = model_server(procs, sim_dir, "busy", "1GiB", "0.1s", port, "--token-delay", "50ms")
    wait_healthy(procs, srv, port)
    idle = SimProbe(sim_dir).read()
    assert idle.processes[0].sm_util_pct == 0 and idle.devices[0].utilization_pct == 0
    url = f"http://127.0.0.1:{port}"
    body = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 40}
    answer: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        )
    )
    t.start()
    busy = wait_until(
        "the server to show busy",
        lambda: (r := SimProbe(sim_dir).read()).devices[0].utilization_pct and r,
    )
    assert busy.processes[0].sm_util_pct == busy.devices[0].utilization_pct == 70
    t.join(30)
    assert answer and answer[0].status_code == 200
    wait_until(
        "the server to show idle", lambda: SimProbe(sim_dir).read().devices[0].utilization_pct == 0
    )

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}

    def value(name: str, sample: str | None = None) -> float:
        (s,) = [x for x in families[name].samples if x.name == (sample or name)]
        return float(s.value)

    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 3
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 40
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 1
    ttft = value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
    assert 0.05 <= ttft < 5  # one token's delay, at least
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert value("vllm:kv_cache_usage_perc") == 0  # nothing in flight any more
    assert value("vllm:gpu_cache_usage_perc") == 0
    assert stop(srv) == 0


def test_kv_cache_usage_while_a_request_is_in_flight(procs: Procs, sim_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    srv = model_server(procs, sim_dir, "kv", "1GiB", "0.1s", port, "--token-delay", "50ms")
    wait_healthy(procs, srv, port)
    url = f"http://127.0.0.1:{port}"
    prompt = " ".join(["w"] * 1000)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 60, "stream": True}
    t = threading.Thread(
        target=lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    )
    t.start()

    def usage() -> float:
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            if fam.name == "vllm:kv_cache_usage_perc":
                return float(fam.samples[0].value)
        raise AssertionError("no vllm:kv_cache_usage_perc")

    in_flight = wait_until("the KV cache to fill", lambda: usage() >= 1000 / 65536 and usage())
    assert 0 < in_flight < 1
    t.join(30)
    wait_until("the KV cache to empty", lambda: usage() == 0)
    assert stop(srv) == 0


def test_sim_ls_shows_each_gpu(procs: Procs, sim_dir: Path) -> None:
    SimGpu(sim_dir, totals_mib=(8192, 4096))
    a = hold_on_gpu(procs, sim_dir, "lefty", "1GiB")
    b = hold_on_gpu(procs, sim_dir, "righty", "2GiB", "--gpu", "1")
    r = procs.cli("sim", "ls", "--json", "--sim-dir", sim_dir)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["gpus"] == [
        {"index": 0, "memory_total_mib": 8192, "memory_used_mib": 1024},
        {"index": 1, "memory_total_mib": 4096, "memory_used_mib": 2048},
    ]
    assert {(c["pid"], c["gpu"]) for c in data["claims"]} == {(a.pid, 0), (b.pid, 1)}
    r = procs.cli("sim", "ls", "--sim-dir", sim_dir)
    assert "GPU 1: 2.0 GiB used of 4.0 GiB" in r.stdout, r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith(str(b.pid)))
    assert row.split()[:4] == [str(b.pid), "righty", "1", "2.0"]


# ---------------------------------------------------------------------------- batch


def test_batch_gives_its_memory_back_when_its_last_item_is_done(
    procs: Procs, sim_dir: Path, tmp_path: Path
) -> None:
    """The sim batch (a VLM captioning photos) held its memory after its last item,
    until someone stopped it; a real batch process exits and its memory comes back."""
    items = tmp_path / "items"
    items.mkdir()
    for i in range(3):
        (items / f"p{i}.jpg").write_text(f"photo {i}\n")
    args = ("--name", tagged("batch"), "--memory", "10GiB", "--items", items)
    more = ("--port", free_port(), "--per-item", "50ms", "--sim-dir", sim_dir)
    p = procs.start(*args, *more, argv0=("-m", "gpuctl.sim.batch"))
    assert p.wait(timeout=30) == 0, procs.logs_of(p)
    assert (items / ".done.log").read_text().splitlines() == [f"done p{i}.jpg" for i in range(3)]
    assert on_gpu(sim_dir) == {} and os.listdir(sim_dir / "claims") == []
    out = procs.out(p)  # it claimed its memory (then said so), worked, and exited
    assert "3 items to do" in out and "all items done" in out, out
    # Started again with nothing left to do, it exits at once (and does nothing twice).
    again = procs.start(
        *args, "--port", free_port(), "--sim-dir", sim_dir, argv0=("-m", "gpuctl.sim.batch")
    )
    assert again.wait(timeout=30) == 0, procs.logs_of(again)
    assert len((items / ".done.log").read_text().splitlines()) == 3
    assert on_gpu(sim_dir) == {}


def test_model_server_answers_what_openai_clients_meet_first(procs: Procs, sim_dir: Path) -> None:
    """Beside chat: legacy completions, embeddings (floats, and the base64 the openai
    client asks for), a model's own card, a whisper-like transcription; 404s as vLLM's."""
    import openai

    port = free_port()
    model_server(procs, sim_dir, "simvllm-c", "1GiB", "0s", port)
    base = f"http://127.0.0.1:{port}"
    wait_until("the server", lambda: _answers(base))
    with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        done = client.completions.create(model="simvllm-c", prompt="once upon", max_tokens=3)
        assert done.choices[0].text == "This is a" and done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 3

        emb = client.embeddings.create(model="simvllm-c", input=["a", "b", "a"])
        vecs = [d.embedding for d in emb.data]
        assert len(vecs) == 3 and all(len(v) == 16 for v in vecs)
        assert vecs[0] == pytest.approx(vecs[2]) and vecs[0] != pytest.approx(vecs[1])
        assert sum(x * x for x in vecs[0]) == pytest.approx(1.0, abs=1e-3)
        floats = client.embeddings.create(model="simvllm-c", input="a", encoding_format="float")
        assert floats.data[0].embedding == pytest.approx(vecs[0], abs=1e-5)

        # finish_reason is "length" only when max_tokens cut the answer: its reply
        # sentence (14 tokens), said again as often as max_tokens asks.
        msg = [{"role": "user", "content": "hi"}]
        finishes = [
            client.chat.completions.create(
                model="simvllm-c",
                messages=msg,  # type: ignore[arg-type]
                **({} if n is None else {"max_tokens": n}),  # type: ignore[arg-type]
            )
            .choices[0]
            .finish_reason
            for n in (None, 14, 28, 3, 13)
        ]
        assert finishes == ["stop", "stop", "stop", "length", "length"]

        card = client.models.retrieve("simvllm-c")
        assert card.id == "simvllm-c" and card.owned_by == "vllm"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="other", input="a")

        text = client.audio.transcriptions.create(
            model="simvllm-c", file=("talk.wav", b"RIFF" + b"\0" * 96)
        )
        assert text.text == "This is a simulated transcription of talk.wav, 100 bytes of audio."
        plain = client.audio.transcriptions.create(
            model="simvllm-c", file=("talk.wav", b"x"), response_format="text"
        )
        assert "simulated transcription" in str(plain)
    r = httpx.get(base + "/nope", timeout=5)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_free_port_takes_turns_in_its_block_and_skips_a_bound_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``GPUCTL_SIM_PORTS``: a worker's own block. Two calls never hand out the same port
    before either is bound, and a port something holds is passed over."""
    import socket

    from gpuctl.sim import host

    def three_free() -> list[socket.socket]:
        # Three ports in a row, below the workers' blocks and the kernel's range.
        for lo in range(15000, 16000, 3):
            held: list[socket.socket] = []
            try:
                for port in range(lo, lo + 3):
                    s = socket.socket()
                    held.append(s)
                    s.bind(("127.0.0.1", port))
                return held
            except OSError:
                for s in held:
                    s.close()
        raise AssertionError("no three free ports in a row from 15000")

    monkeypatch.setattr(host, "_cursor", [])
    first, middle, last = three_free()
    lo = first.getsockname()[1]
    first.close()
    last.close()
    with middle:
        monkeypatch.setenv(host.PORTS_ENV, f"{lo}-{lo + 2}")
        got = [host.free_port() for _ in range(4)]
    assert lo + 1 not in got  # held all along
    assert len(set(got)) == 2 and set(got) == {lo, lo + 2}
    assert got[0] != got[1] and got[1] != got[2]  # in turn, not the same one again


@pytest.mark.parametrize("block", ["x", "2000", "9-5", "80-90", "1024-70000", "-"])
def test_free_port_refuses_a_bad_block(monkeypatch: pytest.MonkeyPatch, block: str) -> None:
    from gpuctl.sim import host
    from gpuctl.sim.errors import SimError

    monkeypatch.setenv(host.PORTS_ENV, block)
    with pytest.raises(SimError, match="GPUCTL_SIM_PORTS"):
        host.free_port()
