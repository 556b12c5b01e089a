"""``gpuctl proxy`` stopped (SIGTERM) with requests in it: each ends with an answer in
OpenAI's shape, and the proxy's log holds no traceback (only with GPUCTL_DEBUG=1).

Real processes: the proxy, the agent and simulated model servers on loopback.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.ensure_helpers import model_server_command, service_toml, unique_name
from tests.proxy_helpers import Proxy
from tests.test_proxy import MSG, svc, wait_until

TRACE_MARKS = ("Traceback", "Exception in ASGI application", "a bug in gpuctl")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SimHost]:
    with SimHost(gpu_memory="100GiB", root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def _stream(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """POST a streaming request; note its status, each line as it comes, and how it ended."""
    out["lines"] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                out["lines"].append(line)
        out["ended"] = "whole"
    except httpx.HTTPError as e:
        out["ended"] = f"cut: {type(e).__name__}"


def _error_event(lines: list[str]) -> dict[str, Any]:
    data = [line for line in lines if line.startswith("data: ")]
    assert data, lines
    return json.loads(data[-1][len("data: ") :])["error"]  # type: ignore[no-any-return]


def test_sigterm_answers_held_requests_at_once(host: SimHost) -> None:
    name, port = unique_name("pxd"), free_port()
    # A load far longer than the test: both requests are still held when the proxy stops.
    conf = host.write_config(svc(name, port, load="120s"))
    proxy = Proxy(host, conf)
    url = proxy.v1 + "/chat/completions"
    held_stream: dict[str, Any] = {}
    plain: dict[str, Any] = {}

    def ask_plain() -> None:
        plain["r"] = httpx.post(url, json={"model": name, "messages": MSG}, timeout=60)

    threads = [
        threading.Thread(
            target=_stream,
            args=(url, {"model": name, "messages": MSG, "stream": True}, held_stream),
        ),
        threading.Thread(target=ask_plain),
    ]
    for t in threads:
        t.start()
    # Both held, and the stream already opened with a loading comment.
    wait_until(
        "two held requests, the stream with a loading comment",
        lambda: (
            proxy.metric("gpuctl_proxy_requests_in_flight", name) == 2
            and any(line.startswith(": loading") for line in held_stream.get("lines", []))
        ),
        60,
    )
    proxy.proc.send_signal(signal.SIGTERM)
    # Answered at once, not after uvicorn's 5 s graceful timeout cancels them.
    assert proxy.proc.wait(30) == 0
    for t in threads:
        t.join(30)
        assert not t.is_alive()

    r: httpx.Response = plain["r"]
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after"), r.headers
    assert r.json()["error"]["code"] == "proxy_shutting_down", r.text
    assert held_stream["status"] == 200 and held_stream["ended"] == "whole", held_stream
    err = _error_event(held_stream["lines"])
    assert err["code"] == "proxy_shutting_down", err
    assert "send the request again" in err["message"], err

    log = proxy.log()
    for mark in TRACE_MARKS:
        assert mark not in log, log[-3000:]
    assert f"service={name}" in log and " 503 " in log, log[-3000:]


def test_sigterm_past_the_grace_ends_a_relayed_stream_with_an_error_event(
    host: SimHost,
) -> None:
    name, port = unique_name("pxg"), free_port()
    # 0.3 s a token, 200 tokens: a minute of answer, far past the 5 s grace of a stop.
    command = model_server_command(name, port, load_time="1s") + " --token-delay 300ms"
    conf = host.write_config(service_toml(name, port, command, extra=f'models = ["{name}"]'))
    proxy = Proxy(host, conf)
    url = proxy.v1 + "/chat/completions"
    out: dict[str, Any] = {}
    body = {"model": name, "messages": MSG, "stream": True, "max_tokens": 200}
    t = threading.Thread(target=_stream, args=(url, body, out))
    t.start()
    wait_until(
        "the answer to flow",
        lambda: sum(line.startswith("data: ") for line in out.get("lines", [])) >= 2,
        60,
    )
    counts = host.state_dir / "inflight"
    wait_until("its in-flight count in the store", lambda: any(counts.rglob("*.json")))
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0
    t.join(30)
    assert not t.is_alive()
    # Not the end of a whole answer: an error event saying why it stopped.
    assert "data: [DONE]" not in out["lines"], out
    err = _error_event(out["lines"])
    assert err["code"] == "proxy_shutting_down", (err, out)
    # Its in-flight count is gone from the store, not left behind naming a dead pid
    # (the request was still counted when the proxy let its store go).
    left = list(counts.rglob("*.json"))
    assert not left, left
    log = proxy.log()
    for mark in TRACE_MARKS:
        assert mark not in log, log[-3000:]
