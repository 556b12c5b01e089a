"""The proxy's pure parts: its config keys, routing, the model a body names, metrics text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuctl.config import parse_config
from gpuctl.errors import ConfigError, UsageError
from gpuctl.proxy.metrics import ProxyMetrics
from gpuctl.proxy.routes import (
    RouteTable,
    form_field,
    model_from_json,
    multipart_boundary,
    upstream_origin,
    why_no_model,
)


def conf(services: dict[str, Any], proxy: dict[str, Any] | None = None, **hosts: Any) -> Any:
    data: dict[str, Any] = {"hosts": hosts or {"dgx": {}}, "services": services}
    if proxy is not None:
        data["proxy"] = proxy
    return parse_config(data)


H = "http://127.0.0.1:8000/health"


def test_service_keys_parse_with_defaults() -> None:
    c = conf(
        {
            "a": {"health": H, "models": ["Qwen/Qwen3-32B", "qwen"], "max_concurrent": 8,
                  "queue_timeout": "90s", "url": "http://127.0.0.1:8001/"},
            "b": {"health": H},
        }
    )  # fmt: skip
    a, b = c.service("a"), c.service("b")
    assert a.models == ("Qwen/Qwen3-32B", "qwen") and a.max_concurrent == 8
    assert a.queue_timeout_s == 90.0 and a.url == "http://127.0.0.1:8001"
    assert (b.models, b.max_concurrent, b.queue_timeout_s, b.url) == ((), None, None, None)
    p = c.proxy
    assert (p.listen, p.max_body_mib, p.sse_keepalive, p.api_keys()) == (
        "127.0.0.1:9401",
        32,
        True,
        (),
    )


@pytest.mark.parametrize(
    ("service", "proxy", "where"),
    [
        ({"health": H, "models": ["a b"]}, None, "services.s.models"),
        ({"health": H, "models": ["x", "x"]}, None, "services.s.models"),
        ({"health": H, "models": [3]}, None, "services.s.models"),
        ({"health": H, "max_concurrent": 0}, None, "services.s.max_concurrent"),
        ({"health": H, "max_concurrent": True}, None, "services.s.max_concurrent"),
        ({"health": H, "queue_timeout": "0"}, None, "services.s.queue_timeout"),
        ({"health": H, "queue_timeout": "nan"}, None, "services.s.queue_timeout"),
        ({"health": H, "url": "ftp://x"}, None, "services.s.url"),
        ({"models": ["m"]}, None, "services.s.url"),  # nowhere to forward
        ({"health": H}, {"listen": "nope"}, "proxy.listen"),
        ({"health": H}, {"listen": "127.0.0.1:99999"}, "proxy.listen"),
        ({"health": H}, {"max_body": "-1"}, "proxy.max_body"),
        ({"health": H}, {"sse_keepalive": "yes"}, "proxy.sse_keepalive"),
        ({"health": H}, {"api_keys_env": "1BAD"}, "proxy.api_keys_env"),
        ({"health": H}, {"api_keys_env": "K", "api_keys_file": "/k"}, "proxy"),
        ({"health": H}, {"listne": "127.0.0.1:1"}, "proxy.listne"),
        ({"health": H}, "x", "proxy"),
    ],
)
def test_bad_values_are_located(service: dict[str, Any], proxy: Any, where: str) -> None:
    with pytest.raises(ConfigError) as e:
        conf({"s": service}, proxy)
    assert e.value.message.startswith(where + ":") or e.value.message.startswith(where + " "), (
        e.value.message
    )


def test_a_model_routes_to_one_service_only() -> None:
    with pytest.raises(ConfigError, match=r"services\.b\.models: 'q' is already a model of"):
        conf({"a": {"health": H, "models": ["q"]}, "b": {"health": H, "models": ["q"]}})


def test_keys_from_env_and_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PK", "k1, k2 k3")
    assert conf({"s": {"health": H}}, {"api_keys_env": "PK"}).proxy.api_keys() == (
        "k1",
        "k2",
        "k3",
    )
    monkeypatch.delenv("PK")
    with pytest.raises(ConfigError, match=r"proxy\.api_keys_env: environment variable PK"):
        conf({"s": {"health": H}}, {"api_keys_env": "PK"}).proxy.api_keys()
    monkeypatch.setenv("PK", " , ")
    with pytest.raises(ConfigError, match="PK is set but holds no key"):
        conf({"s": {"health": H}}, {"api_keys_env": "PK"}).proxy.api_keys()
    f = tmp_path / "keys"
    f.write_text("# comment\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        conf({"s": {"health": H}}, {"api_keys_file": str(f)}).proxy.api_keys()
    # An indented, commented-out key is no key; a comment after a key is not part of it.
    f.write_text("k1\n  # revoked k2\n\tk3   # rotated 2026-11\nk#4\n")
    assert conf({"s": {"health": H}}, {"api_keys_file": str(f)}).proxy.api_keys() == (
        "k1",
        "k3",
        "k#4",
    )
    f.write_text("k1\ntwo words\n")
    with pytest.raises(ConfigError, match=r"line 2: a key holds no spaces"):
        conf({"s": {"health": H}}, {"api_keys_file": str(f)}).proxy.api_keys()


def test_a_slurm_service_is_fronted_only_at_its_url() -> None:
    """A Slurm job's `{node}` is no address to forward to: the proxy fronts such a
    service only at its `url`, never at an origin read off the health template (a
    request would submit a job, then reach no server)."""
    job = {"launcher": "slurm", "command": "serve", "health": "http://{node}:8000/health"}
    c = conf(
        {"bare": dict(job), "fixed": {**job, "url": "http://127.0.0.1:8000"}},
        dgx={"slurm": {}},
    )
    assert upstream_origin(c, c.service("bare")) is None
    assert upstream_origin(c, c.service("fixed")) == "http://127.0.0.1:8000"
    assert set(RouteTable(c).by_name) == {"fixed"}


def test_routes_upstreams_and_host_filter() -> None:
    c = conf(
        {
            "v": {"host": "dgx", "health": "http://10.0.0.1:8000/health", "models": ["q"]},
            "u": {"host": "dgx", "health": H, "url": "http://10.0.0.2:9000", "models": ["u"]},
            "o": {"host": "box", "launcher": "ollama", "model": "qwen3:32b"},
            "job": {"host": "box", "memory": "10GiB"},
        },
        dgx={},
        box={"ollama": "http://127.0.0.1:11434"},
    )
    r = RouteTable(c)
    assert {m: up.origin for m, up in r.models()} == {
        "q": "http://10.0.0.1:8000",
        "u": "http://10.0.0.2:9000",
        "qwen3:32b": "http://127.0.0.1:11434",
    }
    assert "job" not in r.by_name  # no HTTP server: nothing to front
    assert upstream_origin(c, c.service("job")) is None
    assert set(RouteTable(c, "box").by_name) == {"o"}
    with pytest.raises(UsageError, match="unknown host"):
        RouteTable(c, "nope")


def test_model_from_json() -> None:
    assert model_from_json(b'{"model": "q", "stream": true}') == ("q", True)
    assert model_from_json(b'{"model": "q", "stream": "yes"}') == ("q", False)
    assert model_from_json(b'{"model": 3}') == (None, False)
    assert model_from_json(b"[1]") == (None, False)
    assert model_from_json(b"\xff") == (None, False)
    assert model_from_json(b"[" * 100_000) == (None, False)  # too deep: not a crash


def _multipart(fields: list[tuple[str, bytes, str | None]], boundary: str) -> bytes:
    out = b""
    for name, value, filename in fields:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_form_field_finds_model_not_a_filename() -> None:
    b = "abc123"
    body = _multipart([("file", b"RIFF model=evil", "model"), ("model", b"whisper-1", None)], b)
    assert multipart_boundary(f'multipart/form-data; boundary="{b}"') == b.encode()
    assert form_field(body, b.encode(), "model") == "whisper-1"
    assert form_field(body, b.encode(), "stream") is None
    assert multipart_boundary("application/json") is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.binary(min_size=1, max_size=40))
def test_any_body_gives_a_model_or_none(body: bytes, boundary: bytes) -> None:
    got = form_field(body, boundary, "model")
    assert got is None or isinstance(got, str)
    m, s = model_from_json(body)
    assert (m is None or isinstance(m, str)) and isinstance(s, bool)


def test_metrics_parse_as_prometheus_text() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    m = ProxyMetrics()
    m.requests[("vllm", 200)] += 3
    m.in_flight["vllm"] += 1
    m.cold_starts["vllm"] += 2
    m.waited("vllm", 12.5)
    m.upstream("vllm", 0.004)
    fams = {f.name: f for f in text_string_to_metric_families(m.render(["chat", "vllm"]))}
    assert {s.labels["service"] for s in fams["gpuctl_proxy_requests_in_flight"].samples} == {
        "chat",
        "vllm",
    }
    wait = [s for s in fams["gpuctl_proxy_queue_wait_seconds"].samples if s.name.endswith("_count")]
    assert wait[0].value == 1 and wait[0].labels == {"service": "vllm"}
    assert fams["gpuctl_proxy_upstream_latency_seconds"].type == "histogram"
    reqs = fams["gpuctl_proxy_requests"].samples
    assert reqs[0].labels == {"service": "vllm", "code": "200"} and reqs[0].value == 3


def test_connection_names_its_own_hop_by_hop_headers() -> None:
    from gpuctl.proxy.relay import HOP, connection_named, hop_filter

    headers = [
        (b"connection", b"close, X-Secret"),
        (b"connection", b" keep-alive ,,x-other "),
        (b"x-secret", b"1"),
    ]
    assert connection_named(headers) == {b"close", b"x-secret", b"keep-alive", b"x-other"}
    assert hop_filter(headers, HOP) == HOP | {b"close", b"x-secret", b"x-other"}
    assert hop_filter([(b"connection", b"keep-alive")], HOP) is HOP  # nothing new: as is
    assert hop_filter([(b"x-secret", b"1")], HOP) is HOP


def test_why_no_model_names_each_case_and_cuts_what_it_quotes() -> None:
    json_ct = "application/json"
    assert why_no_model(json_ct, b"  ")[1] == "model_missing"
    assert why_no_model(json_ct, b"[" * 100_000) == (
        "the request body is JSON nested too deep to read",
        "invalid_request",
    )
    assert why_no_model(json_ct, b'{"model": true}') == (
        "'model' must be a string, not a boolean",
        "invalid_request",
    )
    assert why_no_model(json_ct, b'{"model": {}}')[0].endswith("not an object")
    assert why_no_model(json_ct, b"1.5")[0] == "the request body is a number, not a JSON object"
    message, code = why_no_model(json_ct, b"nope " * 1000)
    assert code == "invalid_request" and len(message) < 300, message
    assert why_no_model("multipart/form-data; boundary=b", b"{}")[1] == "model_missing"
    # Every body model_from_json routes to no model gets a reason, never an exception.
    for body in (b"", b"{", b"[]", b"null", b'{"model": 1}', b"\xfe", b'{"x": 1}'):
        assert model_from_json(body)[0] is None
        assert why_no_model(json_ct, body)[0]


# --------------------------------------------------------------------------- the document


def _answer(app: Any, method: str, path: str) -> tuple[int, dict[str, Any]]:
    """One request through the proxy's ASGI app, in process: its status and JSON body."""
    import asyncio
    import json

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
    }
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {}


