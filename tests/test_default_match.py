"""A service without ``match``: its name counts as a whole word of a command line only.

The real CLI on the simulated GPU with its agent. A process that only mentions the name
(``tail -f`` of gpuctl's own log of it, a notes file, a load test of
``/v1/chat/completions``) is not the service loading; a server started by hand that
names it (``--name chat``) still is, before it reaches the GPU (the original race).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    model_server_command,
    run_ensure,
    server_pids,
    unique_name,
)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name("chat")
    yield name
    kill_servers(name)


def service(name: str, port: int, command: str, match: str = "") -> str:
    """A service table without ``match`` (unless given): the default is its name."""
    return (
        f"[services.{name}]\n"
        'launcher = "process"\n'
        f"command = {json.dumps(command)}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f'memory = "20GiB"\n'
        f'health_timeout = "60s"\n'
        f"{match}\n"
    )


def status_of(cfg: Path, name: str) -> dict[str, Any]:
    out = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    (row,) = [s for s in json.loads(out)["services"] if s["name"] == name]
    return dict(row)


def bystanders(host: SimHost, name: str, tmp_path: Path) -> list[subprocess.Popen[bytes]]:
    """Processes that mention ``name`` but are not it, as the newcomer saw them."""
    log = host.state_dir / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()
    notes = tmp_path / f"{name}-notes.txt"
    notes.write_text("notes\n")
    sleeper = "import time, sys; time.sleep(120)"
    argvs = [
        ["tail", "-f", str(log)],  # gpuctl's own log of the service
        ["tail", "-f", str(notes)],  # `less chat-notes.txt`
        # another user's load test of the OpenAI path: the name inside a URL
        [sys.executable, "-c", sleeper, f"http://127.0.0.1:1/v1/{name}/completions"],
    ]
    return [
        subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argvs
    ]


def test_processes_that_only_mention_the_name_do_not_make_it_loading(
    host: SimHost, svc: str, tmp_path: Path
) -> None:
    port = free_port()
    cfg = host.write_config(
        service(svc, port, model_server_command(svc, port, memory="20GiB", load_time="1s"))
    )
    procs = bystanders(host, svc, tmp_path)
    try:
        row = status_of(cfg, svc)
        assert row["decision"] == "IDLE", row
        r = run_ensure(cfg, svc, "--timeout", "30s")
        out = json.loads(r.stdout)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert out["launched"] is True and out["decision"] == "IDLE", out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_server_started_by_hand_that_names_it_is_loading_before_the_gpu(
    host: SimHost, svc: str
) -> None:
    """The original race: a server whose CUDA context does not exist yet is LOADING, and a
    second start is refused, with the default keyword as with an explicit one."""
    port = free_port()
    cmd = model_server_command(svc, port, memory="20GiB", load_time="60s")
    cfg = host.write_config(service(svc, port, cmd))
    by_hand = subprocess.Popen(
        cmd.split(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        row = status_of(cfg, svc)
        assert row["decision"] == "LOADING", row
        r = run_ensure(cfg, svc, "--no-wait")
        out = json.loads(r.stdout)
        assert out["decision"] == "LOADING" and out["launched"] is False, out
        assert server_pids(svc) == [by_hand.pid]
    finally:
        by_hand.kill()
        by_hand.wait()


def test_a_wait_on_a_keyword_match_says_so_at_once(host: SimHost, svc: str, tmp_path: Path) -> None:
    """An explicit keyword is a substring, as promised: a process that carries it makes the
    service LOADING; ensure says at once that it may not be the service's (its hint),
    not only once the wait ran out."""
    port = free_port()
    cmd = model_server_command(svc, port, memory="20GiB", load_time="1s")
    cfg = host.write_config(service(svc, port, cmd, match=f'match = ["{svc}"]'))
    notes = tmp_path / f"{svc}-notes.txt"
    notes.write_text("notes\n")
    tail = subprocess.Popen(["tail", "-f", str(notes)], stdout=subprocess.DEVNULL)
    try:
        p = subprocess.Popen(
            [gpuctl_exe(), "ensure", svc, "--timeout", "60s"],
            env=cli_env(cfg),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stderr is not None
        first = p.stderr.readline()
        # It still waits: the line came while the wait runs, not with its end.
        running = p.poll() is None
        p.kill()
        p.communicate()
        assert running, first
        assert first.startswith(f"{svc}: waiting for pid {tail.pid} starting"), first
        assert "not yours?" in first and f"services.{svc}.match" in first, first
    finally:
        tail.kill()
        tail.wait()
