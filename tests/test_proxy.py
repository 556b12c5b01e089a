"""``gpuctl proxy`` end to end: the real proxy process in front of simulated model servers
that the process launcher starts, on a simulated GPU host with its agent, driven by the
official ``openai`` client (sync and async) and by raw HTTP where the wire matters."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuctl.adapters.store.direct import DirectStore
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import Closing, gpuctl_exe
from tests.ensure_helpers import (
    cli_env,
    launches_in_log,
    model_server_command,
    read_record,
    run_ensure,
    service_toml,
    sim_claims,
    unique_name,
)
from tests.proxy_helpers import Proxy, sim_metric

MSG = [{"role": "user", "content": "hello"}]


def svc(name: str, port: int, *, memory: str = "20GiB", load: str = "2s", extra: str = "") -> str:
    toml = service_toml(
        name,
        port,
        model_server_command(name, port, memory, load),
        extra=f'models = ["{name}", "{name}-alias"]\n{extra}',
    )
    return toml.replace('memory = "20GiB"', f'memory = "{memory}"')


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SimHost]:
    with SimHost(gpu_memory="100GiB", root=tmp_path / "simhost") as h:
        h.start_agent()
        yield h


def server_log(host: SimHost, name: str) -> Path:
    """Where the process launcher logs ``name``'s server (each start marked)."""
    logs = list(host.state_dir.rglob(f"{name}*.log"))
    assert logs, f"no log for {name} under {host.state_dir}"
    return logs[0]


def inflight(host: SimHost) -> dict[str, int]:
    return DirectStore(host.state_dir).inflight()


def wait_until(what: str, pred: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------- the openai client


def test_openai_clients_sync_and_async_streaming_and_not_through_a_cold_start(
    host: SimHost, closing: Closing
) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port)))
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0))

    models = {m.id: m.owned_by for m in client.models.list()}  # listed while stopped
    assert models == {name: f"gpuctl:{name}", f"{name}-alias": f"gpuctl:{name}"}
    assert sim_claims(host, name) == []

    reply = client.chat.completions.create(model=name, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    assert len(sim_claims(host, name)) == 1

    stream = client.chat.completions.create(
        model=name,
        messages=MSG,  # type: ignore[arg-type]
        stream=True,
        max_tokens=7,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 7

    async def async_side() -> tuple[str, int]:
        aclient = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
        r = await aclient.chat.completions.create(model=name, messages=MSG)  # type: ignore[arg-type]
        s = await aclient.chat.completions.create(
            model=name,
            messages=MSG,  # type: ignore[arg-type]
            stream=True,
            max_tokens=5,
        )
        n = 0
        async for c in s:
            n += bool(c.choices and c.choices[0].delta.content)
        await aclient.close()
        return r.choices[0].message.content or "", n

    content, n = asyncio.run(async_side())
    assert "simulated reply" in content and n == 5
    assert launches_in_log(server_log(host, name)) == 1
    assert proxy.metric("gpuctl_proxy_cold_starts_total", name) == 1
    log = proxy.log()
    assert f'"POST /v1/chat/completions" 200 service={name} model={name}' in log
    # At the default level the proxy says it listens once; uvicorn's own lifecycle lines
    # (which repeat that) show only with --log-level debug.
    assert log.count("gpuctl proxy: listening on ") == 1, log
    assert "Application startup complete" not in log and "INFO:" not in log, log


def test_cold_start_under_load_32_requests_one_launch_all_answered(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port, load="3s")))

    async def many() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=proxy.v1, api_key="x", max_retries=0, timeout=120)
        try:
            replies = await asyncio.gather(
                *(
                    aclient.chat.completions.create(model=name, messages=MSG)  # type: ignore[arg-type]
                    for _ in range(32)
                )
            )
        finally:
            await aclient.close()
        return [r.choices[0].message.content or "" for r in replies]

    answers = asyncio.run(many())
    assert len(answers) == 32 and all("simulated reply" in a for a in answers)
    assert launches_in_log(server_log(host, name)) == 1
    assert len(sim_claims(host, name)) == 1
    # One start, however many requests it held: those show in the queue-wait histogram.
    assert proxy.metric("gpuctl_proxy_cold_starts_total", name) == 1
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text)
    }
    waits = families["gpuctl_proxy_queue_wait_seconds"].samples
    held = [s for s in waits if s.name.endswith("_count") and s.labels["service"] == name]
    assert [s.value for s in held] == [32]