def test_the_proxy_document_lists_every_route_it_serves_and_no_other() -> None:
    from gpuctl.proxy.app import ProxyApp, ProxySettings
    from gpuctl.proxy.openapi import openapi_document
    from gpuctl.proxy.routes import MODEL_IN_BODY, ROUTES

    doc = openapi_document(["m"], ["svc"])
    documented = {p: tuple(m.upper() for m in item) for p, item in doc["paths"].items()}
    assert documented == dict(ROUTES)
    assert {
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/score",
    } <= set(doc["paths"]) & set(MODEL_IN_BODY)
    # The router serves each documented operation: none is answered "no route" (a
    # model path without a model says so; an unknown model or service says which).
    c = conf({"svc": {"health": H, "models": ["m"]}})
    app = ProxyApp(c, RouteTable(c), ProxySettings(access_log=False))
    filled = {"{model}": "nope", "{name}": "nope", "{path}": "x"}
    for template, methods in ROUTES.items():
        path = template
        for k, v in filled.items():
            path = path.replace(k, v)
        for method in methods:
            status, body = _answer(app, method, path)
            code = body.get("error", {}).get("code") if isinstance(body, dict) else None
            assert code not in ("not_found", "method_not_allowed"), (method, path, body)
            assert status != 500, (method, path, body)
    status, body = _answer(app, "GET", "/v1/undocumented")
    assert (status, body["error"]["code"]) == (404, "not_found")


def test_every_proxy_operation_has_a_unique_operation_id() -> None:
    from gpuctl.proxy.openapi import openapi_document

    paths = openapi_document(["m"], ["svc"])["paths"]
    ids = [op.get("operationId") for item in paths.values() for op in item.values()]
    assert None not in ids
    assert len(ids) == len(set(ids)), sorted(ids)
