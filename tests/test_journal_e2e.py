"""The journal against the real thing: the original scenario through the CLI and a real
agent on the simulated GPU yields the expected events, with their causes and actors;
``gpuctl events`` and ``gpuctl usage`` read them back, through the agent and from the
files; their JSON meets the schemas in schemas/."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe, gpuctl_in_process
from tests.ensure_helpers import (
    cli_env,
    direct_config,
    kill_servers,
    priced_service,
    run_ensure,
    spawn_ensure,
    unique_name,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", "120GiB")
    api._reset_for_tests()
    with SimHost(gpu_memory="120GiB", root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h
    api._reset_for_tests()


def gpuctl(cfg: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [gpuctl_exe(), *args],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def events_json(cfg: Path, *args: str) -> list[dict[str, Any]]:
    r = gpuctl_in_process(cfg, "events", "--since", "1h", "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    schema = json.loads((ROOT / "schemas" / "events.schema.json").read_text())
    Draft202012Validator(schema).validate(out)
    events: list[dict[str, Any]] = out["events"]
    return events


def test_the_scenario_tells_its_story(host: SimHost) -> None:
    chat, photos, whisper = unique_name("chat"), unique_name("photos"), unique_name("whisper")
    pc, pp = free_port(), free_port()
    cfg = host.write_config(
        priced_service(chat, pc, 80, 100, 'preempt = true\nidle_timeout = "1s"')
        + priced_service(photos, pp, 30, 50, 'resume = true\nidle_timeout = "never"')
    )
    wjob = None
    try:
        assert run_ensure(cfg, photos).returncode == 0
        wjob = subprocess.Popen(
            [gpuctl_exe(), "run", "--memory", "15GiB", "--priority", "60", "--name", whisper,
             "--", sys.executable, "-m", "gpuctl", "sim", "hold", "--name", whisper,
             "--memory", "15GiB"],
            env=cli_env(cfg),
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.time() + 60
        while not any(e["service"] == f"run.{whisper}" for e in events_json(cfg)):
            assert time.time() < deadline, "whisper's launch was never journaled"
            time.sleep(0.2)
        r = run_ensure(cfg, chat)
        assert r.returncode == 0, r.stdout + r.stderr
        time.sleep(1.5)  # chat idle past its 1 s timeout
        deadline = time.time() + 60
        while True:
            r = gpuctl_in_process(cfg, "reclaim")
            assert r.returncode == 0, r.stdout + r.stderr
            if f"resumed {photos}" in r.stdout:
                break
            assert time.time() < deadline, r.stdout
            time.sleep(0.5)
        # The resume does not wait (`--no-wait`): whoever first sees photos answer with
        # nobody holding its lease tells its ready: the agent's check loop or its heal
        # pass, or a caller's touch (the record turns running once either way, and that
        # turn is the one ready event).
        deadline = time.time() + 60
        while not any(
            e["kind"] == "ready" and e["who"]["entry"] in ("agent", "touch")
            for e in events_json(cfg)
        ):
            assert time.time() < deadline, "the resumed start's ready was never journaled"
            time.sleep(0.2)

        events = events_json(cfg)
        story = [
            (e["kind"], e["service"], e.get("cause"), e.get("by"), e["who"].get("entry"))
            for e in events
            if e["kind"] in ("admit", "launch", "ready", "stop", "resume")
        ]
        expected = [
            ("admit", photos, None, None, "ensure"),
            ("launch", photos, None, None, "ensure"),
            ("ready", photos, None, None, "ensure"),
            ("launch", f"run.{whisper}", None, None, "run"),
            ("stop", photos, "preempted", chat, "preempt"),
            ("admit", chat, None, None, "ensure"),
            ("launch", chat, None, None, "ensure"),
            ("ready", chat, None, None, "ensure"),
            ("stop", chat, "idle", None, "reclaim"),
            ("admit", photos, None, None, "reclaim"),
            ("launch", photos, None, None, "reclaim"),
            ("resume", photos, None, None, "reclaim"),
            ("ready", photos, None, None, story[-1][4]),
        ]
        assert story[-1][4] in ("agent", "touch"), story
        assert story == expected, story
        # Through the agent: what it saw of each writer is beside what the writer says.
        # What the agent tells itself (a start it completed) has no peer.
        for e in events:
            assert e["who"]["user"], e
            if e["who"]["entry"] == "agent":
                assert "peer" not in e["who"] and "role" not in e["who"], e
                continue
            assert e["who"]["role"] == "write", e
            assert e["who"]["peer"].startswith("127.0.0.1:"), e
            assert e["who"]["user"], e
        preempted = next(e for e in events if e.get("cause") == "preempted")
        assert "priority 100" in preempted["reason"]
        assert f"preempted by {chat}" in preempted["text"]
        idle = next(e for e in events if e.get("cause") == "idle")
        assert idle["figures"]["idle_s"] >= 1.0
        ready = next(e for e in events if e["kind"] == "ready")
        assert ready["figures"]["cold_start_s"] > 0

        # The lines, newest last, in words.
        r = gpuctl_in_process(cfg, "events", "--since", "1h", "--service", chat)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert f"{chat} stopped: idle" in lines[-1], lines
        assert all(chat in line for line in lines)

        # Usage: the preemption counted for both sides; budgets known.
        r = gpuctl_in_process(cfg, "usage", "--since", "1d", "--json")
        assert r.returncode == 0, r.stderr
        usage = json.loads(r.stdout)
        schema = json.loads((ROOT / "schemas" / "usage.schema.json").read_text())
        Draft202012Validator(schema).validate(usage)
        rows = {row["key"]: row for row in usage["rows"]}
        assert rows[photos]["preempted"] == 1
        assert rows[chat]["preempting"] == 1
        assert rows[chat]["stops"] == {"idle": 1}
        assert rows[chat]["gib_hours"] is not None and rows[chat]["gib_hours"] > 0
        assert rows[f"run.{whisper}"]["jobs"] == 1
        assert rows[chat]["cold_starts"] == 1

        # The agent's counters.
        metrics = gpuctl_in_process(
            cfg, "status", "--json"
        )  # keeps the agent warm; never reads the journal
        assert metrics.returncode in (0, 3), metrics.stderr
        import httpx

        auth = {"Authorization": f"Bearer {host.token}"}
        text = httpx.get(f"{host.agent_url}/metrics", headers=auth).text
        assert 'gpuctl_stops_total{cause="idle"} 1' in text
        assert 'gpuctl_stops_total{cause="preempted"} 1' in text
        assert "gpuctl_starts_total 4" in text
        assert "gpuctl_journal_write_failures_total 0" in text
    finally:
        if wjob is not None:
            wjob.send_signal(signal.SIGTERM)
            wjob.wait(timeout=30)
        kill_servers(chat)
        kill_servers(photos)


def test_direct_host_journals_and_reads_without_an_agent(host: SimHost) -> None:
    """Without an agent the files are the journal: written and read here."""
    name, port = unique_name("llm"), free_port()
    cfg = direct_config(host, priced_service(name, port, 20, 50))
    try:
        r = run_ensure(cfg, name)
        assert r.returncode == 0, r.stdout + r.stderr
        r = gpuctl_in_process(cfg, "stop", name)
        assert r.returncode == 0, r.stderr
        kinds = [(e["kind"], e.get("cause")) for e in events_json(cfg, "--service", name)]
        assert kinds == [("admit", None), ("launch", None), ("ready", None), ("stop", "manual")]
        assert (host.state_dir / "journal.db").exists()
        mode = (host.state_dir / "journal.db").stat().st_mode & 0o777
        assert mode in (0o600, 0o660)
    finally:
        kill_servers(name)


def test_status_never_reads_the_journal(host: SimHost) -> None:
    cfg = direct_config(host, "")
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpuctl", "status", "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gpuctl.adapters.store.journal" not in r.stderr
    assert "sqlite3" not in r.stderr


def _journaled(host: SimHost, *services: str) -> list[tuple[int, dict[str, Any]]]:
    """The journal's events of ``services`` (ids and their JSON form), read from the files."""
    from gpuctl.adapters.store.journal import Journal

    j = Journal(host.state_dir)
    try:
        return [(rid, e.to_dict()) for rid, e in j.read(0.0) if e.service in services]
    finally:
        j.close()