def test_requests_that_match_no_service_show_in_the_metrics(
    host: SimHost, closing: Closing
) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port)))
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSG)  # type: ignore[arg-type]
    assert httpx.get(proxy.url + "/services/no-such-service/health").status_code == 404
    assert httpx.get(proxy.url + "/v2/nowhere").status_code == 404
    text = httpx.get(proxy.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    unrouted = [
        s.value
        for s in families["gpuctl_proxy_requests"].samples
        if s.labels == {"service": "", "code": "404"}
    ]
    assert unrouted == [3]
    assert sim_claims(host, name) == []  # nothing was started for them


def test_two_models_that_do_not_fit_the_second_gets_503_naming_the_holder(
    host: SimHost, closing: Closing
) -> None:
    a, b = unique_name("pxa"), unique_name("pxb")
    pa, pb = free_port(), free_port()
    conf = host.write_config(svc(a, pa, memory="80GiB") + svc(b, pb, memory="80GiB"))
    proxy = Proxy(host, conf)
    body = {"model": a, "messages": MSG}
    assert httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=60).status_code == 200

    r = httpx.post(proxy.v1 + "/chat/completions", json={**body, "model": b}, timeout=60)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "gpu_busy" and err["type"] == "service_unavailable"
    assert a in err["message"], err  # who holds the GPU
    assert sim_claims(host, b) == []

    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0))
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=b, messages=MSG)  # type: ignore[arg-type]
    assert caught.value.status_code == 503


