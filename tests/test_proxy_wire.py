"""Hostile input on ``gpuctl proxy``'s own wire, and its refusals end to end.

One real proxy process (with client keys and a 1 MiB ``max_body``) on a simulated host
fronts a simulated model server and a *witness*: a loopback HTTP server that records
every request that reaches it, so "never forwarded" is seen, not inferred. Requests go
out through ``http.client``, which sends a path, duplicate headers and chunked bodies
exactly as written (httpx would tidy the path first). hypothesis draws the requests;
every answer must be the proxy's own OpenAI-shaped refusal with the right status, or
the witness's answer when (and only when) the request should reach it, and the proxy
must keep serving on the same connection.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gpuctl.sim.host import SimHost, free_port
from tests.conftest import gpuctl_exe
from tests.ensure_helpers import cli_env, sim_claims, unique_name
from tests.proxy_helpers import Proxy
from tests.test_proxy import MSG, inflight, svc, wait_until

# Repeatable by default; a deeper or another run by hand:
# GPUCTL_WIRE_EXAMPLES=2000 GPUCTL_WIRE_SEED=7 pytest tests/test_proxy_wire.py -k hostile
EXAMPLES = int(os.environ.get("GPUCTL_WIRE_EXAMPLES", "150"))
SEED = os.environ.get("GPUCTL_WIRE_SEED")
KEY = "sk-wire-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WITNESS_MODEL = "witness-model"
LIMIT = 2**20  # [proxy] max_body = "1MiB"
MODEL_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/audio/transcriptions",
)


# --------------------------------------------------------------------- the witness

# What the witness answers on these paths before it closes the connection.
BROKEN = {
    "/garbage": b"this is not HTTP\r\n\r\n",
    "/silent": b"",
    "/cut-length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b'content-length: 100\r\n\r\n{"partial',
    "/cut-chunked": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b'transfer-encoding: chunked\r\n\r\n5\r\n{"a":\r\n',
    "/cut-sse": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b'transfer-encoding: chunked\r\n\r\n10\r\ndata: {"a": 1}\n\n\r\n',
}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Witness:
    """A loopback upstream that records what the proxy forwards to it."""

    port: int = field(default_factory=free_port)
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)  # for /hold
    holding: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> ThreadingHTTPServer:
        witness = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                if self.path != "/health":  # the proxy's readiness checks
                    witness.seen.append(
                        Seen(
                            self.command,
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                        )
                    )
                if self.path == "/hold":
                    witness.holding.set()
                    witness.release.wait(60)
                if self.path in BROKEN:  # a hostile upstream: see BROKEN
                    self.wfile.write(BROKEN[self.path])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                out = json.dumps({"witness": True, "path": self.path}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@dataclass
class Wire:
    host: SimHost
    proxy: Proxy
    witness: Witness
    model: str  # the simulated model server's name (and model)
    conf: Path


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    base = tmp_path_factory.mktemp("wire")
    witness = Witness()
    server = witness.serve()
    with SimHost(gpu_memory="100GiB", root=base / "simhost") as host:
        host.start_agent()
        name, port = unique_name("pxw"), free_port()
        keys = base / "keys"
        keys.write_text(f"{KEY}\n")
        conf = host.write_config(
            svc(name, port, load="1s")
            + "[services.witness]\n"
            + f'health = "http://127.0.0.1:{witness.port}/health"\n'
            + f'models = ["{WITNESS_MODEL}"]\nmax_concurrent = 1\n\n'
            # its health answers (the witness's), its url refuses: upstream refused
            + "[services.refused]\n"
            + f'url = "http://127.0.0.1:{free_port()}"\n'
            + f'health = "http://127.0.0.1:{witness.port}/health"\n'
            + 'models = ["refused-model"]\n\n'
            + f'[proxy]\nmax_body = "1MiB"\napi_keys_file = "{keys}"\n'
        )
        proxy = Proxy(host, conf)
        try:
            yield Wire(host, proxy, witness, name, conf)
        finally:
            proxy.stop()
            server.shutdown()
            server.server_close()


@pytest.fixture
def opened() -> Iterator[list[http.client.HTTPConnection]]:
    conns: list[http.client.HTTPConnection] = []
    yield conns
    for c in conns:
        c.close()


def conn(w: Wire, opened: list[http.client.HTTPConnection]) -> http.client.HTTPConnection:
    c = http.client.HTTPConnection("127.0.0.1", w.proxy.port, timeout=60)
    opened.append(c)
    return c


def ask(
    c: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: list[tuple[str, str]] | None = None,
    *,
    chunked: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    """One request exactly as written (duplicate headers kept), on connection ``c``."""
    c.putrequest(method, path, skip_accept_encoding=True)
    for k, v in headers if headers is not None else list(AUTH.items()):
        c.putheader(k, v)
    if body is not None and chunked:
        c.putheader("Transfer-Encoding", "chunked")
        c.endheaders()
        for i in range(0, len(body), 65536):
            piece = body[i : i + 65536]
            c.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        c.send(b"0\r\n\r\n")
    else:
        if body is not None:
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
    r = c.getresponse()
    data = r.read()
    if r.will_close:
        c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def assert_refusal(
    status: int, headers: dict[str, str], data: bytes, *expected: int
) -> dict[str, Any]:
    """The proxy's own refusal: an expected status, OpenAI's error object, JSON."""
    assert status in expected, (status, data[:300])
    assert headers.get("content-type") == "application/json", headers
    err = json.loads(data)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and err["code"], err
    assert len(data) < 4096, "a refusal echoes at most a little of what was sent"
    return err  # type: ignore[no-any-return]


def keeps_serving(c: http.client.HTTPConnection) -> None:
    status, _, data = ask(c, "GET", "/v1/models")
    assert status == 200 and WITNESS_MODEL in data.decode()


# --------------------------------------------------------------------- hypothesis

JSON_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# A `model` that names nothing configured: not a string, huge, unicode, path tricks.
BAD_MODELS = (
    st.none()
    | st.integers()
    | st.lists(st.just("witness-model"), max_size=2)
    | st.dictionaries(st.just("model"), st.just(WITNESS_MODEL), max_size=1)
    | st.text(max_size=60).filter(lambda m: m != WITNESS_MODEL)
    | st.sampled_from(
        [
            "../" + WITNESS_MODEL,
            WITNESS_MODEL + "\n",
            WITNESS_MODEL.upper(),
            " " + WITNESS_MODEL,
            WITNESS_MODEL + "\x00",
            "\ud800",
            "/services/witness/x",
            "a" * 300_000,
            "é" * 50_000,
        ]
    )
)


@st.composite
def unroutable_bodies(draw: st.DrawFn) -> bytes:
    """A body that must never reach an upstream: no model the proxy knows."""
    kind = draw(st.sampled_from(["binary", "json", "object", "object-no-model"]))
    if kind == "binary":
        return draw(st.binary(max_size=300))
    if kind == "json":  # JSON that is not an object
        value = draw(JSON.filter(lambda v: not isinstance(v, dict)))
        return json.dumps(value).encode()
    obj = draw(
        st.dictionaries(st.text(max_size=8).filter(lambda k: k != "model"), JSON, max_size=3)
    )
    if kind == "object":
        obj["model"] = draw(BAD_MODELS)
    return json.dumps(obj).encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Attempt:
    method: str
    path: str
    body: bytes | None
    headers: list[tuple[str, str]]
    chunked: bool
    expect: tuple[int, ...]  # the proxy's refusal (never forwarded)


SEGMENT = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%/"),
    min_size=1,
    max_size=12,
).filter(lambda s: s not in (".", ".."))


@st.composite
def attempts(draw: st.DrawFn) -> Attempt:
    kind = draw(
        st.sampled_from(
            [
                "model-path",
                "method",
                "too-big",
                "services-dots",
                "services-unknown",
                "auth",
                "huge-headers",
                "no-route",
            ]
        )
    )
    auth = list(AUTH.items())
    json_ct = [("Content-Type", "application/json")]
    if kind == "model-path":
        path = draw(st.sampled_from(MODEL_PATHS))
        return Attempt(
            "POST", path, draw(unroutable_bodies()), auth + json_ct, draw(st.booleans()), (400, 404)
        )
    if kind == "method":
        path = draw(st.sampled_from(MODEL_PATHS))
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
        body = json.dumps({"model": WITNESS_MODEL}).encode()
        return Attempt(method, path, body, auth + json_ct, False, (405,))
    if kind == "too-big":
        path = draw(st.sampled_from([*MODEL_PATHS, "/services/witness/upload"]))
        size = LIMIT + draw(st.integers(1, 3 * 65536))
        head = json.dumps({"model": WITNESS_MODEL, "x": ""}).encode()[:-2]
        body = head + b"a" * (size - len(head) - 2) + b'"}'
        return Attempt("POST", path, body, auth + json_ct, draw(st.booleans()), (413,))
    if kind == "services-dots":
        before = draw(st.lists(SEGMENT, max_size=2))
        dots = draw(st.sampled_from(["..", ".", "%2e%2e", "%2E.", "%2e"]))
        after = draw(st.lists(SEGMENT, max_size=2))
        path = "/services/witness/" + "/".join([*before, dots, *after])
        return Attempt(draw(st.sampled_from(["GET", "POST"])), path, None, auth, False, (400,))
    if kind == "services-unknown":
        name = draw(
            st.sampled_from(
                ["nope", "..", ".", "witness%2Fx", "witness%2F..", "%77itness%00", "WITNESS"]
            )
            | SEGMENT.filter(lambda s: s != "witness")
        )
        path = f"/services/{name}/" + "/".join(draw(st.lists(SEGMENT, max_size=2)))
        return Attempt("GET", path, None, auth, False, (404,))
    if kind == "auth":
        wrong = draw(
            st.sampled_from(
                [
                    [],
                    [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer sk-other")],
                    [("Authorization", "Bearer sk-other"), ("Authorization", f"Bearer {KEY}")],
                    [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
                    [("Authorization", f"Basic {KEY}")],
                    [("Authorization", KEY)],
                    [("Authorization", f"Bearer {KEY}x")],
                    [("Authorization", f"Bearer {KEY[:-1]}")],
                    [("Authorization", "Bearer " + "k" * 60_000)],
                    [("Authorization", "Bearer \u00e9".encode().decode("latin-1"))],
                    [("X-Api-Key", KEY)],
                ]
            )
        )
        path = draw(
            st.sampled_from([*MODEL_PATHS, "/v1/models", "/metrics", "/services/witness/x"])
        )
        body = json.dumps({"model": WITNESS_MODEL}).encode()
        return Attempt(
            "POST" if path in MODEL_PATHS else "GET", path, body, wrong + json_ct, False, (401,)
        )
    if kind == "huge-headers":  # over 64 KiB in all, on a request that would be forwarded
        n = draw(st.integers(1, 40))
        size = 65 * 1024 // n + 1
        big = [(f"X-Big-{i}", "v" * size) for i in range(n)]
        path = draw(st.sampled_from(["/services/witness/x", "/v1/chat/completions"]))
        body = json.dumps({"model": WITNESS_MODEL}).encode()
        return Attempt("POST", path, body, auth + json_ct + big, False, (431,))
    segments = draw(st.lists(SEGMENT, min_size=1, max_size=3))
    if segments[0] in ("healthz", "metrics", "v1", "services"):
        segments[0] += "x"
    path = "/" + "/".join(segments)
    return Attempt(
        draw(st.sampled_from(["GET", "POST", "OPTIONS"])), path, None, auth, False, (404, 405)
    )


def test_hostile_requests_get_a_refusal_in_openai_shape_and_never_reach_the_upstream(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    c = conn(wire, opened)
    seen_before = len(wire.witness.seen)

    @seed(int(SEED or 0))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(a=attempts())
    def run(a: Attempt) -> None:
        nonlocal c
        if c.sock is None:
            c = conn(wire, opened)
        try:
            status, headers, data = ask(c, a.method, a.path, a.body, a.headers, chunked=a.chunked)
        except (http.client.HTTPException, OSError):
            # the proxy may close after refusing a body it did not read: a new connection
            c = conn(wire, opened)
            status, headers, data = ask(c, a.method, a.path, a.body, a.headers, chunked=a.chunked)
        err = assert_refusal(status, headers, data, *a.expect)
        statuses.add(status)
        if status == 401:
            assert err["code"] == "invalid_api_key"
        assert len(wire.witness.seen) == seen_before, wire.witness.seen[seen_before:]

    statuses: set[int] = set()
    run()
    assert statuses >= {400, 401, 404, 405, 413, 431}  # every kind of attempt was drawn
    keeps_serving(conn(wire, opened))
    log = wire.proxy.log()
    assert "Traceback" not in log and " 500 " not in log, log[-2000:]


def test_a_forwarded_path_keeps_its_escapes_and_the_key_stays_here(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    c = conn(wire, opened)
    for sent, arrives in [
        ("/services/witness/metrics%23frag", "/metrics%23frag"),  # never a fragment
        ("/services/witness/a%3Fb?q=1", "/a%3Fb?q=1"),  # never a query
        ("/services/witness/a%00b", "/a%00b"),  # was a 500 (httpx refused the decoded NUL)
        ("/services/witness/a%0D%0AX-Forged:%201", "/a%0D%0AX-Forged:%201"),  # was a 500
        ("/services/witness/a%2Fb", "/a%2Fb"),
        ("/services/witness/%C3%A9t%C3%A9", "/%C3%A9t%C3%A9"),
        ("/services/witness/", "/"),
        ("/services/witness/..x/.y", "/..x/.y"),  # not dot segments
    ]:
        before = len(wire.witness.seen)
        status, _, data = ask(c, "GET", sent)
        assert status == 200 and json.loads(data)["witness"], (sent, data)
        [got] = wire.witness.seen[before:]
        assert got.path == arrives, (sent, got.path)
        assert "authorization" not in got.headers  # the proxy's client key is its own
    # An escaped slash is part of the service's name, not a way into another service.
    status, headers, data = ask(c, "GET", f"/services/{wire.model}%2F..%2Fwitness/x")
    assert assert_refusal(status, headers, data, 404)["code"] == "service_not_found"


def test_multipart_model_comes_from_the_form_field_only(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    c = conn(wire, opened)
    ct = [("Content-Type", "multipart/form-data; boundary=XyZ"), *AUTH.items()]

    def form(*parts: tuple[str, str]) -> bytes:
        out = b"".join(
            f"--XyZ\r\nContent-Disposition: {d}\r\n\r\n{v}\r\n".encode() for d, v in parts
        )
        return out + b"--XyZ--\r\n"

    path = "/v1/audio/transcriptions"
    for body in [
        form(('form-data; name="model"; filename="a.wav"', WITNESS_MODEL)),  # a file part
        form(('form-data; name="file"; filename="model"', WITNESS_MODEL)),
        form(('form-data; name="file"', "x")),  # no model field
        b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + WITNESS_MODEL.encode(),
        b"not multipart at all",
    ]:
        before = len(wire.witness.seen)
        status, headers, data = ask(c, "POST", path, body, ct)
        assert assert_refusal(status, headers, data, 400)["code"] == "model_missing", body
        assert len(wire.witness.seen) == before
    body = form(
        ('form-data; name="file"; filename="a.wav"', "RIFF"),
        ('form-data; name="model"', WITNESS_MODEL),
    )
    status, _, data = ask(c, "POST", path, body, ct)
    assert status == 200 and json.loads(data)["path"] == path


def test_a_body_that_names_no_model_is_told_what_is_wrong_with_it(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    """Each of the proxy's documented 400s (docs/how-to/proxy.md) says which it is (every
    one read "the request names no model"): no body, not JSON, not an object, no `model`, a `model` not a string."""
    c = conn(wire, opened)
    ct = [("Content-Type", "application/json"), *AUTH.items()]
    cases = [
        (b"", "model_missing", "the request has no body: send a JSON object with a 'model'"),
        (b"{model: 1}", "invalid_request", "the request body is not JSON (Expecting property"),
        (b"\xff{}", "invalid_request", "the request body is not JSON ('utf-8' codec"),
        (b'["qwen"]', "invalid_request", "the request body is an array, not a JSON object"),
        (b'"qwen"', "invalid_request", "the request body is a string, not a JSON object"),
        (b"{}", "model_missing", "the request names no model ('model' in the JSON body)"),
        (b'{"model": 7}', "invalid_request", "'model' must be a string, not a number"),
        (b'{"model": null}', "invalid_request", "'model' must be a string, not null"),
        (b'{"model": ["a"]}', "invalid_request", "'model' must be a string, not an array"),
    ]
    for body, code, message in cases:
        before = len(wire.witness.seen)
        status, headers, data = ask(c, "POST", "/v1/chat/completions", body, ct)
        err = assert_refusal(status, headers, data, 400)
        assert (err["code"], err["type"]) == (code, "invalid_request_error"), (body, err)
        assert err["message"].startswith(message), (body, err)
        assert len(wire.witness.seen) == before
    form = b'--XyZ\r\nContent-Disposition: form-data; name="file"\r\n\r\nx\r\n--XyZ--\r\n'
    mp = [("Content-Type", "multipart/form-data; boundary=XyZ"), *AUTH.items()]
    status, headers, data = ask(c, "POST", "/v1/audio/transcriptions", form, mp)
    err = assert_refusal(status, headers, data, 400)
    assert err["code"] == "model_missing" and "the form names no model" in err["message"], err


def test_a_huge_or_forged_model_name_is_cut_and_escaped_in_the_answer_and_the_log(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    c = conn(wire, opened)
    forged = (
        'x" 200 service=witness model=witness-model 1.0ms wait=0.00s\n127.0.0.1:1 "GET /v1/models'
    )
    for model in ["m" * 500_000, forged]:
        body = json.dumps({"model": model}).encode()
        status, headers, data = ask(c, "POST", "/v1/chat/completions", body)
        err = assert_refusal(status, headers, data, 404)
        assert err["code"] == "model_not_found" and "\n" not in err["message"]
    log = wire.proxy.log()
    assert "m" * 1000 not in log
    assert '\n127.0.0.1:1 "GET /v1/models' not in log  # no forged access line


def in_flight_metric(w: Wire, service: str) -> float:
    """The proxy's gpuctl_proxy_requests_in_flight for ``service`` (with the key)."""
    text = httpx.get(w.proxy.url + "/metrics", headers=AUTH, timeout=10).text
    [line] = [
        ln for ln in text.splitlines()
        if ln.startswith(f'gpuctl_proxy_requests_in_flight{{service="{service}"}} ')
    ]  # fmt: skip
    return float(line.rsplit(" ", 1)[1])


