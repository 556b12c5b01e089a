"""Two laptops, two configs, one GPU: every client counts every record at the record's
own promise, whether or not its config names that service.

Laptop A's config names ``vllm`` (80 GiB), laptop B's names ``chat`` (80 GiB), both on
one 128 GiB simulated host. While vllm loads (holding little yet), B's ``ensure chat``
was admitted and vllm died of the simulated CUDA out-of-memory. Through the real agent
and through the direct store (a host without an agent), both orders; then a record an
older release wrote (no promise): UNKNOWN for B until A's ``touch`` heals it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_either
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    model_server_command,
    read_record,
    run_ensure,
    server_pids,
    service_toml,
    spawn_ensure,
    unique_name,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


def _service(name: str, port: int, load_time: str) -> str:
    toml = service_toml(name, port, model_server_command(name, port, "80GiB", load_time))
    return toml.replace('memory = "20GiB"', 'memory = "80GiB"')


def _configs(host: SimHost, a: str, b: str, *, direct: bool) -> tuple[Path, Path, int, int]:
    """Two configs for one host, each naming one of the services."""
    pa, pb = free_port(), free_port()
    host.write_config("")  # exports the agent's token for both configs
    if direct:
        head = f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{host.sim_dir}"\n\n'
    else:
        head = f'[hosts.sim]\nagent = "{host.agent_url}"\ntoken_env = "GPUCTL_DEMO_TOKEN"\n\n'
    ca, cb = host.base / "laptop-a.toml", host.base / "laptop-b.toml"
    ca.write_text(head + _service(a, pa, "30s"))
    cb.write_text(head + _service(b, pb, "30s"))
    return ca, cb, pa, pb


def _gpuctl(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return gpuctl_either({**cli_env(cfg), "COLUMNS": "200", "NO_COLOR": "1"}, *args)


def _wait_starting(host: SimHost, name: str) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            rec = read_record(host, name)
        except (FileNotFoundError, ValueError):
            rec = {}
        if rec.get("phase") == "starting" and rec.get("handle"):
            return rec
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached starting: {rec}")


@pytest.mark.parametrize("direct", [False, True], ids=["agent", "direct"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_the_other_configs_start_is_counted_at_its_promise(
    host: SimHost, direct: bool, first: str
) -> None:
    a, b = unique_name("vllm"), unique_name("chat")
    ca, cb, _, _ = _configs(host, a, b, direct=direct)
    (c1, s1), (c2, s2) = ((ca, a), (cb, b)) if first == "a" else ((cb, b), (ca, a))
    loading = spawn_ensure(c1, s1)
    try:
        rec = _wait_starting(host, s1)
        promise = rec["promise"]
        assert isinstance(promise, dict)
        assert promise["memory_mib"] == 80 * 1024, rec
        assert promise["priority"] == 50 and promise["kind"] == "server", rec

        second = run_ensure(c2, s2, "--no-wait")
        out = json.loads(second.stdout)
        assert second.returncode == 3, (second.stdout, second.stderr)
        assert out["decision"] == "BUSY", out
        assert s1 in out["reason"], out
        assert server_pids(s2) == [], "the second service was launched into promised memory"
        # What keeps the room is named (its promise, not only what it holds yet), and the
        # hint never offers a `gpuctl stop` this config cannot run.
        assert f"gpuctl stop {s1}" not in out["hint"], out
        if "(starting)" not in out["reason"]:  # its server holds memory already
            assert "counted at its 80.0 GiB budget" in out["reason"], out
            assert f"{s1}: not in this config" in out["hint"], out

        # Its status names the other laptop's service, and says it is not in this config.
        st = _gpuctl(c2, "status", "--json")
        obj = json.loads(st.stdout)
        others = obj["hosts"][0]["others"]
        row = next(o for o in others if o["name"] == s1)
        assert row["in_config"] is False and row["budget_mib"] == 80 * 1024, row
        assert row["phase"] == "starting", row
        text = _gpuctl(c2, "status").stdout
        assert s1 in text and "not in this config" in text, text
        locks = _gpuctl(c2, "locks").stdout
        assert f"{s1}: not in this config; counted at its promise: 80.0 GiB" in locks, locks
    finally:
        loading.kill()
        loading.communicate()
        kill_servers(s1)
        kill_servers(s2)


def test_a_record_without_a_promise_is_unknown_until_a_config_that_names_it_heals_it(
    host: SimHost,
) -> None:
    a, b = unique_name("vllm"), unique_name("chat")
    ca, cb, _, _ = _configs(host, a, b, direct=False)
    try:
        # A running server of A's, its record as an older release wrote it: no promise.
        started = run_ensure(ca, a, "--no-wait")
        assert started.returncode == 0, started.stdout + started.stderr
        path = host.state_dir / "records" / f"{a}.json"
        rec = json.loads(path.read_text())
        assert rec["promise"]["memory_mib"] == 80 * 1024
        del rec["promise"]
        path.write_text(json.dumps(rec))

        got = run_ensure(cb, b, "--no-wait")
        out = json.loads(got.stdout)
        assert got.returncode == 4 and out["decision"] == "UNKNOWN", out
        assert a in out["reason"] and "older gpuctl" in out["reason"], out
        assert f"gpuctl touch {a}" in (out.get("hint") or ""), out
        assert server_pids(b) == []
        # Status never draws the room it cannot count as free.
        st = json.loads(_gpuctl(cb, "status", "--json").stdout)
        assert st["hosts"][0]["memory_promised_mib"] is None, st["hosts"][0]
        assert st["hosts"][0]["devices"][0]["memory_promised_mib"] is None
        row = next(o for o in st["hosts"][0]["others"] if o["name"] == a)
        assert row["promise_known"] is False and row["budget_mib"] is None, row
        text = _gpuctl(cb, "status").stdout
        assert f"promised ? ({a}: unknown)" in text and "free ?" in text, text
        locks = _gpuctl(cb, "locks").stdout
        assert "does not say what it promised" in locks and f"gpuctl touch {a}" in locks, locks

        # A's next touch writes its figures into the record: the host heals as it is used.
        touched = _gpuctl(ca, "touch", a)
        assert touched.returncode == 0, touched.stderr
        healed = json.loads(path.read_text())
        assert healed["promise"]["memory_mib"] == 80 * 1024, healed

        again = run_ensure(cb, b, "--no-wait")
        out = json.loads(again.stdout)
        assert again.returncode == 3 and out["decision"] == "BUSY", out
        assert server_pids(b) == []
    finally:
        kill_servers(a)
        kill_servers(b)


def test_a_run_job_from_a_config_that_names_nothing_counts_the_loading_promise(
    host: SimHost,
) -> None:
    """`gpuctl run` decides through the same accounting: laptop B's job of 80 GiB is
    BUSY while laptop A's vllm loads, though B's config names no service at all."""
    a, b = unique_name("vllm"), unique_name("chat")
    ca, _cb, _, _ = _configs(host, a, b, direct=False)
    bare = host.base / "laptop-c.toml"
    bare.write_text(ca.read_text().split("[services.", 1)[0])
    loading = spawn_ensure(ca, a)
    try:
        _wait_starting(host, a)
        job = _gpuctl(bare, "run", "--memory", "80GiB", "--", "true")
        assert job.returncode == 3, (job.stdout, job.stderr)
        assert a in job.stderr, job.stderr
    finally:
        loading.kill()
        loading.communicate()
        kill_servers(a)