def test_retry_after_of_a_start_under_way_comes_from_its_eta(
    host: SimHost, closing: Closing
) -> None:
    """Held past queue_timeout while its service loads: Retry-After is what is left of
    the start by its ETA (a 5 s load held 2 s: about 3), not the proxy's 30 s."""
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, load="5s", extra='queue_timeout = "2s"'))
    run_ensure(conf, name)  # a start on record: its ETA
    subprocess.run(
        [gpuctl_exe(), "stop", name], env=cli_env(conf), capture_output=True, timeout=60, check=True
    )
    proxy = Proxy(host, conf)
    r = httpx.post(proxy.v1 + "/chat/completions", json={"model": name, "messages": MSG})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
    expected = float(read_record(host, name)["attempts"][0]["duration_s"])
    assert 1 <= int(r.headers["retry-after"]) <= math.ceil(expected), r.headers
    # The openai client honours it: its retries meet the server once it is up.
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=3))
    reply = client.chat.completions.create(model=name, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")


def _last_used(conf: Path, name: str) -> float | None:
    """The service's ``last_used`` in ``gpuctl locks --json``, run as a user would (None:
    no record, or never used)."""
    out = subprocess.run(
        [gpuctl_exe(), "locks", "--json"], env=cli_env(conf), capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    rows = [r for r in json.loads(out)["records"] if r["service"] == name]
    return rows[0]["last_used"] if rows else None


def test_a_refused_request_is_no_use_a_served_one_is(host: SimHost) -> None:
    # A request the proxy refuses (here: BUSY, the GPU taken) served nobody: it must not
    # make the stopped service look used (last_used) or busy (an in-flight count).
    a, b = unique_name("pxa"), unique_name("pxb")
    pa, pb = free_port(), free_port()
    conf = host.write_config(svc(a, pa, memory="80GiB") + svc(b, pb, memory="80GiB"))
    proxy = Proxy(host, conf)
    ok = httpx.post(proxy.v1 + "/chat/completions", json={"model": a, "messages": MSG}, timeout=60)
    assert ok.status_code == 200
    assert _last_used(conf, a) is not None  # served: used
    for model, status in ((b, 503), (f"{b}-nope", 404)):
        r = httpx.post(
            proxy.v1 + "/chat/completions", json={"model": model, "messages": MSG}, timeout=60
        )
        assert r.status_code == status, r.text
        assert b not in inflight(host)  # never counted, not even for a moment after
    assert _last_used(conf, b) is None
    assert sim_claims(host, b) == []


# --------------------------------------------------------------------- streams and use


def _stream_in_thread(url: str, model: str, tokens: int) -> tuple[threading.Thread, list[str]]:
    got: list[str] = []

    def run() -> None:
        body = {"model": model, "messages": MSG, "stream": True, "max_tokens": tokens}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError as e:  # the proxy killed under it
            got.append(f"error: {type(e).__name__}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_reclaim_never_cuts_a_stream_and_stops_the_server_once_idle(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, extra='idle_timeout = "1s"'))
    proxy = Proxy(host, conf)
    # 250 tokens at 20 ms: a stream of about 5 s, long past the idle timeout.
    t, got = _stream_in_thread(proxy.url, name, 250)
    wait_until("the stream to flow", lambda: len(got) > 4)
    assert inflight(host) == {name: 1}
    time.sleep(1.5)  # past idle_timeout since the request began
    r = subprocess.run(
        [gpuctl_exe(), "reclaim", "--json"], env=cli_env(conf), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    t.join(60)
    assert got[-2:] == ["data: [DONE]", ""] or got[-1] == "data: [DONE]", got[-3:]
    assert len(sim_claims(host, name)) == 1  # never stopped under the stream
    wait_until("the count to come off", lambda: inflight(host) == {})  # after LINGER_S

    time.sleep(1.5)
    r = subprocess.run(
        [gpuctl_exe(), "reclaim"], env=cli_env(conf), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    wait_until("the idle server to stop", lambda: sim_claims(host, name) == [])


def test_a_sporadic_request_goes_on_the_lingering_entry_before_its_count_lands(
    host: SimHost,
) -> None:
    """Once the proxy's count comes off a ready service, its entry lingers in the store:
    no request in flight, but reclaim keeps the service. A request that comes meanwhile
    goes at once: a short one is never counted (the entry's term starts again after
    it), and a longer one is answered while the agent (where its count is written) is
    frozen, its count landing once the agent runs again."""
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, load="0s"))
    proxy = Proxy(host, conf)
    store = DirectStore(host.state_dir)
    short = {"model": name, "messages": MSG, "max_tokens": 1}
    with httpx.Client(timeout=60) as client:
        assert client.post(proxy.v1 + "/chat/completions", json=short).status_code == 200
        wait_until("the count to linger", lambda: name in store.lingering())
        assert inflight(host) == {}  # lingering is no request in flight

        # Another laptop's reclaim, with a 1 s idle timeout: it keeps the service.
        other = host.base / "other.toml"
        table = f"[services.{name}]"
        other.write_text(conf.read_text().replace(table, f'{table}\nidle_timeout = "1s"'))
        time.sleep(1.2)
        left = store.lingering()[name]
        r = subprocess.run(
            [gpuctl_exe(), "reclaim", "--json"], env=cli_env(other), capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "lingering" in r.stdout, r.stdout
        assert len(sim_claims(host, name)) == 1

        # A short request: answered, never counted; the entry's term starts again.
        assert client.post(proxy.v1 + "/chat/completions", json=short).status_code == 200
        wait_until("the term to start again", lambda: store.lingering().get(name, 0) > left)
        assert inflight(host) == {}

        agent = host.procs[0]  # the fixture's start_agent spawned it first
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            answered: list[int] = []
            longer = {"model": name, "messages": MSG, "max_tokens": 40}  # 20 ms a token

            def ask() -> None:
                answered.append(
                    client.post(proxy.v1 + "/chat/completions", json=longer).status_code
                )

            t = threading.Thread(target=ask)
            t.start()
            wait_until("the answer, with the agent frozen", lambda: answered == [200])
            assert name in store.lingering() and inflight(host) == {}  # not counted yet
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        t.join(30)
    # Its count lands (it stands LINGER_S), then comes off and lingers again.
    wait_until("the count to land", lambda: inflight(host) == {name: 1})
    wait_until("the count to linger again", lambda: name in store.lingering())
    assert inflight(host) == {}
    assert "not counted" not in proxy.log(), proxy.log()


def test_kill_9_of_the_proxy_mid_stream_leaves_no_count_and_reclaim_stops_it(
    host: SimHost,
) -> None:
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, extra='idle_timeout = "1s"'))
    proxy = Proxy(host, conf)
    _t, got = _stream_in_thread(proxy.url, name, 2000)
    wait_until("the stream to flow", lambda: len(got) > 4)
    entries = list((host.state_dir / "inflight" / name).glob("*.json"))
    assert len(entries) == 1 and inflight(host) == {name: 1}
    assert json.loads(entries[0].read_text())["pid"] == proxy.proc.pid

    os.killpg(proxy.proc.pid, signal.SIGKILL)
    proxy.proc.wait(10)
    assert inflight(host) == {}  # tied to the dead proxy's pid and boot id: counts for nothing
    time.sleep(1.2)
    r = subprocess.run(
        [gpuctl_exe(), "reclaim"], env=cli_env(conf), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    wait_until("the idle server to stop", lambda: sim_claims(host, name) == [])


def test_a_client_that_disconnects_cancels_the_upstream_request(
    host: SimHost, closing: Closing
) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port)))
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0))
    client.chat.completions.create(model=name, messages=MSG, max_tokens=1)  # type: ignore[arg-type]
    assert sim_metric(port, "gpuctl_sim_requests_cancelled_total") == 0

    stream = client.chat.completions.create(
        model=name,
        messages=MSG,  # type: ignore[arg-type]
        stream=True,
        max_tokens=5000,
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    stream.close()  # the client goes away mid-answer
    wait_until(
        "the upstream to see the cancellation",
        lambda: sim_metric(port, "gpuctl_sim_requests_cancelled_total") == 1,
    )
    wait_until("the server to have nothing running",
               lambda: sim_metric(port, "vllm:num_requests_running") == 0)  # fmt: skip
    wait_until("the count to come off", lambda: inflight(host) == {})
    assert "client-gone" in proxy.log()


def test_loading_comments_while_a_stream_waits_then_the_answer(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, load="4s"))
    text = conf.read_text() + '\n[proxy]\nsse_interval = "500ms"\n'
    conf.write_text(text)
    proxy = Proxy(host, conf)
    body = {"model": name, "messages": MSG, "stream": True, "max_tokens": 3}
    lines = []
    with httpx.stream("POST", proxy.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    comments = [line for line in lines if line.startswith(":")]
    assert comments and all(c.startswith(": loading ") for c in comments), lines[:5]
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) == 1 + 3 + 1 + 1