def test_max_concurrent_429_with_the_openai_client_and_the_count_comes_off(wire: Wire) -> None:
    w = wire.witness
    w.release.clear()
    w.holding.clear()
    held: list[int] = []
    url = f"{wire.proxy.url}/services/witness/hold"
    t = threading.Thread(
        target=lambda: held.append(httpx.get(url, headers=AUTH, timeout=60).status_code),
        daemon=True,
    )
    t.start()
    assert w.holding.wait(30)  # one request in flight on witness (max_concurrent = 1)
    assert in_flight_metric(wire, "witness") == 1
    with openai.OpenAI(base_url=wire.proxy.v1, api_key=KEY, max_retries=0) as client:
        try:
            with pytest.raises(openai.RateLimitError) as caught:
                client.chat.completions.create(model=WITNESS_MODEL, messages=MSG)  # type: ignore[arg-type]
            assert caught.value.status_code == 429
            assert caught.value.code == "max_concurrent"
            assert int(caught.value.response.headers["retry-after"]) >= 1
        finally:
            w.release.set()
        t.join(30)
        assert held == [200]
        # The held request ended: the next is served (its in-flight slot was given back).
        r = client.chat.completions.with_raw_response.create(model=WITNESS_MODEL, messages=MSG)  # type: ignore[arg-type]
        assert r.http_response.status_code == 200
    assert in_flight_metric(wire, "witness") == 0


