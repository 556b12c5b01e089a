"""Helpers for the ensure tests: a simulated host, configs, and counting launches."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import config_env, gpuctl_exe


def agent_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_memory: str | None = None
) -> Iterator[SimHost]:
    """A simulated host with its agent, the environment pointed at it; for a fixture's
    ``yield from``. The API's per-process caches are reset around it."""
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    extra: dict[str, Any] = {}
    if gpu_memory is not None:
        monkeypatch.setenv("GPUCTL_SIM_GPU_MEMORY", gpu_memory)
        extra["gpu_memory"] = gpu_memory
    api._reset_for_tests()
    with SimHost(root=tmp_path / "simhost", **extra) as h:
        h.start_agent()
        yield h
    api._reset_for_tests()


def unique_name(prefix: str = "llm") -> str:
    """A service name no stray process on this machine carries in its command line."""
    return f"{prefix}{secrets.token_hex(4)}"


def model_server_command(name: str, port: int, memory: str = "20GiB", load_time: str = "5s") -> str:
    return (
        f"{sys.executable} -m gpuctl sim model-server --name {name} --memory {memory} "
        f"--load-time {load_time} --port {port}"
    )


def service_toml(
    name: str, port: int, command: str, *, launcher: str = "process", extra: str = ""
) -> str:
    return (
        f"[services.{name}]\n"
        f'launcher = "{launcher}"\n'
        f"command = {json.dumps(command)}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f'match = ["{name}"]\n'
        f'memory = "20GiB"\n'
        f'health_timeout = "60s"\n'
        f"{extra}\n"
    )


def priced_service(name: str, port: int, gib: int, priority: int, extra: str = "") -> str:
    """A sim model server service of ``gib`` GiB at ``priority`` (a 1 s load)."""
    toml = service_toml(
        name, port, model_server_command(name, port, f"{gib}GiB", "1s"), extra=extra
    )
    return toml.replace('memory = "20GiB"', f'memory = "{gib}GiB"\npriority = {priority}')


def direct_config(host: SimHost, services_toml: str) -> Path:
    """A config for the same simulated host without its agent (the direct store path)."""
    path = host.base / "direct.toml"
    path.write_text(f'[hosts.sim]\nprobe = "sim"\nsim_dir = "{host.sim_dir}"\n\n{services_toml}')
    return path


def run_ensure(
    config: Path, name: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [gpuctl_exe(), "ensure", name, "--json", *args],
        env=cli_env(config),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def spawn_ensure(config: Path, name: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [gpuctl_exe(), "ensure", name, "--json", *args],
        env=cli_env(config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cli_env(config: Path) -> dict[str, str]:
    return config_env(config)


def sim_claims(host: SimHost, name: str) -> list[int]:
    """Pids of the live simulated-GPU claims named ``name``: one per running server."""
    from gpuctl.sim.gpu import SimGpu

    return [c.pid for c in SimGpu(host.sim_dir).claims() if c.name == name]


def launches_in_log(log: Path) -> int:
    """How many times the process launcher started the server (its log marks each start)."""
    try:
        return log.read_text().count("--- gpuctl: starting")
    except FileNotFoundError:
        return 0


def read_record(host: SimHost, name: str) -> dict[str, Any]:
    return json.loads((host.state_dir / "records" / f"{name}.json").read_text())  # type: ignore[no-any-return]


def plant_record(path: Path, data: dict[str, Any]) -> None:
    """Write a record file as the store does, whole or not at all (a temporary file, then
    a rename): the running agent reads records while a test plants one, and a torn file
    it met half-written would be set aside as unreadable, which is not the test's case."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def server_pids(name: str) -> list[int]:
    """Pids of live (non-zombie) processes that are the model server ``name``."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        argv: Sequence[str] = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and "model-server" in argv and name in argv:
            out.append(p.info["pid"])
    return out


def kill_servers(name: str) -> None:
    import signal

    for pid in server_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


__all__ = ["free_port"]


def ensure_paused_at(
    config: Path, name: str, failpoint: str = "ensure.after_spawn", *args: str
) -> subprocess.Popen[str]:
    """``gpuctl ensure NAME`` stopped at ``failpoint`` (see ``gpuctl.failpoints``): it
    returns once the caller sits in that window, for the test to kill it there."""
    env = cli_env(config)
    env["GPUCTL_FAILPOINTS"] = f"{failpoint}=pause"
    p = subprocess.Popen(
        [gpuctl_exe(), "ensure", name, "--json", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    seen = []
    for line in p.stderr:
        if line.startswith(f"gpuctl failpoint {failpoint}: pause"):
            return p
        seen.append(line)
    out = p.stdout.read() if p.stdout else ""
    raise AssertionError(f"never reached {failpoint} (exit {p.wait()}): {out} {''.join(seen)}")


def end_in_window(p: subprocess.Popen[str], sig: int) -> None:
    """Send ``sig`` (SIGKILL, or SIGINT as Ctrl-C) to a caller paused at a failpoint."""
    import signal as _signal

    p.send_signal(sig)
    p.wait(timeout=60)
    if sig == _signal.SIGKILL:
        assert p.returncode == -_signal.SIGKILL
    p.communicate()


def big_service(name: str, port: int, server_name: str, load_time: str = "6s") -> str:
    """An 80 GiB service whose server's command line does not carry the service's
    keyword (only its record or its start nonce tell it is the service's)."""
    toml = service_toml(name, port, model_server_command(server_name, port, "80GiB", load_time))
    return toml.replace('memory = "20GiB"', 'memory = "80GiB"')


class LoopbackHealth:
    """A health endpoint for a loopback ASGI server: answers ``status`` (200 unless
    told otherwise; a loading model server says 503) and counts what it is asked."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        self.requests += 1
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok" if self.status == 200 else b""})
