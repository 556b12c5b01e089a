"""The Slurm launcher against a real Slurm: Debian's slurmctld, slurmd and munge on
localhost, one node with 4 fake GRES GPUs, started by ``scripts/ensure-slurm`` (which
``scripts/test`` sources). Without it (not root, no apt-get) every test here skips,
saying why.

The servers are ``gpuctl sim model-server`` processes run as Slurm jobs on this machine,
listening on loopback. Every test shares the one node (filling its GPUs starves the
others), so they run one at a time in the "heavy" xdist group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import free_port
from tests.conftest import config_env, gpuctl, gpuctl_exe
from tests.ensure_helpers import model_server_command, spawn_ensure, unique_name


def _slurm_reason() -> str | None:
    if os.environ.get("GPUCTL_NO_SLURM") == "1":
        return "GPUCTL_NO_SLURM=1 (scripts/ensure-slurm could not start a cluster)"
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no Slurm client commands (source scripts/ensure-slurm first, as scripts/test does)"
    try:
        done = subprocess.run(
            ["sinfo", "--noheader", "--format", "%T %G"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo did not answer: {e}"
    if done.returncode != 0:
        return f"no Slurm cluster answers (sinfo: {done.stderr.strip()[:200]})"
    if "gpu:4" not in done.stdout:
        return f"the cluster has no node with 4 GRES GPUs (sinfo: {done.stdout.strip()[:200]})"
    return None


_REASON = _slurm_reason()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.xdist_group("heavy"),
    pytest.mark.slurm,
]


def squeue(name: str) -> list[dict[str, str]]:
    """The jobs of that name squeue lists (pending, running, completing)."""
    out = subprocess.run(
        ["squeue", "--noheader", "--name", name, "--format", "%i|%T|%r|%N"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return [{"id": r[0], "state": r[1], "reason": r[2], "node": r[3]} for r in rows]


def wait_gone(name: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while squeue(name):
        assert time.monotonic() < deadline, f"{name} is still queued: {squeue(name)}"
        time.sleep(0.2)


def cancel(name: str) -> None:
    subprocess.run(["scancel", "--full", "--name", name], timeout=20, check=False)


@pytest.fixture
def svc() -> Iterator[str]:
    """A unique service name; its jobs are cancelled when the test ends."""
    name = unique_name("slm")
    yield name
    cancel(f"gpuctl-{name}")
    wait_gone(f"gpuctl-{name}")


@pytest.fixture
def fill() -> Iterator[str]:
    """The name of a job that takes all 4 GPUs for a minute; cancelled at the end."""
    name = unique_name("fill")
    yield name
    cancel(name)
    wait_gone(name)


def config(tmp_path: Path, svc: str, *, command: str, port: int, extra: str = "") -> Path:
    sim = tmp_path / "sim"
    sim.mkdir(exist_ok=True)
    path = tmp_path / "slurm.toml"
    path.write_text(
        f'[hosts.cluster]\nprobe = "sim"\nsim_dir = "{sim}"\n\n'
        '[hosts.cluster.slurm]\ntime_limit = "10m"\ngpus = 1\n\n'
        f'[services.{svc}]\nlauncher = "slurm"\ncommand = {json.dumps(command)}\n'
        f'health = "http://{{node}}:{port}/health"\nhealth_timeout = "90s"\n{extra}\n'
    )
    return path


def server(tmp_path: Path, svc: str, **kw: Any) -> tuple[Path, int]:
    port = free_port()
    cmd = model_server_command(svc, port, "1GiB", "1s")
    return config(tmp_path, svc, command=cmd, port=port, **kw), port


def ensure_json(cfg: Path, svc: str, *args: str) -> tuple[int, dict[str, Any]]:
    r = gpuctl(cfg, "ensure", svc, "--json", *args)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"not JSON: {r.stdout!r} {r.stderr!r}") from None


def record(tmp_path: Path, svc: str) -> dict[str, Any]:
    state = Path(os.environ["GPUCTL_STATE_DIR"])
    return json.loads((state / "records" / f"{svc}.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "sim"))
    # As many simulated GPUs as the node's fake GRES: Slurm hands a job any of its 4
    # (CUDA_VISIBLE_DEVICES=1 while a cancelled job still ends on GPU 0), and a server
    # on a one-GPU sim host has no GPU 1.
    monkeypatch.setenv("GPUCTL_SIM_GPUS", "80GiB,80GiB,80GiB,80GiB")
    monkeypatch.delenv("GPUCTL_DEBUG", raising=False)


def test_submit_ready_on_its_node_then_stop_is_scancel(tmp_path: Path, svc: str) -> None:
    cfg, port = server(tmp_path, svc)
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready"), (out["reason"], out.get("log_tail"))
    rec = record(tmp_path, svc)
    assert rec["handle"]["kind"] == "slurm"
    job = rec["handle"]["job_id"]
    (row,) = squeue(f"gpuctl-{svc}")
    assert (row["id"], row["state"]) == (job, "RUNNING")
    # {node} became the node Slurm chose, and the server answers there.
    assert row["node"] and out["outcome"] == "ready"
    # Again: READY from its health check, no second job.
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready")
    assert len(squeue(f"gpuctl-{svc}")) == 1

    r = gpuctl(cfg, "stop", svc)
    assert r.returncode == 0, r.stderr
    assert squeue(f"gpuctl-{svc}") == []
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def fill_the_node(tmp_path: Path, fill: str) -> None:
    """Submit ``fill`` (all 4 GPUs, two minutes) and wait until it runs."""
    subprocess.run(
        ["sbatch", "--parsable", "--job-name", fill, "--gres", "gpu:4", "--time", "2",
         "--output", "/dev/null", "--wrap", "sleep 120"],
        check=True, capture_output=True, text=True, timeout=20, cwd=tmp_path,
    )  # fmt: skip
    wait_state(fill, "RUNNING")


def wait_state(name: str, state: str, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while [r["state"] for r in squeue(name)] != [state]:
        assert time.monotonic() < deadline, squeue(name)
        time.sleep(0.2)


def test_pending_while_the_node_is_full_then_ready(tmp_path: Path, svc: str, fill: str) -> None:
    fill_the_node(tmp_path, fill)
    cfg, _ = server(tmp_path, svc)
    code, out = ensure_json(cfg, svc, "--timeout", "3s")
    assert out["outcome"] == "timeout", out
    # Slurm's reason for a job that waits on a full node: Resources, or Priority when
    # another job waits before it.
    assert re.search(r"queued by Slurm: (Resources|Priority)", out["reason"]), out["reason"]
    (row,) = squeue(f"gpuctl-{svc}")
    assert row["state"] == "PENDING"
    # A second caller finds it LOADING, queued, and starts nothing.
    code, out = ensure_json(cfg, svc, "--no-wait")
    assert out["outcome"] == "loading", out
    # Slurm's reason for a job that waits on a full node: Resources, or Priority when
    # another job waits before it.
    assert re.search(r"queued by Slurm: (Resources|Priority)", out["reason"]), out["reason"]
    assert len(squeue(f"gpuctl-{svc}")) == 1

    cancel(fill)
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready"), (out["reason"], out.get("log_tail"))
    (row,) = squeue(f"gpuctl-{svc}")
    assert row["state"] == "RUNNING"


def test_a_job_that_fails_reads_failed_with_its_log(tmp_path: Path, svc: str) -> None:
    port = free_port()
    boom = f"{sys.executable} -c \"import sys; print('boom: no weights'); sys.exit(1)\""
    cfg = config(tmp_path, svc, command=boom, port=port)
    code, out = ensure_json(cfg, svc)
    assert out["outcome"] == "failed", out
    assert code == 1
    assert "boom: no weights" in out.get("log_tail", "") + json.dumps(record(tmp_path, svc))


def test_16_racing_callers_submit_one_job(tmp_path: Path, svc: str) -> None:
    cfg, _ = server(tmp_path, svc)
    procs = [spawn_ensure(cfg, svc) for _ in range(16)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        outs.append((p.returncode, stdout, stderr))
    for code, stdout, stderr in outs:
        assert code == 0, (stdout, stderr)
        assert json.loads(stdout)["outcome"] == "ready"
    assert len(squeue(f"gpuctl-{svc}")) == 1
    log = Path(record(tmp_path, svc)["handle"]["log"])
    assert log.read_text().count("--- gpuctl: submitting") == 1


def test_reclaim_cancels_an_idle_job(tmp_path: Path, svc: str) -> None:
    cfg, _ = server(tmp_path, svc, extra='idle_timeout = "1s"')
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready"), (out["reason"], out.get("log_tail"))
    assert len(squeue(f"gpuctl-{svc}")) == 1
    time.sleep(1.5)  # the idle timeout itself, not a threshold on gpuctl's speed
    r = gpuctl(cfg, "reclaim", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    (c,) = [c for c in json.loads(r.stdout)["candidates"] if c["service"] == svc]
    assert c["done"], json.dumps(c)
    assert squeue(f"gpuctl-{svc}") == []


def test_the_proxy_starts_a_job_on_demand(tmp_path: Path, svc: str, fill: str) -> None:
    """Requests through `gpuctl proxy` for a stopped Slurm service submit its job once,
    are held while Slurm queues it and while it loads, and are forwarded once it answers.
    On this one-node cluster the node is this machine, so the proxy's fixed `url` is
    loopback while `health` names `{node}`."""
    fill_the_node(tmp_path, fill)
    port = free_port()
    cfg = config(
        tmp_path,
        svc,
        command=model_server_command(svc, port, "1GiB", "1s"),
        port=port,
        extra=f'url = "http://127.0.0.1:{port}"\nqueue_timeout = "150s"',
    )
    listen = free_port()
    base = f"http://127.0.0.1:{listen}"
    plog = tmp_path / "proxy.log"
    with plog.open("ab") as out:
        proc = subprocess.Popen(
            [gpuctl_exe(), "proxy", "--listen", f"127.0.0.1:{listen}"],
            env=config_env(cfg),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, plog.read_text()
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, plog.read_text()
            time.sleep(0.1)
        answers: dict[int, httpx.Response | BaseException] = {}

        def ask(i: int) -> None:
            try:
                answers[i] = httpx.get(f"{base}/services/{svc}/health", timeout=180)
            except BaseException as e:  # reported by the assertion below
                answers[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # The node is full: the one job the proxy submitted waits, and so do the requests.
        wait_state(f"gpuctl-{svc}", "PENDING", limit_s=60)
        assert answers == {}
        assert len(squeue(f"gpuctl-{svc}")) == 1

        cancel(fill)
        for t in threads:
            t.join(timeout=180)
        assert sorted(answers) == [0, 1, 2, 3]
        for a in answers.values():
            assert isinstance(a, httpx.Response), a
            assert a.status_code == 200, a.text
        (row,) = squeue(f"gpuctl-{svc}")
        assert row["state"] == "RUNNING"
        log = Path(record(tmp_path, svc)["handle"]["log"])
        assert log.read_text().count("--- gpuctl: submitting") == 1
        # Once ready, a request is forwarded at once: still the one job.
        assert httpx.get(f"{base}/services/{svc}/health", timeout=60).status_code == 200
        assert len(squeue(f"gpuctl-{svc}")) == 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_record_keeps_the_health_url_on_its_node(tmp_path: Path, svc: str) -> None:
    """`{node}` is the ensure flow's to know (it asks squeue): once the job answers, the
    record keeps the URL on its node, which `status` (that never asks squeue) asks and
    shows, and the agent's poll never sees the template."""
    cfg, port = server(tmp_path, svc)
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready"), (out["reason"], out.get("log_tail"))
    (row,) = squeue(f"gpuctl-{svc}")
    url = f"http://{row['node']}:{port}/health"
    assert record(tmp_path, svc)["health"] == url
    r = gpuctl(cfg, "status", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    (s,) = [s for s in json.loads(r.stdout)["services"] if s["name"] == svc]
    assert (s["decision"], s["health"]) == ("READY", "ready"), s
    assert url in s["reason"], s
    # Again through an ensure that finds it answering: the record keeps it.
    code, out = ensure_json(cfg, svc)
    assert (code, out["outcome"]) == (0, "ready")
    assert record(tmp_path, svc)["health"] == url
