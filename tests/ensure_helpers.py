"""Helpers for the ensure tests: a simulated host, configs, and counting launches."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe


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
    env = dict(os.environ)
    env["GPUCTL_CONFIG"] = str(config)
    env.pop("GPUCTL_DEBUG", None)
    return env


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
