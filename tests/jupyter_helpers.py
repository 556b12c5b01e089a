"""A real ``jupyter server`` on loopback for the Jupyter launcher's tests.

``jupyter_server(root)`` starts one in its own session and process group (so it does
not inherit an ignored SIGINT from a non-interactive parent), isolated from the user's
Jupyter config, data and runtime dirs, and kills the whole group on exit.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpuctl.sim.host import free_port


@dataclass(frozen=True)
class JupyterServer:
    url: str
    token: str
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's process group; wait for the server itself to exit."""
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _jupyter_command() -> list[str]:
    script = Path(sys.executable).with_name("jupyter-server")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "jupyter_server"]


@contextmanager
def jupyter_server(
    root: Path,
    *extra_args: str,
    token: str | None = None,
    timeout_s: float = 30.0,
) -> Iterator[JupyterServer]:
    """Start ``jupyter server`` serving ``root``; yield it once ``/api/status`` answers 200.

    Its home, config, data and runtime dirs live next to ``root`` (in ``<root>.jupyter``),
    and its working directory is that folder, not ``root``: a terminal's default
    directory is then not root_dir, as with a server started by systemd.
    """
    root.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_hex(16)
    port = free_port()
    home = root.with_name(root.name + ".jupyter") / f"p{port}"
    for sub in ("home", "config", "data", "runtime"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        HOME=str(home / "home"),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTER_PLATFORM_DIRS="1",
        IPYTHONDIR=str(home / "ipython"),
        XDG_CONFIG_HOME=str(home / "xdg-config"),
        XDG_DATA_HOME=str(home / "xdg-data"),
        XDG_STATE_HOME=str(home / "xdg-state"),
        SHELL="/bin/bash",
        TERM="xterm",
    )
    for var in ("JUPYTER_TOKEN", "JUPYTER_PATH", "JUPYTER_PREFER_ENV_PATH"):
        env.pop(var, None)
    log = home / "jupyter.log"
    args = [
        *_jupyter_command(),
        f"--IdentityProvider.token={token}",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--allow-root",
        f"--ServerApp.root_dir={root}",
        *extra_args,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            args,
            cwd=home,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = JupyterServer(f"http://127.0.0.1:{port}", token, root, proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited early:\n{server.log_text()[-3000:]}")
            try:
                r = httpx.get(
                    f"{server.url}/api/status",
                    headers={"Authorization": f"token {token}"},
                    timeout=2,
                )
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"jupyter server not up in {timeout_s}s:\n{server.log_text()[-3000:]}"
                )
            time.sleep(0.2)
        yield server
    finally:
        server.kill(signal.SIGTERM)
