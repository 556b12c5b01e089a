"""``gpuctl proxy`` as a real process on a simulated host, for the proxy tests and benches."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from gpuctl.sim.host import SimHost, free_port


class Proxy:
    """``gpuctl proxy --listen 127.0.0.1:<free port>`` with ``config``, in its own session."""

    def __init__(
        self,
        host: SimHost,
        config: Path,
        *args: str,
        name: str = "proxy",
        env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> None:
        self.host = host
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] = host.spawn(
            ["proxy", "--listen", f"127.0.0.1:{self.port}", *args],
            name,
            {"GPUCTL_CONFIG": str(config), **(env or {})},
            nofile,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the proxy exited: {host.log_tail(name, 20)}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the proxy did not start: {host.log_tail(name, 20)}")
            time.sleep(0.1)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return (self.host.base / f"{self.name}.log").read_text(errors="replace")

    def metric(self, name: str, service: str) -> float:
        """One sample of the proxy's /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(rf'^{re.escape(name)}\{{service="{re.escape(service)}"\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.host.stop(self.proc)


def sim_metric(port: int, name: str) -> float:
    """A sample of a simulated model server's /metrics (summed over labels)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )


def serve_raw(serve: Callable[[socket.socket], None]) -> tuple[socket.socket, int]:
    """A loopback listener whose every connection goes to ``serve(conn)`` in a thread of
    its own: the scripted upstreams of the wire tests. Close the socket to stop it."""
    srv = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1]


@contextlib.contextmanager
def proxy_fronting(base: Path, service: str, port: int, model: str) -> Iterator[Proxy]:
    """``gpuctl proxy`` (a sim host's agent beside it) fronting one service: the server
    on loopback ``port``, its health at ``/health``, serving ``model``."""
    with SimHost(gpu_memory="100GiB", root=base / "simhost") as host:
        host.start_agent()
        conf = host.write_config(
            f'[services.{service}]\nhealth = "http://127.0.0.1:{port}/health"\n'
            f'models = ["{model}"]\n'
        )
        proxy = Proxy(host, conf)
        try:
            yield proxy
        finally:
            proxy.stop()
