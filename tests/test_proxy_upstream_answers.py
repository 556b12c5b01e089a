"""What an upstream answers, through the real ``gpuctl proxy``: large bodies (with a
length and chunked), an oversized answer head, and headers named in ``Connection``.

The upstream is a loopback HTTP server that this file scripts: ``/v1/embeddings``
answers an embedding of as many bytes as its input asks, ``/big/<n>`` ``n`` bytes
(``?chunked=1``: chunked), and it records the headers each request brought.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import openai
import pytest

from gpuctl.sim.host import free_port
from tests.conftest import Closing
from tests.proxy_helpers import Proxy, proxy_fronting

MODEL = "big-model"
UNIT = b"0.125,"  # one float of an embedding, as JSON


def pattern(size: int) -> bytes:
    unit = bytes(range(256)) * 64
    return (unit * (size // len(unit) + 1))[:size]


def embedding_answer(size: int) -> bytes:
    """An OpenAI embeddings answer of about ``size`` bytes (``size // 6`` floats)."""
    floats = (UNIT * (size // len(UNIT)))[:-1]
    return (
        b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":['
        + floats
        + b'],}],"model":"big-model","usage":{"prompt_tokens":1,"total_tokens":1}}'
    ).replace(b"],}]", b"]}]")


@dataclass
class Upstream:
    port: int = field(default_factory=free_port)
    seen: list[dict[str, str]] = field(default_factory=list)  # each request's headers
    cut: threading.Event = field(default_factory=threading.Event)  # /many-headers cut off

    def serve(self) -> ThreadingHTTPServer:
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: bytes, extra: list[tuple[str, str]]) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                for k, v in extra:
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                u = urlsplit(self.path)
                if u.path == "/health":
                    self._answer(200, b"{}", [])
                    return
                up.seen.append({k.lower(): v for k, v in self.headers.items()})
                if u.path == "/v1/embeddings":
                    size = int(json.loads(body)["input"])
                    self._answer(200, embedding_answer(size), [])
                elif u.path.startswith("/big/"):
                    size = int(u.path[5:])
                    data = pattern(size)
                    if parse_qs(u.query).get("chunked"):
                        self.send_response(200)
                        self.send_header("content-type", "application/octet-stream")
                        self.send_header("transfer-encoding", "chunked")
                        self.end_headers()
                        for i in range(0, size, 100_000):
                            piece = data[i : i + 100_000]
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        self._answer(200, data, [])
                elif u.path == "/many-headers":
                    # 200,000 headers of about 1 KB, as the reviewer's upstream sent
                    try:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n")
                        line = b"x-filler-%06d: " + b"v" * 1000 + b"\r\n"
                        for i in range(200_000):
                            self.wfile.write(line % i)
                        self.wfile.write(b"\r\n{}")
                        self.wfile.flush()
                    except OSError:
                        up.cut.set()  # the proxy dropped the connection
                    self.close_connection = True
                elif u.path == "/connection-named":
                    self._answer(
                        200,
                        b'{"ok":true}',
                        [("connection", "close, x-secret"), ("x-secret", "1"), ("x-kept", "1")],
                    )
                    self.close_connection = True
                else:
                    self._answer(404, b"{}", [])

            do_GET = do_POST = _any

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@dataclass
class Setup:
    proxy: Proxy
    upstream: Upstream


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base: Path = tmp_path_factory.mktemp("answers")
    up = Upstream()
    server = up.serve()
    try:
        with proxy_fronting(base, "bigsvc", up.port, MODEL) as proxy:
            yield Setup(proxy, up)
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------- large answers


@pytest.mark.slow
@pytest.mark.parametrize("size", [2**20, 20 * 2**20], ids=["1MiB", "20MiB"])
def test_a_large_embeddings_answer_arrives_whole_through_the_openai_client(
    setup: Setup, size: int, closing: Closing
) -> None:
    # It used to stop at the proxy's upstream high-water mark (256 KiB) until the
    # read timeout (600 s): the client's 60 s ran out first.
    client = closing(
        openai.OpenAI(base_url=setup.proxy.v1, api_key="none", timeout=60, max_retries=0)
    )
    got = client.embeddings.create(model=MODEL, input=str(size))
    assert len(got.data) == 1
    assert len(got.data[0].embedding) == size // len(UNIT)
    assert set(got.data[0].embedding) == {0.125}


@pytest.mark.parametrize("size", [2**20, 20 * 2**20], ids=["1MiB", "20MiB"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_large_service_answer_arrives_whole(setup: Setup, size: int, chunked: bool) -> None:
    url = f"{setup.proxy.url}/services/bigsvc/big/{size}" + ("?chunked=1" if chunked else "")
    with httpx.Client(timeout=60) as c:
        for _ in range(2):  # and the proxy's upstream connection serves the next one
            r = c.get(url)
            assert r.status_code == 200
            if chunked:
                assert "content-length" not in r.headers
            else:
                assert r.headers["content-length"] == str(size)
            assert hashlib.sha256(r.content).digest() == hashlib.sha256(pattern(size)).digest()


# --------------------------------------------------------------------- the answer head


def test_an_answer_head_over_64_kib_is_a_502_naming_the_service(setup: Setup) -> None:
    # 200,000 headers of ~1 KB were read, kept and forwarded (the proxy grew by 250 MB).
    with httpx.Client(timeout=60) as c:
        r = c.get(f"{setup.proxy.url}/services/bigsvc/many-headers")
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "upstream_error"
        assert "bigsvc's server failed" in err["message"]
        assert "an answer head over 64 KiB" in err["message"]
        assert "x-filler" not in r.text and len(r.headers) < 10
        assert setup.upstream.cut.wait(30)  # the proxy dropped the upstream connection
        # and it goes on serving
        assert c.get(f"{setup.proxy.url}/services/bigsvc/big/10").content == pattern(10)


# --------------------------------------------------------------------- Connection: names


def test_headers_named_in_connection_are_not_forwarded_either_way(setup: Setup) -> None:
    c = http.client.HTTPConnection("127.0.0.1", setup.proxy.port, timeout=60)
    try:
        c.putrequest("GET", "/services/bigsvc/connection-named", skip_accept_encoding=True)
        for k, v in [
            ("Connection", "x-drop-me"),
            ("Connection", " X-Also-Dropped , keep-alive"),  # several, any case, spaces
            ("x-drop-me", "1"),
            ("X-Also-Dropped", "1"),
            ("x-kept-request", "1"),
        ]:
            c.putheader(k, v)
        c.endheaders()
        r = c.getresponse()
        r.read()
        got = {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()
    assert r.status == 200
    # the request side: what reached the upstream
    seen = setup.upstream.seen[-1]
    assert seen.get("x-kept-request") == "1"
    assert "x-drop-me" not in seen and "x-also-dropped" not in seen
    # the answer side: the upstream said "connection: close, x-secret"
    assert got.get("x-kept") == "1"
    assert "x-secret" not in got
