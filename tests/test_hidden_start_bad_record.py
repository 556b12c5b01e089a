"""The attacker's reproduction of a hidden start, on real processes: the caller of
``ensure`` is killed -9 between spawning its server and recording it
(``GPUCTL_FAILPOINTS=ensure.after_spawn=pause``), then the service's record file is made
undecodable (a UTF-8 BOM before it, a lone ``\\xff`` byte inside ``failure.error``, the file
cut in half). While that server loads, the next ``ensure`` must not start it a second
time, a rival 80 GiB service must not be let in beside it (OOM), and ``stop`` must not
say that nothing of it was running. Real agent, real CLI, real detached servers on the
simulated GPU."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    big_service,
    end_in_window,
    ensure_paused_at,
    kill_servers,
    launches_in_log,
    plant_record,
    run_ensure,
    server_pids,
    sim_claims,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        kill_servers(n)


def _bom(raw: bytes) -> bytes:
    return b"\xef\xbb\xbf" + raw


def _ff_in_error(raw: bytes) -> bytes:
    data = json.loads(raw)
    data["failure"] = {"at": 1.0, "error": "MARK", "log_tail": "", "count": 1, "backoff_until": 0}
    return json.dumps(data).encode().replace(b"MARK", b"boom \xff here")


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


@pytest.mark.parametrize(
    "spoil", [_bom, _ff_in_error, _truncated], ids=["bom", "xff-in-error", "truncated"]
)
def test_an_undecodable_record_of_a_loading_server_hides_nothing(
    host: SimHost, names: list[str], spoil: Callable[[bytes], bytes]
) -> None:
    a, b = unique_name("hid"), unique_name("rival")
    server = unique_name("anon")  # its command line does not name `a`
    names += [a, b, server]
    pa, pb = free_port(), free_port()
    toml = big_service(a, pa, server, load_time="40s") + "\n" + big_service(b, pb, b, "1s")
    cfg = host.write_config(toml)
    end_in_window(ensure_paused_at(cfg, a), signal.SIGKILL)
    (pid,) = server_pids(server)
    path = host.state_dir / "records" / f"{a}.json"
    path.write_bytes(spoil(path.read_bytes()))

    r = run_ensure(cfg, b)
    assert r.returncode in (3, 4), (r.stdout, r.stderr)  # busy or unknown: never started
    assert server_pids(b) == [] and sim_claims(host, b) == []

    r = run_ensure(cfg, a, "--no-wait")
    assert r.returncode != 0 or json.loads(r.stdout)["launched"] is False, r.stdout
    assert server_pids(server) == [pid], "started twice"
    assert launches_in_log(host.state_dir / "logs" / f"{a}.log") == 1

    s = gpuctl_in_process(cfg, "stop", a)
    said = s.stdout + s.stderr
    assert "nothing of it was running" not in said, said
    if s.returncode == 0:  # found by its start nonce (kept from the broken file): stopped
        assert server_pids(server) == [], said
    else:  # nothing left to find it by: it says it cannot tell, and why
        assert s.returncode == 4 and "set aside as unreadable" in said, said
        assert server_pids(server) == [pid]


@pytest.mark.parametrize(
    ("field", "bad", "decision"),
    [("pid", "5150", "UNKNOWN"), ("kind", 7, "LOADING")],
    ids=["bad-pid", "bad-kind"],
)
def test_a_pre_nonce_record_with_one_bad_handle_field_is_never_idle(
    host: SimHost, names: list[str], field: str, bad: object, decision: str
) -> None:
    """A loading server's record an older release wrote (no start nonce), with one handle
    field off the schema: salvage keeps what passes, and the service reads UNKNOWN where
    what was kept does not prove its server (the pid was the bad field), LOADING where it
    does (the kept pid runs), never IDLE, so no second copy starts."""
    a, server = unique_name("pre"), unique_name("anon")  # its command does not name `a`
    names += [a, server]
    port = free_port()
    cfg = host.write_config(big_service(a, port, server, load_time="600s"))
    r = run_ensure(cfg, a, "--no-wait")
    assert r.returncode == 0, (r.stdout, r.stderr)
    (pid,) = server_pids(server)

    def row() -> dict[str, Any]:
        s = gpuctl_in_process(cfg, "status", "--json")
        assert s.stdout, s.stderr
        (got,) = [v for v in json.loads(s.stdout)["services"] if v["name"] == a]
        return got

    # First the agent sees the whole record's server loading (a loaded machine may take a
    # while to show a process spawned a moment ago); then one field of it goes bad.
    deadline = time.monotonic() + 60
    while (before := row())["decision"] != "LOADING":
        assert time.monotonic() < deadline, before
        time.sleep(0.5)
    path = host.state_dir / "records" / f"{a}.json"
    data = json.loads(path.read_text())
    assert data["handle"]["pid"] == pid
    data["start_nonce"] = None
    data["handle"][field] = bad
    plant_record(path, data)

    after = row()
    assert after["decision"] == decision, (after["reason"], after["hint"], after)
    if decision == "UNKNOWN":
        assert "handle" in after["reason"] and f"{a}.json.corrupt-" in after["hint"], after
        assert f"gpuctl stop {a}" in after["hint"], after

    r = run_ensure(cfg, a, "--no-wait")
    assert r.returncode == 4 or json.loads(r.stdout)["launched"] is False, (r.stdout, r.stderr)
    assert server_pids(server) == [pid], "started twice"
    assert launches_in_log(host.state_dir / "logs" / f"{a}.log") == 1
