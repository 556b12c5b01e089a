"""A client that leaves before its answer came cancels the upstream request, whatever
the answer's phase: before its head, or while a small answer (read whole) is still
arriving; and, for the record, HEAD / 304 answers keep their framing.

Through the real ``gpuctl proxy`` (its agent on loopback) to an upstream on a raw
socket that this file scripts: ``/nohead`` reads the request and never answers;
``/smallstall`` sends a head with ``Content-Length: 100`` and 10 bytes, then waits.
Each notes when the proxy closes its connection, which is how an OpenAI-compatible
server (vLLM) learns to abort the request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.proxy_helpers import Proxy, proxy_fronting, serve_raw
from tests.test_proxy import wait_until

SERVICE = "gonesvc"


@dataclass
class Upstream:
    asked: dict[str, threading.Event] = field(default_factory=dict)  # the request came
    closed: dict[str, threading.Event] = field(default_factory=dict)  # the proxy hung up
    port: int = 0

    def start(self) -> socket.socket:
        srv, self.port = serve_raw(self._serve)
        return srv

    def events(self, path: str) -> tuple[threading.Event, threading.Event]:
        self.asked[path], self.closed[path] = threading.Event(), threading.Event()
        return self.asked[path], self.closed[path]

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                request_line = buf.split(b"\r\n", 1)[0].decode()
                path = request_line.split(" ")[1]
                if path == "/health":
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
                    )
                    return
                if path == "/head":
                    # A HEAD's length is the GET's, with no body after it.
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                    return
                if path == "/notmod":
                    conn.sendall(b'HTTP/1.1 304 Not Modified\r\netag: "x"\r\n\r\n')
                    return
                self.asked[path].set()
                if path == "/smallstall":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                # Then nothing: wait for the proxy to hang up (or the test to end).
                conn.settimeout(60)
                while conn.recv(65536):
                    pass
                self.closed[path].set()
            except OSError:
                if path in self.closed:
                    self.closed[path].set()


@dataclass
class Setup:
    proxy: Proxy
    upstream: Upstream


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base: Path = tmp_path_factory.mktemp("gone")
    up = Upstream()
    srv = up.start()
    try:
        with proxy_fronting(base, SERVICE, up.port, "gone-model") as proxy:
            yield Setup(proxy, up)
    finally:
        srv.close()


@pytest.mark.parametrize("path", ["/nohead", "/smallstall"])
def test_a_client_that_leaves_cancels_the_upstream_request(setup: Setup, path: str) -> None:
    asked, closed = setup.upstream.events(path)
    client = socket.create_connection(("127.0.0.1", setup.proxy.port))
    client.sendall(f"GET /services/{SERVICE}{path} HTTP/1.1\r\nhost: proxy\r\n\r\n".encode())
    assert asked.wait(30), "the request never reached the upstream"
    wait_until(
        "the request in flight",
        lambda: setup.proxy.metric("gpuctl_proxy_requests_in_flight", SERVICE) == 1,
    )
    left = time.monotonic()
    client.close()
    # It was left to the upstream's answer (the read timeout: ten minutes).
    assert closed.wait(30), "the proxy kept the upstream request after its client left"
    assert time.monotonic() - left < 30
    wait_until(
        "the request off the in-flight count",
        lambda: setup.proxy.metric("gpuctl_proxy_requests_in_flight", SERVICE) == 0,
    )
    wait_until(
        "its access line",
        lambda: f'"GET /services/{SERVICE}{path}" 499' in setup.proxy.log(),
    )
    line = next(x for x in setup.proxy.log().splitlines() if f'/services/{SERVICE}{path}" 499' in x)
    assert "client-gone" in line, line
    assert "Traceback" not in setup.proxy.log()


def test_head_and_304_keep_their_framing(setup: Setup) -> None:
    r = httpx.head(f"{setup.proxy.url}/services/{SERVICE}/head", timeout=30)
    assert r.status_code == 200 and r.headers["content-length"] == "1000", r.headers
    r = httpx.get(f"{setup.proxy.url}/services/{SERVICE}/notmod", timeout=30)
    assert r.status_code == 304 and "content-length" not in r.headers, r.headers
    assert r.headers["etag"] == '"x"'
