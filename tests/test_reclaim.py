"""``gpuctl reclaim`` end to end: the real CLI, a real agent, real servers on a simulated
GPU, real requests. Idle is reached by waiting for a short ``idle_timeout`` to pass
(a condition polled, never a fixed sleep)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.adapters.store import holder_here
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import Closing, gpuctl, gpuctl_in_process
from tests.ensure_helpers import (
    agent_host,
    cli_env,
    kill_servers,
    model_server_command,
    read_record,
    server_pids,
    service_toml,
    unique_name,
)
from tests.ollama_helpers import SimOllama, claims_mib, wait_until


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    yield from agent_host(tmp_path, monkeypatch)


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name("idle")
    yield name
    kill_servers(name)


def started(
    host: SimHost, svc: str, *, idle: str = "1s", extra: str = "", cmd: str = "", port: int = 0
) -> Path:
    port = port or free_port()
    command = cmd or model_server_command(svc, port, memory="20GiB", load_time="0.5s")
    toml = service_toml(svc, port, command, extra=f'idle_timeout = "{idle}"\n{extra}')
    cfg = host.write_config(toml)
    r = gpuctl(cfg, "ensure", svc, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return cfg


def port_of(cfg: Path, svc: str) -> int:
    import tomllib

    url = tomllib.loads(cfg.read_text())["services"][svc]["health"]
    return int(url.rsplit(":", 1)[1].split("/")[0])


def idle_past(host: SimHost, svc: str, seconds: float) -> None:
    """Wait until the record's last use is older than ``seconds``."""

    def old() -> bool:
        last = read_record(host, svc).get("last_used")
        return last is not None and time.time() - last > seconds

    wait_until(f"{svc} to sit idle for {seconds}s", old)


def reclaim_json(cfg: Path, *args: str) -> tuple[int, dict[str, Any]]:
    r = gpuctl_in_process(cfg, "reclaim", "--json", *args)
    return r.returncode, json.loads(r.stdout)


def candidate(out: dict[str, Any], svc: str) -> dict[str, Any]:
    (c,) = [c for c in out["candidates"] if c["service"] == svc]
    return dict(c)


def test_nothing_to_do_is_silent(host: SimHost, svc: str) -> None:
    cfg = started(host, svc, idle="30m")
    r = gpuctl_in_process(cfg, "reclaim")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    code, out = reclaim_json(cfg)
    assert code == 0 and out["schema"] == 1
    c = candidate(out, svc)
    assert c["action"] == "keep" and c["reason"].startswith("idle ") and not c["done"]
    assert len(server_pids(svc)) == 1
    # A person trying --dry-run learns it looked (stderr; stdout stays the actions).
    dry = gpuctl_in_process(cfg, "reclaim", "--dry-run")
    assert (dry.returncode, dry.stdout) == (0, "")
    assert dry.stderr == "nothing to reclaim on sim (1 service checked)\n"


def test_an_idle_server_is_stopped_with_one_line(host: SimHost, svc: str) -> None:
    cfg = started(host, svc)
    idle_past(host, svc, 1.0)
    dry = gpuctl_in_process(cfg, "reclaim", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith(f"would stop {svc} on sim: idle ")
    assert "nothing to reclaim" not in dry.stderr
    assert len(server_pids(svc)) == 1, "--dry-run changes nothing"
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"stopped {svc} on sim: " + r.stdout.split(": ", 1)[1].strip()]
    # Its idle time against the 1 s limit, never read as a contradiction ("1s > 1s"):
    # "1.4s > 1.0s" when both round to 1s, "2s > 1s" on a machine slow enough to pass 2 s.
    m = re.search(r": idle (\S+) > (\S+)$", r.stdout.strip())
    assert m and m.group(1) != m.group(2) and m.group(2) in ("1s", "1.0s"), r.stdout
    assert server_pids(svc) == []
    rec = read_record(host, svc)
    assert rec["phase"] == "stopped" and rec["lease"] is None and rec["handle"] is None
    # Stopped: the next run has nothing to do.
    again = gpuctl_in_process(cfg, "reclaim")
    assert (again.returncode, again.stdout) == (0, "")


def test_never_exempts(host: SimHost, svc: str) -> None:
    cfg = started(host, svc, idle="never")
    code, out = reclaim_json(cfg)
    assert code == 0 and candidate(out, svc)["reason"] == 'idle_timeout = "never"'
    assert len(server_pids(svc)) == 1