def test_unknown_model_and_wrong_key_are_openai_errors(wire: Wire) -> None:
    with openai.OpenAI(base_url=wire.proxy.v1, api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="no-such-model", messages=MSG)  # type: ignore[arg-type]
        assert caught.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")
    with openai.OpenAI(base_url=wire.proxy.v1, api_key=KEY + "x", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as denied:
            bad.models.list()
        assert denied.value.code == "invalid_api_key"


def test_upstream_refused_is_an_openai_502(wire: Wire) -> None:
    with (
        openai.OpenAI(base_url=wire.proxy.v1, api_key=KEY, max_retries=0) as client,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        client.chat.completions.create(model="refused-model", messages=MSG)  # type: ignore[arg-type]
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_refused"
    assert "refused the connection" in caught.value.message


# --------------------------------------------------------------------- the GPU says no


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SimHost]:
    with SimHost(gpu_memory="100GiB", root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def refused_503(client: openai.OpenAI, model: str) -> openai.APIStatusError:
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=model, messages=MSG)  # type: ignore[arg-type]
    e = caught.value
    assert e.status_code == 503 and int(e.response.headers["retry-after"]) >= 1
    assert e.type == "service_unavailable"
    return e


def test_busy_preemptable_and_unknown_are_503_with_retry_after_naming_why(host: SimHost) -> None:
    batch, ask_, fits = unique_name("pxb"), unique_name("pxa"), unique_name("pxf")
    pb, pa, pf = free_port(), free_port(), free_port()
    conf = host.write_config(
        svc(batch, pb, memory="30GiB", load="1s", extra="priority = 50")
        + svc(ask_, pa, memory="80GiB", load="1s", extra="priority = 100")
        + svc(fits, pf, memory="20GiB", load="1s")
    )
    proxy = Proxy(host, conf)
    with openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0) as client:
        # BUSY: someone else's process holds the memory: 503 naming it.
        trainer = host.hold("trainer", "90GiB")
        wait_until("the trainer to hold the GPU", lambda: sim_claims(host, "trainer") != [])
        e = refused_503(client, fits)
        assert e.code == "gpu_busy" and "trainer" in e.message, e.message
        host.stop(trainer)

        # PREEMPTABLE: the lower-priority batch could make room, but this service may
        # not preempt (no preempt = true): 503, naming what would have to stop. The
        # batch's request has just ended: the proxy's own lingering count on it must
        # not make it look busy.
        client.chat.completions.create(model=batch, messages=MSG)  # type: ignore[arg-type]
        e = refused_503(client, ask_)
        assert f"fits once {batch}" in e.message, e.message
        assert sim_claims(host, ask_) == [] and len(sim_claims(host, batch)) == 1

        # UNKNOWN: the host's agent is gone, nobody can tell what holds the GPU.
        agent = host.procs[0]  # the fixture's start_agent spawned it first
        host.stop(agent)
        e = refused_503(client, fits)
        assert e.code == "gpu_unknown" and "agent" in e.message, e.message
        assert sim_claims(host, fits) == []
    log = proxy.log()
    assert "Traceback" not in log