def test_a_stream_that_said_200_then_failed_is_logged_and_counted_as_what_happened(
    host: SimHost,
) -> None:
    # The sim serves only `name`: `name-alias` (routed there by `models`) gets its 404.
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port, load="3s"))
    conf.write_text(conf.read_text() + '\n[proxy]\nsse_interval = "500ms"\n')
    proxy = Proxy(host, conf)
    body = {"model": f"{name}-alias", "messages": MSG, "stream": True}
    # Held through the cold start: 200 and loading comments, then the server's 404 has
    # nowhere to go but the stream's error event.
    with httpx.stream("POST", proxy.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0].startswith(": loading "), lines[:3]
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_status" and "answered 404" in err["message"], err
    # Warm now: the 404 goes as the status line itself.
    with httpx.stream("POST", proxy.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 404
    head = f'"POST /v1/chat/completions" 404 service={name} model={name}-alias '
    wait_until("both access lines", lambda: proxy.log().count(head) == 2)
    first, second = (part.splitlines()[0] for part in proxy.log().split(head)[1:])
    assert first.endswith(" sent=200 error=upstream_status"), first
    assert "sent=" not in second and "error=" not in second, second
    assert f'"POST /v1/chat/completions" 200 service={name}' not in proxy.log()
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert f'gpuctl_proxy_requests_total{{service="{name}",code="404"}} 2' in metrics
    assert f'gpuctl_proxy_requests_total{{service="{name}",code="200"}}' not in metrics


def test_upstream_failing_mid_stream_ends_with_an_error_event(
    host: SimHost, closing: Closing
) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port)))
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="x", max_retries=0))
    client.chat.completions.create(model=name, messages=MSG, max_tokens=1)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=name,
        messages=MSG,  # type: ignore[arg-type]
        stream=True,
        max_tokens=5000,
    )
    with pytest.raises(openai.APIError) as caught:
        for i, _ in enumerate(stream):
            if i == 2:
                for pid in sim_claims(host, name):
                    os.kill(pid, signal.SIGKILL)
    assert "failed mid-stream" in str(caught.value)
    # Its 200 went first; the log and the metrics say it failed.
    head = f'"POST /v1/chat/completions" 502 service={name} model={name} '
    wait_until("its access line", lambda: head in proxy.log())
    assert proxy.log().split(head)[1].splitlines()[0].endswith(" sent=200 error=upstream_failed")
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert f'gpuctl_proxy_requests_total{{service="{name}",code="502"}} 1' in metrics


