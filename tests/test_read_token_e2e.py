"""A host configured with only the agent's read-only token (``read_token_file``) reads
(``status``, ``locks``) and is refused every write (``ensure``, ``touch``, ``stop``) with
one located line and a hint, exit 4 like every token the agent refuses; through the
installed ``gpuctl`` against a real agent started with ``--read-token-file``."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import kill_servers, model_server_command, server_pids, unique_name

REFUSED = "refused a write with the read-only token (HTTP 403)"


@pytest.fixture
def read_only_host(tmp_path: Path) -> Iterator[tuple[SimHost, Path]]:
    read_token = secrets.token_urlsafe(16)
    token_file = tmp_path / "read.token"
    token_file.write_text(read_token + "\n")
    token_file.chmod(0o600)
    with SimHost(root=tmp_path / "simhost") as host:
        host.start_agent(args=["--read-token-file", str(token_file)])
        yield host, token_file


def _gpuctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUCTL_CONFIG": str(config)}
    env.pop("GPUCTL_DEBUG", None)
    return subprocess.run(
        [gpuctl_exe(), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.e2e
def test_a_read_only_host_reads_and_is_refused_every_write(
    read_only_host: tuple[SimHost, Path], tmp_path: Path
) -> None:
    host, token_file = read_only_host
    name = unique_name("ro")
    port = free_port()
    service = (
        f"[services.{name}]\n"
        'launcher = "process"\n'
        f"command = {json.dumps(model_server_command(name, port, load_time='1s'))}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f'match = ["{name}"]\nmemory = "20GiB"\nhealth_timeout = "60s"\n'
    )
    writer = host.write_config(service)  # the write token, for the setup and the control
    reader = tmp_path / "reader.toml"
    reader.write_text(
        f'[hosts.sim]\nagent = "{host.agent_url}"\nread_token_file = "{token_file}"\n\n{service}'
    )
    try:
        r = _gpuctl(writer, "ensure", name, "--no-wait", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(server_pids(name)) == 1

        # Reads: status sees the server the writer started, locks lists its record.
        r = _gpuctl(reader, "status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        obj = json.loads(r.stdout)
        assert obj["hosts"][0]["ok"] is True
        (svc,) = obj["services"]
        assert svc["decision"] in ("LOADING", "READY"), svc
        r = _gpuctl(reader, "locks", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert name in r.stdout

        # Writes: refused by the agent (403), said in one line and a hint; nothing done.
        for args in (["touch", name], ["stop", name], ["ensure", name, "--no-wait"]):
            r = _gpuctl(reader, *args)
            assert r.returncode == 4, (args, r.stdout, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert any(REFUSED in line for line in lines), (args, r.stderr)
            assert any("hint:" in line and "token_file" in line for line in lines), r.stderr
            assert "Traceback" not in r.stderr
            assert len(server_pids(name)) == 1, args  # the stop did not stop it
        r = _gpuctl(reader, "ensure", name, "--json")
        assert r.returncode == 4
        obj = json.loads(r.stdout)
        assert obj["exit_code"] == 4 and REFUSED in obj["reason"] and obj["launched"] is False

        # The control: the write token may do what the read token may not.
        r = _gpuctl(writer, "stop", name)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        kill_servers(name)