@pytest.mark.slow
@pytest.mark.xdist_group("heavy")  # 32 callers: never beside another heavy test
def test_32_racing_ensures_through_the_agent_lose_and_duplicate_no_event(host: SimHost) -> None:
    """32 real `gpuctl ensure` at once through the agent: 16 for a service that fits (one
    of them launches it) and 16 for one that never fits beside a 20 GiB process outside
    gpuctl (each is refused). The journal holds exactly one admit, one launch and one
    ready for the first, by the caller that launched it, and one refusal per caller of
    the second: none lost, none twice."""
    fits, too_big = unique_name("fits"), unique_name("big")
    pf, pb = free_port(), free_port()
    cfg = host.write_config(
        priced_service(fits, pf, 20, 50).replace("--load-time 1s", "--load-time 4s")
        + priced_service(too_big, pb, 110, 50)
    )
    squatter = unique_name("squat")
    hold = subprocess.Popen(
        [sys.executable, "-m", "gpuctl", "sim", "hold", "--name", squatter, "--memory", "20GiB"],
        env=cli_env(cfg),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while squatter not in gpuctl_in_process(cfg, "status", "--json").stdout:
            assert time.time() < deadline, "the 20 GiB process never showed"
            time.sleep(0.2)
        procs = [spawn_ensure(cfg, fits if i % 2 else too_big) for i in range(32)]
        outs = [(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]
        fit_outs = [o for o in outs if fits in o[0]]
        big_outs = [o for o in outs if too_big in o[0]]
        assert [rc for _, rc, _, _ in fit_outs] == [0] * 16, [e[-300:] for *_, e in fit_outs]
        assert [rc for _, rc, _, _ in big_outs] == [3] * 16, [e[-300:] for *_, e in big_outs]
        launched = [json.loads(out)["launched"] for _, _, out, _ in fit_outs]
        assert launched.count(True) == 1
        launcher = procs[outs.index(fit_outs[launched.index(True)])].pid

        got = _journaled(host, fits, too_big)
        assert len({rid for rid, _ in got}) == len(got)
        mine = [e for _, e in got if e["service"] == fits]
        assert [e["kind"] for e in mine] == ["admit", "launch", "ready"], mine
        assert {e["who"]["pid"] for e in mine} == {str(launcher)}
        assert all(e["who"]["entry"] == "ensure" for e in mine)
        refused = [e for _, e in got if e["service"] == too_big]
        assert [e["kind"] for e in refused] == ["refuse"] * 16, refused
        # One refusal per caller: 16 pids, each once.
        assert len({e["who"]["pid"] for e in refused}) == 16
        import httpx

        auth = {"Authorization": f"Bearer {host.token}"}
        text = httpx.get(f"{host.agent_url}/metrics", headers=auth).text
        assert "gpuctl_starts_total 1" in text
        assert "gpuctl_journal_write_failures_total 0" in text
    finally:
        hold.terminate()
        hold.communicate(timeout=30)
        kill_servers(fits)
        kill_servers(too_big)


def test_a_no_wait_start_the_agent_completes_tells_its_ready(host: SimHost) -> None:
    """`ensure --no-wait` lets go of its lease while the server loads; the agent sees it
    answer and marks it running: that is its `ready`, with its cold-start time, once."""
    name, port = unique_name("nowait"), free_port()
    cfg = host.write_config(priced_service(name, port, 20, 50))
    try:
        r = run_ensure(cfg, name, "--no-wait")
        assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "started", r.stderr
        deadline = time.time() + 60
        while not any(e["kind"] == "ready" for _, e in _journaled(host, name)):
            assert time.time() < deadline, _journaled(host, name)
            time.sleep(0.2)
        r = run_ensure(cfg, name)  # it answers: nothing more to tell
        assert r.returncode == 0, r.stderr
        kinds = [(e["kind"], e["who"]["entry"]) for _, e in _journaled(host, name)]
        assert kinds == [("admit", "ensure"), ("launch", "ensure"), ("ready", "agent")], kinds
        ready = next(e for _, e in _journaled(host, name) if e["kind"] == "ready")
        assert ready["before"] == "starting" and ready["after"] == "running"
        assert ready["figures"]["cold_start_s"] > 0
        r = gpuctl_in_process(cfg, "usage", "--since", "1d", "--json")
        assert r.returncode == 0, r.stderr
        rows = {row["key"]: row for row in json.loads(r.stdout)["rows"]}
        assert rows[name]["cold_starts"] == 1
    finally:
        kill_servers(name)


def test_a_button_on_the_page_leaves_who_asked_in_the_journal(tmp_path: Path) -> None:
    """The page's ensure and stop run the CLI's flows inside the agent: their events name
    the page as the entry and carry the caller's peer and token role, as an event written
    through the agent does (a write token holder cannot act unseen through /actions)."""
    import httpx

    name = unique_name("ui-who")
    service = f'[services.{name}]\nlauncher = "process"\ncommand = "sleep 600 {name}"\n'
    with SimHost(root=tmp_path / "simhost") as sim:
        config = tmp_path / "agent.toml"
        config.write_text(f"[hosts.sim]\n\n{service}")
        sim.start_agent(args=["--config", str(config)])
        auth = {"Authorization": f"Bearer {sim.token}"}
        try:
            for op in ("ensure", "stop"):
                r = httpx.post(
                    f"{sim.agent_url}/actions/{op}",
                    json={"service": name},
                    headers=auth,
                    timeout=60,
                )
                assert r.status_code == 200 and r.json()["ok"], (op, r.text)
            events = httpx.get(
                f"{sim.agent_url}/events", params={"service": name, "since": "1h"}, headers=auth
            ).json()["events"]
        finally:
            kill_servers(name)
    by_page = [e for e in events if e["who"].get("entry") == "ui"]
    assert {"admit", "launch", "stop"} <= {e["kind"] for e in by_page}, events
    for e in by_page:
        assert e["who"]["role"] == "write", e
        assert e["who"]["peer"].startswith("127.0.0.1:"), e