def test_the_count_comes_off_with_the_last_byte_and_reclaim_right_after_stops_the_server(
    host: SimHost,
) -> None:
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, load="1s", extra='idle_timeout = "1s"'))
    proxy = Proxy(host, conf)
    # A stream that outlasts LINGER_S (a cold start, then 150 tokens at 20 ms each),
    # read to its very end (the openai client stops reading at [DONE]).
    body = {"model": name, "messages": MSG, "stream": True, "max_tokens": 150}
    with httpx.stream("POST", proxy.v1 + "/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 150 + 1 + 1, lines[-3:]
    # The answer has ended: so has the use, at once (it does not linger after the end).
    assert inflight(host) == {}
    time.sleep(1.2)  # past idle_timeout, counted from the stream's end
    r2 = subprocess.run(
        [gpuctl_exe(), "reclaim", "--json"], env=cli_env(conf), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert r2.returncode == 0, r2.stderr
    wait_until("the idle server to stop", lambda: sim_claims(host, name) == [])


# --------------------------------------------------------------------- a bug's answer


def test_a_bug_answers_500_in_openai_shape_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    from gpuctl.config import parse_config
    from gpuctl.proxy.app import ProxyApp, ProxySettings
    from gpuctl.proxy.routes import RouteTable

    conf = parse_config(
        {
            "hosts": {"h": {}},
            "services": {"s": {"health": "http://127.0.0.1:9/health", "models": ["m"]}},
        }
    )
    app = ProxyApp(conf, RouteTable(conf), ProxySettings(access_log=False))

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "_model_of", broken)
    monkeypatch.delenv("GPUCTL_DEBUG", raising=False)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return await c.post("/v1/chat/completions", json={"model": "m"})

    with caplog.at_level("ERROR", logger="gpuctl.proxy"):
        r = asyncio.run(call())
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal" and r.json()["error"]["type"] == "server_error"
    [rec] = [rec for rec in caplog.records if rec.name == "gpuctl.proxy"]
    assert "RuntimeError: a bug" in rec.getMessage() and not rec.exc_info


# --------------------------------------------------------------------- the count's writes


class CountingUse:
    """Stands in for ``gpuctl.api.in_use`` (a pure unit): counts the store's writes, and
    returns ``record`` as the store would at each."""

    def __init__(self) -> None:
        self.begins = 0
        self.ends = 0
        self.ended = asyncio.Event()
        self.record: Any = None

    async def __aenter__(self) -> None:
        self.begins += 1

    async def __aexit__(self, *exc: object) -> None:
        self.ends += 1
        self.ended.set()


def test_a_service_let_go_ready_is_trusted_again_by_its_record_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request after the count came off (past its lingering entry's trust) costs the
    count's write, not a health check, when the record the write returns is still
    running since the moment the service was let go; any stop, sleep or start between
    moves that moment."""
    from gpuctl.core.record import Phase, Record
    from gpuctl.proxy import use as use_mod

    monkeypatch.setattr(use_mod, "TRUST_S", 0.0)  # no lingering entry: the record alone

    running = Record(service="s", phase=Phase.RUNNING, since=100.0)

    async def scenario() -> None:
        fake = CountingUse()
        st = use_mod.ServiceUse(fake)  # type: ignore[arg-type]
        assert not await st.again()  # never ready: checked as a first request
        st.in_flight += 1
        await st.hold()
        st.ready = True
        fake.record = running
        st.in_flight = 0
        await st.let_go()  # its count off: reclaim may act from now on
        assert (st.held, st.ready) == (False, False)

        assert await st.again()  # still running since 100: ready, counted
        assert (st.held, st.ready, fake.begins) == (True, True, 2)

        await st.let_go()
        fake.record = Record(service="s", phase=Phase.RUNNING, since=250.0)  # restarted
        assert not await st.again()
        assert not st.ready and st.held  # checked as on a first request; still counted

        st.ready = True
        fake.record = running
        await st.let_go()
        fake.record = Record(service="s", phase=Phase.SLEEPING, since=300.0)
        assert not await st.again() and not st.ready
        assert not await st.again()  # kept once: the next one is checked too

    asyncio.run(scenario())


class LingeringUse(CountingUse):
    """``CountingUse`` whose begins wait for ``open`` (a store that answers late), and
    whose ends may leave the entry lingering, as ``in_use`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()
        self.lingered: list[float] = []
        self.extended: list[float] = []
        self.unlingered = 0

    async def __aenter__(self) -> None:
        await self.open.wait()
        self.begins += 1

    async def aexit_lingering(self, seconds: float) -> bool:
        self.lingered.append(seconds)
        self.ended.set()
        return True

    async def aextend_lingering(self, seconds: float) -> bool:
        self.extended.append(seconds)
        return True

    async def aend_lingering(self) -> None:
        self.unlingered += 1


def test_a_request_within_the_trust_goes_before_its_count_is_written() -> None:
    """A ready service let go leaves its entry lingering. A request within its trust is
    ready at once, with nothing written: counted once it has run ``COUNT_AFTER_S``
    (while the store is slow, nothing waits for that write), or, ended sooner, never:
    the entry's term starts again after it. Past the trust, the write comes first."""
    from gpuctl.core.record import Phase, Record
    from gpuctl.proxy import use as use_mod

    running = Record(service="s", phase=Phase.RUNNING, since=100.0)
    lingers = use_mod.TRUST_S + use_mod.TRUST_MARGIN_S

    async def scenario() -> None:
        fake = LingeringUse()
        fake.open.set()
        st = use_mod.ServiceUse(fake, idle_timeout_s=None)  # type: ignore[arg-type]
        assert st.trust_s == use_mod.TRUST_S
        st.in_flight += 1
        await st.hold()
        st.ready, fake.record = True, running
        st.in_flight = 0
        await st.let_go()
        assert fake.lingered == [lingers] and (st.held, st.ready) == (False, False)

        # A short request: ready at once, never counted; the term starts again after it.
        fake.open.clear()  # the store is slow now: a begin waits
        assert await asyncio.wait_for(st.again(), 1)
        st.in_flight += 1
        await asyncio.wait_for(st.hold(), 1)  # the request does not wait either
        assert st.ready and not st.held
        await st.end()
        await wait_for(lambda: fake.extended == [lingers])
        assert fake.begins == 1 and not st.held and not st.ready  # nothing counted

        # A longer one: counted once it has run COUNT_AFTER_S, however slow the store.
        assert await asyncio.wait_for(st.again(), 1)
        st.in_flight += 1
        await st.hold()
        await asyncio.sleep(use_mod.COUNT_AFTER_S + 0.1)
        assert not st.held and st.ready  # its count's write waits on the store
        fake.open.set()
        await wait_for(lambda: st.held)
        assert fake.begins == 2 and st.ready
        st.held_since -= 10  # stood past LINGER_S: the request's end takes it off
        await st.end()
        assert not st.held and len(fake.lingered) == 2

        # Past the trust: the count is written first (the record decides).
        st.trusted_until = 0.0
        fake.open.clear()
        again = asyncio.ensure_future(st.again())
        await asyncio.sleep(0.05)
        assert not again.done()  # waits for the store
        fake.open.set()
        assert await again and st.held

        # A person's stop moved the record under a counted trusted request: the next
        # one is checked.
        st.in_flight = 0
        await st.let_go()
        fake.record = Record(service="s", phase=Phase.RUNNING, since=250.0)
        assert await st.again()
        st.in_flight += 1
        await wait_for(lambda: st.held)
        assert not st.ready

        # Before a start, the proxy ends its lingering entry (a preemption waits for it).
        st.in_flight, st.ready, st.held_since = 0, True, 0.0
        fake.record = running
        await st.let_go()
        assert st.lingers and st.trusted_until > 0
        await st.unlinger()
        assert fake.unlingered == 1 and not st.lingers and st.trusted_until == 0.0
        await st.unlinger()  # nothing lingers: nothing written
        assert fake.unlingered == 1

    async def wait_for(cond: Any) -> None:
        for _ in range(300):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the condition never held")

    asyncio.run(scenario())


def test_an_extension_the_store_answers_after_the_entry_lapsed_trusts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short trusted request restarts the entry's term after its answer. If the store
    answers that write only after the entry could have lapsed (it does not bring a
    lapsed entry back), the proxy trusts nothing new: no entry may stand for it, so a
    stop may come, and the next request's count is written first."""
    from types import SimpleNamespace

    from gpuctl.core.record import Phase, Record
    from gpuctl.proxy import use as use_mod

    now = [1000.0]
    monkeypatch.setattr(use_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))

    class SlowExtend(LingeringUse):
        def __init__(self) -> None:
            super().__init__()
            self.extend_open = asyncio.Event()

        async def aextend_lingering(self, seconds: float) -> bool:
            await self.extend_open.wait()
            return await super().aextend_lingering(seconds)

    async def scenario() -> None:
        fake = SlowExtend()
        fake.open.set()
        st = use_mod.ServiceUse(fake, idle_timeout_s=None)  # type: ignore[arg-type]
        st.in_flight += 1
        await st.hold()
        st.ready, fake.record = True, Record(service="s", phase=Phase.RUNNING, since=100.0)
        st.in_flight = 0
        await st.let_go()
        assert st.trusted_until == 1000.0 + use_mod.TRUST_S

        now[0] = st.trusted_until - 0.5  # a short request at the trust's end
        assert await st.again()
        st.in_flight += 1
        await st.hold()
        await st.end()
        await asyncio.sleep(0.05)  # its extension's write waits on the store
        now[0] += use_mod.TRUST_MARGIN_S + 1.0  # past the entry's term when answered
        fake.extend_open.set()
        assert st._extend_task is not None
        await st._extend_task
        assert fake.extended  # written, but maybe after the entry lapsed
        assert now[0] >= st.trusted_until  # no new trust on its strength
        assert await st.again() and st.held and fake.begins == 2  # counted first

    asyncio.run(scenario())


def test_a_short_idle_timeout_keeps_the_trust_under_it() -> None:
    from gpuctl.proxy.use import TRUST_MARGIN_S, TRUST_S, trust_s

    assert trust_s(None) == TRUST_S
    assert trust_s(3600.0) == TRUST_S
    assert trust_s(1.0) == 0.0  # reclaim right after idle_timeout finds no lingering entry
    assert trust_s(TRUST_S) == TRUST_S - 2 * TRUST_MARGIN_S


def test_the_count_moves_on_transitions_at_most_once_per_linger_never_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuctl.proxy import use as use_mod

    monkeypatch.setattr(use_mod, "LINGER_S", 0.2)

    async def scenario() -> None:
        fake = CountingUse()
        st = use_mod.ServiceUse(fake)  # type: ignore[arg-type]
        for _ in range(50):  # one short request after another
            st.in_flight += 1
            await st.hold()
            await st.end()
        assert (fake.begins, fake.ends) == (1, 0)  # written once, not per request
        await asyncio.wait_for(fake.ended.wait(), 30)  # off once it has stood LINGER_S
        assert (fake.begins, fake.ends, st.held) == (1, 1, False)

        # A request that ends after the count stood LINGER_S takes it off before end()
        # returns (the proxy calls it before the answer's last byte).
        st.in_flight += 1
        await st.hold()
        st.held_since -= 1.0
        await st.end()
        assert (fake.begins, fake.ends, st.held, st.release) == (2, 2, False, None)

        # Two in flight: the first to end leaves the count; the last takes it off.
        st.in_flight += 2
        await st.hold()
        st.held_since -= 1.0
        await st.end()
        assert fake.ends == 2 and st.held
        await st.end()
        assert fake.ends == 3 and not st.held

    asyncio.run(scenario())


def test_a_hostile_upstream_is_a_502_or_a_cut_answer_never_a_500(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    # Nothing usable came back: 502 in OpenAI's shape.
    for path in ("/garbage", "/silent"):
        status, headers, data = ask(conn(wire, opened), "GET", "/services/witness" + path)
        assert assert_refusal(status, headers, data, 502)["type"] == "upstream_error", path
    # An answer cut short, with a length (it was a 500) or chunked: 502 when the cut is
    # known before its head goes; after it (answers are relayed as they arrive), the
    # client sees the cut. Never a 200 that looks whole. (These upstreams hang up at
    # once, so either may come; tests/test_proxy_streaming.py cuts one after its head.)
    for path in ("/cut-length", "/cut-chunked"):
        try:
            status, headers, data = ask(conn(wire, opened), "GET", "/services/witness" + path)
        except http.client.IncompleteRead:
            continue
        assert assert_refusal(status, headers, data, 502)["type"] == "upstream_error", path
    # An SSE stream cut short ends with an error event (data: {"error": ...}).
    r = httpx.get(f"{wire.proxy.url}/services/witness/cut-sse", headers=AUTH, timeout=30)
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0] == 'data: {"a": 1}', r.text
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_failed", r.text
    # Logged as what happened, not as the 200 that went first.
    head = '"GET /services/witness/cut-sse" 502 service=witness '
    wait_until("its access line", lambda: head in wire.proxy.log())
    entry = wire.proxy.log().split(head)[1].splitlines()[0]
    assert entry.endswith(" sent=200 error=upstream_failed"), entry
    keeps_serving(conn(wire, opened))
    log = wire.proxy.log()
    assert "Traceback" not in log and "a bug in gpuctl" not in log, log[-3000:]


@pytest.mark.slow
def test_queue_timeout_is_503_model_loading_and_a_start_that_fails_is_502(
    host: SimHost,
) -> None:
    slow, port = unique_name("pxs"), free_port()
    broken = unique_name("pxx")
    exits = f"{sys.executable} -c 'raise SystemExit(3)' {broken}"  # a server that dies at once
    conf = host.write_config(
        # a load far past twice the queue_timeout: both held requests time out first
        svc(slow, port, load="10s", extra='queue_timeout = "2s"')
        + f"[services.{broken}]\n"
        + 'launcher = "process"\n'
        + f"command = {json.dumps(exits)}\n"
        + f'health = "http://127.0.0.1:{free_port()}/health"\n'
        + f'match = ["{broken}"]\nmemory = "1GiB"\nhealth_timeout = "20s"\n'
        + f'models = ["{broken}"]\n'
    )
    proxy = Proxy(host, conf)
    with openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=60) as client:
        # Held past its queue_timeout while the server loads: 503 model_loading.
        e = refused_503(client, slow)
        assert e.code == "model_loading" and "queue_timeout" in e.message, e.message
        # A stream held as long got 200 and loading comments: it ends with an error event.
        # (A loaded machine may hold it under a second, before any comment: a plain 503.)
        with pytest.raises(openai.APIError) as caught:
            list(client.chat.completions.create(model=slow, messages=MSG, stream=True))  # type: ignore[arg-type]
        assert "queue_timeout" in str(caught.value)
        if not isinstance(caught.value, openai.APIStatusError):
            # The stream's error event: no status line to carry the 503 and its
            # Retry-After, so the event carries both, and the message says so in words.
            body = caught.value.body
            assert isinstance(body, dict), body
            assert body["status"] == 503 and body["retry_after"] >= 1, body
            assert caught.value.code == "model_loading"
            assert "this may be retried: send the request again in" in caught.value.message
        # Both held requests are logged 503, the stream too (its 200 went first, or
        # not at all).
        wait_until(
            "both access lines",
            lambda: proxy.log().count(f'"POST /v1/chat/completions" 503 service={slow} ') == 2,
        )
        # The start went on for whoever comes next.
        wait_until("the slow server to load", lambda: _answers(port), 60)
        reply = client.chat.completions.create(model=slow, messages=MSG)  # type: ignore[arg-type]
        assert "simulated reply" in (reply.choices[0].message.content or "")

        # A server that exits at start: 502 start_failed, naming the service.
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=broken, messages=MSG)  # type: ignore[arg-type]
        assert failed.value.status_code == 502 and failed.value.code == "start_failed"
    # However they ended, no count is left behind.
    wait_until("the counts to come off", lambda: inflight(host) == {})
    assert "Traceback" not in proxy.log()


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_client_that_leaves_mid_body_is_logged_499_and_never_forwarded(
    wire: Wire, opened: list[http.client.HTTPConnection]
) -> None:
    import socket

    before = len(wire.witness.seen)
    head = (
        f"POST /services/witness/upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Length: 100000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", wire.proxy.port)) as s:
        s.sendall(head.encode() + b"x" * 10)
    wait_until(
        "the proxy to log it", lambda: '"POST /services/witness/upload" 499' in wire.proxy.log()
    )
    assert "client-gone" in wire.proxy.log().split('"POST /services/witness/upload" 499')[1]
    assert len(wire.witness.seen) == before
    keeps_serving(conn(wire, opened))


def test_request_smuggling_and_absolute_form_never_reach_past_the_proxy(wire: Wire) -> None:
    import socket

    def raw(data: bytes) -> bytes:
        out = b""
        with socket.create_connection(("127.0.0.1", wire.proxy.port), timeout=30) as s:
            s.sendall(data)  # each ends with the connection closed by the proxy
            while chunk := s.recv(65536):
                out += chunk
        return out

    a = f"Host: x\r\nAuthorization: Bearer {KEY}\r\n"
    before = len(wire.witness.seen)
    # Content-Length and Transfer-Encoding both: refused whole (uvicorn's 400), so
    # the request hidden in the body is never read as a second one.
    out = raw(
        f"POST /services/witness/a HTTP/1.1\r\n{a}Content-Length: 4\r\n"
        f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        f"GET /services/witness/smuggled HTTP/1.1\r\n{a}\r\n".encode()
    )
    assert out.startswith(b"HTTP/1.1 400 ") and out.count(b"HTTP/1.1 ") == 1, out
    assert len(wire.witness.seen) == before
    # An absolute-form target names a host: the request still goes to the service's own
    # origin, never to the host it names.
    out = raw(
        f"GET http://evil.invalid/services/witness/abs HTTP/1.1\r\n{a}Connection: close\r\n\r\n".encode()
    )
    assert out.startswith(b"HTTP/1.1 200 "), out
    [seen] = wire.witness.seen[before:]
    assert seen.path == "/abs" and seen.headers["host"] == f"127.0.0.1:{wire.witness.port}"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /services/witness/a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"NOT AN HTTP REQUEST\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Bad\x01Name: 1\r\n\r\n",
    ],
    ids=["bad-content-length", "length-and-chunked", "request-line", "header-name"],
)
def test_http_the_server_cannot_parse_gets_an_openai_error_not_plain_text(
    wire: Wire, opened: list[http.client.HTTPConnection], request_bytes: bytes
) -> None:
    # uvicorn answers these itself, before the app: it wrote text/plain "Invalid HTTP
    # request received.", which an OpenAI client cannot read as an error.
    import socket

    before = len(wire.witness.seen)
    out = b""
    with socket.create_connection(("127.0.0.1", wire.proxy.port), timeout=30) as s:
        s.sendall(request_bytes)
        while chunk := s.recv(65536):  # the proxy closes the connection
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "HTTP/1.1 400 Bad Request", out
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    err = assert_refusal(400, headers, body, 400)
    assert err["code"] == "bad_http" and err["type"] == "invalid_request_error"
    assert len(wire.witness.seen) == before
    keeps_serving(conn(wire, opened))
