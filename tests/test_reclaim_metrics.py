"""``gpuctl reclaim`` against metrics pages that say nothing about the requests in flight:
the real CLI, a real agent, a real server on the simulated GPU, and a loopback HTTP server
serving the hostile ``/metrics`` page. A server whose requests cannot be counted is kept,
and the reason says so; the metrics URL's password is never printed."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.sim.host import SimHost
from tests.conftest import gpuctl_in_process
from tests.ensure_helpers import kill_servers, server_pids, unique_name
from tests.test_reclaim import candidate, idle_past, reclaim_json, started


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimHost]:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "simhost" / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "simhost" / "sim"))
    with SimHost(root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


@pytest.fixture
def svc() -> Iterator[str]:
    name = unique_name("idle")
    yield name
    kill_servers(name)


PAGES = {
    "sglang only": "sglang:num_running_reqs 0.0\nsglang:num_queue_reqs 0.0\n",
    "waiting only": 'vllm:num_requests_waiting{model_name="m"} 0.0\n',
    "running only": 'vllm:num_requests_running{model_name="m"} 0.0\n',
    "underscore spelling": "vllm_num_requests_running 0.0\nvllm_num_requests_waiting 0.0\n",
    "empty page": "",
    "fractional": "vllm:num_requests_running 0.5\nvllm:num_requests_waiting 0.0\n",
}


@pytest.fixture
def page() -> Iterator[tuple[list[str], int]]:
    """A loopback server answering 200 with ``body[0]`` on every GET."""
    body = [""]

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield body, srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
def test_metrics_without_both_vllm_gauges_keep_the_server(
    host: SimHost, svc: str, page: tuple[list[str], int]
) -> None:
    body, port = page
    metrics = f"http://alice:S3CRETPW@127.0.0.1:{port}/metrics"
    cfg = started(host, svc, extra=f'metrics = "{metrics}"')
    idle_past(host, svc, 1.0)
    for what, text in PAGES.items():
        body[0] = text
        _code, out = reclaim_json(cfg)
        c = candidate(out, svc)
        assert c["action"] == "keep", (what, c)
        assert c["reason"].startswith("cannot tell whether requests are in flight"), (what, c)
        assert "S3CRETPW" not in c["reason"] and "alice:***@" in c["reason"], (what, c)
        assert len(server_pids(svc)) == 1, f"{what}: the server was stopped"
        r = gpuctl_in_process(cfg, "reclaim")
        assert "S3CRETPW" not in r.stdout + r.stderr, what
        assert len(server_pids(svc)) == 1, f"{what}: the server was stopped"
    # The same server with both gauges at zero: now it is known idle, and it goes.
    body[0] = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0\n"
    r = gpuctl_in_process(cfg, "reclaim")
    assert r.returncode == 0 and r.stdout.startswith(f"stopped {svc} on sim"), r.stdout + r.stderr
    assert server_pids(svc) == []
