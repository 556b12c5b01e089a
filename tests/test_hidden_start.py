"""A record set aside without a sound phase may hide a start: UNKNOWN, never IDLE.

A record file that is not JSON (or a lease without a phase) restarts as a fresh
``stopped`` record; if it hid a start, that server may be reading weights unseen. Until
its health timeout has passed since the set-aside, its health answers, or a sound record
is written after it, ``status`` and ``ensure`` call it UNKNOWN (and ``ensure`` starts
nothing). The flows run on the real store's files with fakes for the rest (a fake
clock); the last test runs the installed ``gpuctl`` against a real agent.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.core.decision import Decision, Health
from gpuctl.core.record import Lease, Phase, Record, SetAside, hidden_by_set_aside
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.flows.deps import EnsureRequest
from gpuctl.flows.ensure.rounds import ensure
from gpuctl.flows.look import decide, observe
from gpuctl.flows.op_results import Outcome
from tests.flow_fakes import World, config, world
from tests.test_ensure_units import TWO_BIG

AT = 1_800_000_000.0
REFUSED = Health("refused", "connection refused")
READY = Health("ready", "HTTP 200", 200)


# ---- the rule, pure


def _aside(at: float = AT, service: str = "vllm") -> SetAside:
    return SetAside(service, f"{service}.json.corrupt-{int(at)}", at, 10, "at $: not JSON")


def _lease(granted: float, holder: str = "other") -> Lease:
    return Lease(holder, "dgx", "b", 1, None, "ensure", granted, granted + 600)


@pytest.mark.parametrize(
    ("record", "now", "hidden"),
    [
        # the fresh record of a set-aside that kept no phase: stopped since that moment
        (Record("vllm", since=AT + 0.4), AT + 5, True),
        (None, AT + 5, True),  # no record at all after it: nothing says otherwise
        (Record("vllm", since=AT + 0.4), AT + 61, False),  # its health timeout has passed
        (Record("vllm", since=AT - 30), AT + 5, False),  # a salvage that kept its phase
        (Record("vllm", Phase.STARTING, since=AT + 0.4), AT + 5, False),  # a phase speaks
        (Record("vllm", since=AT + 3), AT + 5, False),  # a phase written since
        # someone else's lease taken since the set-aside is a sound record written after it
        (Record("vllm", since=AT + 0.4, lease=_lease(AT + 2)), AT + 5, False),
        # the lease kept from the broken file (granted before) proves nothing
        (Record("vllm", since=AT + 0.4, lease=_lease(AT - 10)), AT + 5, True),
    ],
)
def test_the_rule(record: Record | None, now: float, hidden: bool) -> None:
    got = hidden_by_set_aside("vllm", record, [_aside()], 60.0, now)
    assert (got is not None) is hidden


def test_the_rule_ignores_other_services_and_own_leases() -> None:
    rec = Record("vllm", since=AT + 0.4, lease=_lease(AT + 2, holder="me"))
    assert hidden_by_set_aside("vllm", rec, [_aside()], 60.0, AT + 5, own_holder="me")
    assert hidden_by_set_aside("vllm", rec, [_aside()], 60.0, AT + 5) is None
    fresh = Record("vllm", since=AT + 0.4)
    assert hidden_by_set_aside("vllm", fresh, [_aside(service="chat")], 60.0, AT + 5) is None


# ---- the flows, on the real store's files


@pytest.fixture
def w(tmp_path: Path) -> World:
    return replace(world(tmp_path), config=config(tmp_path, TWO_BIG))


def break_record(w: World, service: str = "vllm", content: str = '{"service": "vll') -> None:
    """A record file that is not JSON, set aside by the next read."""
    path = w.store.state_dir / "records" / f"{service}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


def status_of(w: World, service: str, health: Health = REFUSED) -> Any:
    others = w.config.services_on("dgx")
    seen = observe(w.store.listing, w.agent.read, others)
    return decide(w.config.service(service), health, seen, others=others, now=w.clock())


def test_status_is_unknown_naming_the_set_aside_file(w: World) -> None:
    break_record(w)
    v = status_of(w, "vllm")
    assert v.decision is Decision.UNKNOWN, v.reason
    (kept,) = w.store.set_aside()
    assert f"records/{kept.file}" in v.reason
    assert f"remove records/{kept.file}" in v.hint
    assert w.store.get("vllm").phase is Phase.STOPPED  # the record itself starts afresh


def test_a_lease_without_a_phase_is_unknown_too(w: World) -> None:
    lease = _lease(w.clock() - 5).to_dict() | {"pid": 2**31}
    break_record(w, content=json.dumps({"service": "vllm", "since": 5.0, "lease": lease}))
    assert status_of(w, "vllm").decision is Decision.UNKNOWN


def test_a_salvage_that_kept_its_phase_is_judged_by_it(w: World) -> None:
    lease = _lease(w.clock() - 5).to_dict() | {"pid": 2**31}
    good = {"service": "vllm", "phase": "stopped", "since": 5.0, "lease": lease}
    break_record(w, content=json.dumps(good))
    assert status_of(w, "vllm").decision is Decision.IDLE


def test_ensure_exits_unknown_and_starts_nothing(w: World) -> None:
    break_record(w)
    r = ensure(w.deps(), EnsureRequest(wait=False))
    assert r.outcome is Outcome.UNKNOWN and r.exit_code == 4, r.reason
    assert w.launcher.started == []
    assert "remove records/vllm.json.corrupt-" in r.hint


def test_its_health_answering_wins(w: World) -> None:
    break_record(w)
    assert status_of(w, "vllm", READY).decision is Decision.READY
    w.health.ready_after(0)
    assert ensure(w.deps(), EnsureRequest(wait=False)).outcome is Outcome.READY


def test_it_counts_at_its_budget_for_a_rival(w: World) -> None:
    break_record(w)
    r = ensure(w.deps("chat"), EnsureRequest(wait=False))  # 80 + 80 GiB on 128 GiB
    assert r.outcome is Outcome.BUSY, r.reason
    assert w.launcher.started == []


def test_the_doubt_ends_with_the_health_timeout(w: World) -> None:
    break_record(w)
    status_of(w, "vllm")  # sets it aside
    w.clock.t += 62
    assert status_of(w, "vllm").decision is Decision.IDLE
    assert ensure(w.deps(), EnsureRequest(wait=False)).outcome is Outcome.STARTED


def test_a_lease_taken_after_the_set_aside_ends_the_doubt(w: World) -> None:
    break_record(w)
    assert status_of(w, "vllm").decision is Decision.UNKNOWN
    w.clock.t += 2
    granted, _ = w.store.acquire("vllm", holder_here("ensure"), 600)
    assert granted
    assert status_of(w, "vllm").decision is not Decision.UNKNOWN


# ---- end to end: the installed gpuctl and a real agent


@pytest.mark.e2e
def test_status_and_ensure_through_the_agent(sim_host: Any) -> None:
    from tests.conftest import gpuctl, gpuctl_in_process
    from tests.ensure_helpers import launches_in_log, service_toml, unique_name

    name = unique_name("llmh")
    cfg = sim_host.write_config(service_toml(name, 1, "sleep 60"))
    records = sim_host.state_dir / "records"
    records.mkdir(parents=True, exist_ok=True)
    (records / f"{name}.json").write_text("{not json")

    status = gpuctl_in_process(cfg, "status", "--json")
    assert status.returncode == 0, status.stderr  # the host answered
    (svc,) = json.loads(status.stdout)["services"]
    assert svc["decision"] == "UNKNOWN", svc
    kept = [p.name for p in records.glob(f"{name}.json.corrupt-*")]
    assert len(kept) == 1 and kept[0] in svc["reason"]
    out = gpuctl(cfg, "ensure", name, "--json", "--no-wait")
    assert out.returncode == 4, (out.stdout, out.stderr)
    result = json.loads(out.stdout)
    assert result["outcome"] == "unknown" and kept[0] in result["hint"]
    assert launches_in_log(sim_host.state_dir / "logs" / f"{name}.log") == 0


# ---- the direct path finds a start's server by its nonce, as the agent does


@pytest.mark.e2e
def test_the_direct_path_reports_a_server_found_by_its_nonce(tmp_path: Path) -> None:
    """No agent: ``status`` reads this machine itself. A start whose caller died before
    recording its server left only the nonce; the server holds GPU memory under a command
    line no keyword matches. It is the service's, with its real memory, as through the
    agent (``adapters.recorded_servers.find_servers`` on both paths)."""
    import uuid

    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.sim.host import SimHost
    from tests.conftest import gpuctl_exe
    from tests.ensure_helpers import cli_env, direct_config, service_toml

    name = f"llmn{uuid.uuid4().hex[:6]}"
    nonce = uuid.uuid4().hex
    with SimHost(root=tmp_path / "simhost") as host:
        cfg = direct_config(host, service_toml(name, 1, "sleep 1"))
        store = DirectStore(host.state_dir)
        h = holder_here("ensure")
        assert store.acquire(name, h, 600)[0]
        store.release(
            name, h.id, RecordUpdate.from_wire({"phase": "starting", "start_nonce": nonce})
        )
        server = host.spawn(
            ["sim", "hold", "--name", "ghostload", "--memory", "30GiB"],
            "ghost",
            extra_env={"GPUCTL_START_NONCE": nonce},
        )
        from tests.ensure_helpers import sim_claims

        deadline = time.monotonic() + 20
        while not sim_claims(host, "ghostload") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sim_claims(host, "ghostload") == [server.pid]
        env = {**cli_env(cfg), "GPUCTL_STATE_DIR": str(host.state_dir)}
        out = subprocess.run(
            [gpuctl_exe(), "status", "--json"], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        (svc,) = report["services"]
        assert svc["memory_mib"] == 30 * 1024, svc
        (proc,) = [p for hh in report["hosts"] for p in hh["processes"] if p["pid"] == server.pid]
        assert proc["service"] == name