def test_a_request_in_flight_is_never_cut_and_the_server_is_touched(
    host: SimHost, svc: str
) -> None:
    cfg = started(host, svc)
    port = port_of(cfg, svc)
    first = threading.Event()
    tokens: list[str] = []

    def long_stream() -> None:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 150, "stream": True}
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["delta"].get("content"):
                        tokens.append(choice["delta"]["content"])
                        first.set()
                    if choice["finish_reason"]:
                        tokens.append(f"<{choice['finish_reason']}>")

    t = threading.Thread(target=long_stream)
    t.start()
    assert first.wait(20)
    idle_past(host, svc, 1.0)  # the request is older than the idle timeout
    assert t.is_alive()
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"touched {svc} on sim: in flight: 1 request"
    assert len(server_pids(svc)) == 1
    t.join(60)
    assert tokens[-1] == "<length>" and len(tokens) == 151, "the request ran to its end"


def test_an_in_use_holder_keeps_it(host: SimHost, svc: str) -> None:
    cfg = started(host, svc)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from gpuctl.api import in_use
            with in_use({svc!r}, config={str(cfg)!r}):
                print("in", flush=True)
                sys.stdin.readline()
            print("out", flush=True)
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cli_env(cfg),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "in\n"
        # in_use renews last_used every few seconds: make its timeout shorter than that
        # by waiting past 1 s since the entry was written.
        idle_past(host, svc, 1.0)
        code, out = reclaim_json(cfg)
        c = candidate(out, svc)
        assert code == 0 and (c["action"], c["reason"]) == ("touch", "in flight: 1 request")
        assert len(server_pids(svc)) == 1
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "out\n"
    finally:
        holder.kill()
        holder.communicate(timeout=10)  # closes its pipes
    idle_past(host, svc, 1.0)
    code, out = reclaim_json(cfg)
    assert candidate(out, svc)["action"] == "stop" and candidate(out, svc)["done"]
    assert server_pids(svc) == []


def test_a_lease_held_keeps_it(host: SimHost, svc: str) -> None:
    cfg = started(host, svc)
    idle_past(host, svc, 1.0)
    store = DirectStore(host.state_dir)
    other = holder_here("ensure")
    assert store.acquire(svc, other, 60)[0]
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0
    assert r.stdout.startswith(f"kept {svc} on sim: lease held by ensure pid ")
    assert len(server_pids(svc)) == 1
    store.release(svc, other.id)


def test_one_run_at_a_time_per_host(host: SimHost, svc: str) -> None:
    cfg = started(host, svc)
    idle_past(host, svc, 1.0)
    store = DirectStore(host.state_dir)
    run = holder_here("reclaim")
    assert store.acquire("_reclaim", run, 60)[0]
    r = gpuctl_in_process(cfg, "reclaim")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    code, out = reclaim_json(cfg)
    assert code == 0 and out["hosts"][0]["skipped"].startswith("another reclaim runs there")
    assert out["candidates"] == []
    assert len(server_pids(svc)) == 1
    store.release("_reclaim", run.id)
    assert gpuctl_in_process(cfg, "reclaim").stdout.startswith(f"stopped {svc}")


def test_a_host_that_cannot_be_read_is_exit_4_and_nothing_stops(
    host: SimHost, svc: str, tmp_path: Path
) -> None:
    cfg = started(host, svc)
    idle_past(host, svc, 1.0)
    dead = free_port()
    cfg.write_text(cfg.read_text().replace(host.agent_url, f"http://127.0.0.1:{dead}"))
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stdout == ""
    assert "host sim not reclaimed" in r.stderr and "Traceback" not in r.stderr
    # The hint is a line of its own (cron mails this), never an escaped `\x0a` inside one.
    err = r.stderr.splitlines()
    assert err[0].startswith("gpuctl: host sim not reclaimed: connection refused by"), err
    assert err[1].startswith("  hint: is `gpuctl agent` running"), err
    assert "\\x0a" not in r.stderr
    code, out = reclaim_json(cfg)
    assert code == 4 and out["hosts"][0]["ok"] is False and out["hosts"][0]["error"]
    assert len(server_pids(svc)) == 1