# --------------------------------------------------------------------- refusals and routing


def test_refusals_in_openai_shape_and_passthrough(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    dead = free_port()  # nothing listens there
    extra = f'[services.{name}x]\nurl = "http://127.0.0.1:{dead}"\nhealth = "http://127.0.0.1:{port}/health"\nmodels = ["refused"]\nmemory = "1GiB"\n'
    conf = host.write_config(svc(name, port, extra="max_concurrent = 1") + extra)
    conf.write_text(conf.read_text() + '\n[proxy]\nmax_body = "1MiB"\n')
    proxy = Proxy(host, conf)
    post = proxy.v1 + "/chat/completions"

    r = httpx.post(post, json={"model": "nope", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(post, json={"messages": MSG})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_missing"
    r = httpx.post(post, content=b"x" * (2 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413

    # /services/<name>/... passes any path through (after starting the server).
    r = httpx.get(f"{proxy.url}/services/{name}/metrics", timeout=60)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text
    # /v1/models/<id>: the server's own card when it has one (vLLM, like the sim, has
    # only /v1/models), else ours; never a start for it.
    r = httpx.get(f"{proxy.v1}/models/{name}")
    assert r.status_code == 200 and r.json()["id"] == name
    assert httpx.get(f"{proxy.v1}/models/nope").status_code == 404

    # Upstream refused (its health answers, its url does not): 502.
    r = httpx.post(post, json={"model": "refused", "messages": MSG}, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_refused"

    # max_concurrent = 1: a second request while one streams is 429.
    t, got = _stream_in_thread(proxy.url, name, 200)
    wait_until("the stream to flow", lambda: len(got) > 2)
    r = httpx.post(post, json={"model": name, "messages": MSG})
    assert r.status_code == 429 and r.json()["error"]["code"] == "max_concurrent"
    assert "retry-after" in r.headers
    t.join(60)

    # whisper's multipart upload: `model` is a form field; routed to the service (whose
    # sim serves only `name`: its own 404 comes back, vLLM's error object, not the
    # proxy's); under its own name, the sim's transcription.
    r = httpx.post(
        proxy.v1 + "/audio/transcriptions",
        data={"model": f"{name}-alias"},
        files={"file": ("a.wav", b"RIFF....WAVE", "audio/wav")},
        timeout=60,
    )
    assert r.status_code == 404 and r.json()["object"] == "error", r.text
    assert f"`{name}-alias` does not exist" in r.json()["message"]
    r = httpx.post(
        proxy.v1 + "/audio/transcriptions",
        data={"model": name},
        files={"file": ("a.wav", b"RIFF....WAVE", "audio/wav")},
        timeout=60,
    )
    assert r.status_code == 200 and "simulated transcription of a.wav" in r.json()["text"]
    r = httpx.post(
        proxy.v1 + "/audio/transcriptions",
        data={"model": "whisper-nope"},
        files={"file": ("model", b"x", "audio/wav")},
    )
    assert r.json()["error"]["code"] == "model_not_found"
    assert proxy.metric("gpuctl_proxy_requests_in_flight", name) == 0


def test_client_keys_are_required_and_compared(
    host: SimHost, tmp_path: Path, closing: Closing
) -> None:
    name, port = unique_name("px"), free_port()
    keys = tmp_path / "keys"
    keys.write_text("# proxy keys\nsk-one\nsk-two\n")
    conf = host.write_config(svc(name, port))
    conf.write_text(conf.read_text() + f'\n[proxy]\napi_keys_file = "{keys}"\n')
    proxy = Proxy(host, conf)
    assert httpx.get(proxy.v1 + "/models").status_code == 401
    bad = httpx.get(proxy.v1 + "/models", headers={"authorization": "Bearer sk-three"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    ok = closing(openai.OpenAI(base_url=proxy.v1, api_key="sk-two", max_retries=0))
    assert {m.id for m in ok.models.list()} == {name, f"{name}-alias"}
    with pytest.raises(openai.AuthenticationError):
        closing(openai.OpenAI(base_url=proxy.v1, api_key="sk-nope", max_retries=0)).models.list()


def test_off_loopback_without_keys_is_refused(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    conf = host.write_config(svc(name, port))
    r = subprocess.run(
        [gpuctl_exe(), "proxy", "--listen", f"0.0.0.0:{free_port()}"], env=cli_env(conf),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2
    assert "refusing to listen on 0.0.0.0" in r.stderr and "api_keys" in r.stderr
    assert "Traceback" not in r.stderr


def test_ollama_fronted_through_its_own_v1(host: SimHost, closing: Closing) -> None:
    from tests.ollama_helpers import SimOllama

    ollama = SimOllama(host.sim_dir, host.base, "-m", "qwen3:0.6b=2GiB", "--load-time", "1s")
    try:
        name = unique_name("chat")
        conf = host.write_config(
            f'[services.{name}]\nlauncher = "ollama"\nmodel = "qwen3:0.6b"\nmemory = "2GiB"\n'
            f'health_timeout = "60s"\n'
        )
        conf.write_text(
            conf.read_text().replace("[hosts.sim]\n", f'[hosts.sim]\nollama = "{ollama.url}"\n')
        )
        proxy = Proxy(host, conf)
        client = closing(openai.OpenAI(base_url=proxy.v1, api_key="ollama", max_retries=0))
        assert [m.id for m in client.models.list()] == ["qwen3:0.6b"]
        assert ollama.ps() == {}
        reply = client.chat.completions.create(model="qwen3:0.6b", messages=MSG)  # type: ignore[arg-type]
        assert reply.choices[0].message.content
        assert "qwen3:0.6b" in ollama.ps()  # loaded by gpuctl's ensure (the ollama launcher)
        assert proxy.metric("gpuctl_proxy_cold_starts_total", name) == 1
    finally:
        ollama.kill()


def test_a_client_that_leaves_while_held_is_never_forwarded(host: SimHost) -> None:
    name, port = unique_name("px"), free_port()
    proxy = Proxy(host, host.write_config(svc(name, port, load="4s")))
    body = {"model": name, "messages": MSG, "max_tokens": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=1.0)  # leaves after 1 s
    wait_until("the start to finish", lambda: len(sim_claims(host, name)) == 1, 60)
    wait_until("the server to answer", lambda: _answers(port), 60)
    wait_until("the proxy to log the request", lambda: " 499 " in proxy.log())
    assert "client-gone" in proxy.log()
    time.sleep(0.5)  # had it been forwarded, the server would have served it by now
    assert sim_metric(port, "vllm:request_success_total") == 0
    assert sim_metric(port, "vllm:generation_tokens_total") == 0
    # The start went on for whoever comes next: this one is served at once.
    r = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 200


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_preemption_by_policy_and_never_under_a_stream(host: SimHost) -> None:
    batch, ask, pre = unique_name("pxb"), unique_name("pxa"), unique_name("pxp")
    pb, pa, pp = free_port(), free_port(), free_port()
    conf = host.write_config(
        svc(batch, pb, memory="30GiB", extra="priority = 50")
        + svc(ask, pa, memory="80GiB", extra="priority = 100")
        + svc(pre, pp, memory="80GiB", extra="priority = 100\npreempt = true")
    )
    proxy = Proxy(host, conf)
    post = proxy.v1 + "/chat/completions"
    assert httpx.post(post, json={"model": batch, "messages": MSG}, timeout=60).status_code == 200

    # A stream in flight on the batch: not a victim, even for a service that may preempt.
    t, got = _stream_in_thread(proxy.url, batch, 250)
    wait_until("the stream to flow", lambda: len(got) > 4)
    r = httpx.post(post, json={"model": pre, "messages": MSG}, timeout=60)
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    t.join(60)
    assert got[-1] == "data: [DONE]" or got[-2] == "data: [DONE]", got[-3:]
    wait_until("the batch's count to come off", lambda: inflight(host) == {})

    # Without preempt = true: 503, naming what would have to stop.
    r = httpx.post(post, json={"model": ask, "messages": MSG}, timeout=60)
    assert r.status_code == 503, r.text
    assert f"fits once {batch}" in r.json()["error"]["message"]
    assert len(sim_claims(host, batch)) == 1

    # With it: the idle batch is preempted and the request answered.
    r = httpx.post(post, json={"model": pre, "messages": MSG}, timeout=60)
    assert r.status_code == 200, r.text
    assert sim_claims(host, batch) == [] and len(sim_claims(host, pre)) == 1
    rec = json.loads((host.state_dir / "records" / f"{batch}.json").read_text())
    assert rec["phase"] == "preempted"


def _lingering_batch(host: SimHost) -> tuple[str, str, Path, Proxy, DirectStore]:
    """A batch (priority 50) used once through a proxy, its entry lingering now, and a
    service that may preempt it (priority 100): their names, the config, the proxy and
    the host's store."""
    batch, pre = unique_name("pxb"), unique_name("pxp")
    pb, pp = free_port(), free_port()
    conf = host.write_config(
        svc(batch, pb, memory="30GiB", load="0s", extra="priority = 50")
        + svc(pre, pp, memory="80GiB", load="0s", extra="priority = 100\npreempt = true")
    )
    proxy = Proxy(host, conf)
    store = DirectStore(host.state_dir)
    post = proxy.v1 + "/chat/completions"
    assert httpx.post(post, json={"model": batch, "messages": MSG}, timeout=60).status_code == 200
    wait_until("the batch's entry to linger", lambda: batch in store.lingering())
    return batch, pre, conf, proxy, store


def test_a_preemption_waits_for_a_lingering_entry_and_never_cuts_what_it_let_in(
    host: SimHost,
) -> None:
    """A preemption (from another caller than the proxy) whose victim's entry lingers
    waits for it: a request the proxy sends meanwhile, before its count is written, is
    counted even under the preemption's lease, which then leaves the victim alone. Once
    nothing lingers nor runs, the victim is preempted."""
    batch, pre, conf, proxy, store = _lingering_batch(host)

    ensure = subprocess.Popen(
        [gpuctl_exe(), "ensure", pre, "--json", "--timeout", "90s"],
        env={**host.env(), **cli_env(conf)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:

        def preempting() -> bool:
            lease = store.get(batch).lease
            return lease is not None and lease.entry == "preempt"

        wait_until("the preemption's lease", preempting)
        assert batch in store.lingering()  # it waits for the entry: the batch still runs
        # Sent on the entry's strength (no write first): counted under the lease.
        t, got = _stream_in_thread(proxy.url, batch, 100)
        t.join(60)
        assert got[-1] == "data: [DONE]" or got[-2] == "data: [DONE]", got[-3:]
        out, err = ensure.communicate(timeout=120)
    finally:
        ensure.kill()
    # The plan went stale under the stream: the batch was in use, so not a victim.
    assert ensure.returncode == 3, out + err
    assert "1 request in flight" in json.loads(out)["reason"], out
    assert len(sim_claims(host, batch)) == 1 and sim_claims(host, pre) == []

    # Nothing in flight now: this preemption waits for the entry to lapse, then stops it.
    wait_until("the batch's entry to linger again", lambda: batch in store.lingering())
    r = subprocess.run(
        [gpuctl_exe(), "ensure", pre, "--json", "--timeout", "90s"],
        env={**host.env(), **cli_env(conf)}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "their stops took" in r.stdout, r.stdout
    assert sim_claims(host, batch) == [] and len(sim_claims(host, pre)) == 1, r.stdout
    assert "not counted" not in proxy.log(), proxy.log()


def test_a_preemption_out_of_time_before_a_lingering_entry_lapses_stops_nothing(
    host: SimHost,
) -> None:
    """A preemption whose deadline comes while a victim's entry still lingers stops
    nothing: the proxy may still send that victim a request on the entry's strength,
    which a stop after the deadline would cut."""
    batch, pre, conf, proxy, store = _lingering_batch(host)
    r = subprocess.run(
        [gpuctl_exe(), "ensure", pre, "--json", "--timeout", "1s"],
        env={**host.env(), **cli_env(conf)}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert r.returncode != 0, r.stdout + r.stderr
    assert "their stops took" not in r.stdout, r.stdout
    assert len(sim_claims(host, batch)) == 1 and sim_claims(host, pre) == [], r.stdout
    assert store.get(batch).phase.value == "running", r.stdout
    # The proxy's trust still stands: its next request goes to the batch at once.
    assert (
        httpx.post(
            proxy.v1 + "/chat/completions", json={"model": batch, "messages": MSG}, timeout=60
        ).status_code
        == 200
    )


def _served(host: SimHost, name: str) -> list[dict[str, float]]:
    """The figures of the journal's `proxy` events that count ``name``'s served requests."""
    from gpuctl.adapters.store.journal import Journal

    j = Journal(host.state_dir)
    try:
        return [
            e.figures
            for _, e in j.read(0.0, service=name)
            if e.kind.value == "proxy" and "requests_served" in e.figures
        ]
    finally:
        j.close()


def _served_total(host: SimHost, name: str) -> float:
    return sum(f["requests_served"] for f in _served(host, name))


@pytest.mark.parametrize("every", ["0.5", "600"])
def test_every_served_request_is_counted_in_batches_for_usage(host: SimHost, every: str) -> None:
    """Every request the proxy answered for a service, not only those held through its
    cold start, reaches the journal, batched (one event per service and period, never
    per request); the last batch when the proxy stops (a 600 s period: only that one).
    `gpuctl usage` adds them up: none lost, none twice. A refusal the proxy makes itself
    (404: no such model) belongs to no service."""
    name, port = unique_name("px"), free_port()
    cfg = host.write_config(svc(name, port, load="1s"))
    proxy = Proxy(host, cfg, env={"GPUCTL_FAILPOINTS": f"proxy.served_every=seconds:{every}"})
    body = {"model": name, "messages": MSG, "max_tokens": 2}
    try:
        for _ in range(5):  # the first waits through the cold start
            r = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(proxy.v1 + "/chat/completions", json={**body, "model": "nope"})
        assert r.status_code == 404
        if every != "600":
            wait_until("the first batch", lambda: _served_total(host, name) == 5)
        for _ in range(3):
            r = httpx.post(proxy.v1 + "/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        proxy.stop()  # the last batch is told before it exits
    batches = _served(host, name)
    assert _served_total(host, name) == 8, batches
    assert all(f["period_s"] > 0 for f in batches)
    if every == "600":
        assert len(batches) == 1, batches  # told once, as the proxy stopped
    r = subprocess.run(
        [gpuctl_exe(), "usage", "--since", "1d", "--json"],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    rows = {row["key"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows[name]["proxy_requests"] == 8
    r = subprocess.run(
        [gpuctl_exe(), "events", "--since", "1h", "--service", name],
        env=cli_env(cfg),
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "request(s) through the proxy in" in r.stdout, r.stdout
    assert "cold start through the proxy, 1 request(s) held" in r.stdout, r.stdout
