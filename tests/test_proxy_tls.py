"""A service whose server speaks https, through the real ``gpuctl proxy``: its
certificate is verified, against the CA bundle that ``SSL_CERT_FILE`` names.

The upstream is a loopback HTTPS server with a certificate made for the test (``openssl
req``: self-signed, for 127.0.0.1), answering an OpenAI chat completion (streamed or
not) and echoing the path of anything else; it records every request that reached it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.proxy_helpers import Proxy

MODEL = "tls-model"
MSG = [{"role": "user", "content": "hello"}]


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def completion(stream: bool) -> tuple[str, bytes]:
    if stream:
        chunks = [
            {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            for word in ("over", " tls")
        ]  # fmt: skip
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        return "text/event-stream", body + b"data: [DONE]\n\n"
    reply = {
        "id": "c1", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "over tls"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }  # fmt: skip
    return "application/json", json.dumps(reply).encode()


@dataclass
class TlsUpstream:
    cert: Path
    key: Path
    port: int = 0
    seen: list[str] = field(default_factory=list)  # paths of requests (not /health)

    def serve(self) -> ThreadingHTTPServer:
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/health":
                    up.seen.append(self.path)
                if self.path == "/v1/chat/completions":
                    ctype, out = completion(bool(json.loads(body).get("stream")))
                else:
                    ctype, out = "application/json", json.dumps({"path": self.path}).encode()
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = _any

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@dataclass
class Setup:
    host: SimHost
    upstream: TlsUpstream
    conf: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base: Path = tmp_path_factory.mktemp("tls")
    up = TlsUpstream(*make_certificate(base))
    server = up.serve()
    with SimHost(gpu_memory="100GiB", root=base / "simhost") as host:
        host.start_agent()
        conf = host.write_config(
            f'[services.tlssvc]\nhealth = "https://127.0.0.1:{up.port}/health"\n'
            f'models = ["{MODEL}"]\n'
        )
        try:
            yield Setup(host, up, conf)
        finally:
            server.shutdown()
            server.server_close()


def test_an_https_upstream_is_served_with_its_certificate_verified(setup: Setup) -> None:
    proxy = Proxy(
        setup.host, setup.conf, name="proxy-ca", env={"SSL_CERT_FILE": str(setup.upstream.cert)}
    )
    try:
        before = len(setup.upstream.seen)
        with openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=60) as client:
            reply = client.chat.completions.create(model=MODEL, messages=MSG)  # type: ignore[arg-type]
            assert reply.choices[0].message.content == "over tls"
            stream = client.chat.completions.create(model=MODEL, messages=MSG, stream=True)  # type: ignore[arg-type]
            assert "".join(c.choices[0].delta.content or "" for c in stream) == "over tls"
        r = httpx.get(f"{proxy.url}/services/tlssvc/any/path?q=1", timeout=30)
        assert r.status_code == 200 and r.json() == {"path": "/any/path?q=1"}
        assert setup.upstream.seen[before:] == [
            "/v1/chat/completions",
            "/v1/chat/completions",
            "/any/path?q=1",
        ]
        # Found ready by its health check (over TLS, verified the same way), never
        # through the ensure flow: its health check used to ignore SSL_CERT_FILE.
        assert proxy.metric("gpuctl_proxy_cold_starts_total", "tlssvc") == 0
    finally:
        proxy.stop()


def test_an_https_upstream_whose_certificate_is_not_trusted_is_never_sent_a_request(
    setup: Setup,
) -> None:
    other = setup.upstream.cert.parent / "other"
    other.mkdir(exist_ok=True)
    other_ca, _ = make_certificate(other)  # a CA bundle, but not the one that signed it
    proxy = Proxy(setup.host, setup.conf, name="proxy-noca", env={"SSL_CERT_FILE": str(other_ca)})
    try:
        before = len(setup.upstream.seen)
        r = httpx.post(
            proxy.v1 + "/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=60
        )
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "upstream_untrusted" and err["type"] == "upstream_error", err
        assert f"tlssvc's server at https://127.0.0.1:{setup.upstream.port}" in err["message"]
        assert "certificate is not trusted" in err["message"]
        assert "SSL_CERT_FILE" in err["message"]
        assert setup.upstream.seen[before:] == []
        assert "Traceback" not in proxy.log()
    finally:
        proxy.stop()


def test_the_upstream_client_refuses_an_untrusted_certificate_before_sending(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The requests' own client (h1), where the health check is not https or passed.
    from gpuctl.proxy import h1

    other_ca, _ = make_certificate(tmp_path)
    origin = f"https://127.0.0.1:{setup.upstream.port}"

    async def ask(ca: Path) -> int:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        h1.tls_context.cache_clear()
        c = h1.Client(10, 10)
        try:
            r = await c.pool(origin).request("GET", b"/h1", [], b"", idempotent=True)
            await r.read()
            r.aclose()
            return r.status
        finally:
            c.close()

    before = len(setup.upstream.seen)
    try:
        with pytest.raises(h1.UpstreamUntrusted, match="certificate is not trusted"):
            asyncio.run(ask(other_ca))
        assert setup.upstream.seen[before:] == []
        assert asyncio.run(ask(setup.upstream.cert)) == 200
        assert setup.upstream.seen[before:] == ["/h1"]
    finally:
        h1.tls_context.cache_clear()


def test_a_ca_bundle_that_cannot_be_loaded_stops_the_proxy_at_start(
    setup: Setup, tmp_path: Path
) -> None:
    bad = tmp_path / "not-a-bundle.pem"
    bad.write_text("not a certificate\n")
    for path in (bad, tmp_path / "missing.pem"):
        env = {**setup.host.env(), "GPUCTL_CONFIG": str(setup.conf), "SSL_CERT_FILE": str(path)}
        env.pop("GPUCTL_DEBUG", None)
        r = subprocess.run(
            [gpuctl_exe(), "proxy", "--listen", f"127.0.0.1:{free_port()}"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "cannot load the CA certificates" in r.stderr and "SSL_CERT_FILE" in r.stderr
        assert "Traceback" not in r.stderr