def test_a_server_gpuctl_did_not_start_is_left_alone(host: SimHost, svc: str) -> None:
    port = free_port()
    foreign = host.model_server(svc, "10GiB", "0.2s", port)
    try:
        wait_until("the foreign server", lambda: _healthy(port))
        cfg = host.write_config(
            service_toml(svc, port, model_server_command(svc, port), extra='idle_timeout = "1s"\n')
        )
        # ensure finds it healthy and marks it used; its record names no server of ours.
        assert gpuctl(cfg, "ensure", svc, "--json").returncode == 0
        idle_past(host, svc, 1.0)
        code, out = reclaim_json(cfg)
        c = candidate(out, svc)
        assert code == 0 and c["action"] == "keep" and not c["done"], c
        assert gpuctl_in_process(cfg, "reclaim").returncode == 0
        assert foreign.poll() is None
    finally:
        host.stop(foreign)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_stop_sleep_puts_it_to_sleep_and_ensure_wakes_it(host: SimHost, svc: str) -> None:
    port = free_port()
    cmd = model_server_command(svc, port, memory="20GiB", load_time="0.5s") + " --enable-sleep-mode"
    cfg = started(host, svc, cmd=cmd, port=port, extra='stop = "sleep"\nsleep_level = 1\n')
    idle_past(host, svc, 1.0)
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"put to sleep {svc} on sim: idle ")
    assert len(server_pids(svc)) == 1, "asleep, not stopped"
    assert read_record(host, svc)["phase"] == "sleeping"
    assert httpx.get(f"http://127.0.0.1:{port}/is_sleeping").json() == {"is_sleeping": True}
    assert gpuctl_in_process(cfg, "reclaim").stdout == "", "a sleeping server is left to sleep"
    woke = json.loads(gpuctl(cfg, "ensure", svc, "--json").stdout)
    assert woke["outcome"] == "ready"
    assert httpx.get(f"http://127.0.0.1:{port}/is_sleeping").json() == {"is_sleeping": False}
    assert read_record(host, svc)["phase"] == "running"


def _ollama_chat(host: SimHost, srv: SimOllama) -> Path:
    """A config whose ``chat`` is ``srv``'s qwen3:32b (a 1 s idle timeout), ensured."""
    toml = (
        '[services.chat]\nhost = "sim"\nlauncher = "ollama"\nmodel = "qwen3:32b"\n'
        'memory = "20GiB"\nidle_timeout = "1s"\nstop_timeout = "1s"\n'
    )
    cfg = host.write_config(toml)
    cfg.write_text(cfg.read_text().replace("[hosts.sim]\n", f'[hosts.sim]\nollama = "{srv.url}"\n'))
    assert gpuctl(cfg, "ensure", "chat", "--json").returncode == 0
    return cfg


def test_ollama_models_are_unloaded_and_a_failed_unload_is_exit_1(
    host: SimHost, tmp_path: Path, closing: Closing
) -> None:
    srv = SimOllama(host.sim_dir, tmp_path, "-m", "qwen3:32b=20GiB", "--load-time", "0s",
                    "--token-delay", "50ms")  # fmt: skip
    try:
        cfg = _ollama_chat(host, srv)
        assert "qwen3:32b" in srv.ps()
        # A request straight to Ollama, which gpuctl cannot see (Ollama has no metric
        # of requests in flight): the unload waits for it, past stop_timeout: exit 1.
        import ollama

        client = closing(ollama.Client(host=srv.url))
        busy = threading.Event()

        def talk() -> None:
            for _ in client.generate(model="qwen3:32b", prompt="x", stream=True,
                                     options={"num_predict": 80}):  # fmt: skip
                busy.set()

        t = threading.Thread(target=talk)
        t.start()
        assert busy.wait(10)
        idle_past(host, "chat", 1.0)
        r = gpuctl_in_process(cfg, "reclaim")
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stdout.startswith("failed to unload chat on sim: Ollama still has qwen3:32b")
        t.join(30)
        client.close()
        idle_past(host, "chat", 1.0)
        r = gpuctl_in_process(cfg, "reclaim")
        assert r.returncode == 0 and r.stdout.startswith("unloaded chat on sim: idle ")
        assert srv.ps() == {}
        assert claims_mib(host.sim_dir) == {}
    finally:
        srv.kill()


def test_an_ollama_model_is_kept_while_a_lingering_entry_stands(
    host: SimHost, tmp_path: Path
) -> None:
    """Reclaim keeps a service whose in-flight entry lingers (its holder may send it a
    request without counting it first), an Ollama model too: Ollama's lack of an
    in-flight metric does not make the store's lingering entries go unread."""
    srv = SimOllama(host.sim_dir, tmp_path, "-m", "qwen3:32b=20GiB", "--load-time", "0s")
    try:
        cfg = _ollama_chat(host, srv)
        store = DirectStore(host.state_dir)
        h = holder_here("in_use")  # this process: alive while the test runs
        assert store.inflight_begin("chat", h, 30)[0]
        store.inflight_end("chat", h.id, 30.0)  # as in_use.aexit_lingering(30) leaves it
        assert "chat" in store.lingering()
        idle_past(host, "chat", 1.0)
        r = gpuctl_in_process(cfg, "reclaim")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "lingering in-flight entry" in r.stdout, r.stdout
        assert read_record(host, "chat")["phase"] == "running", r.stdout
    finally:
        srv.kill()
