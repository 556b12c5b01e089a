"""``gpuctl proxy`` in front of a pooled service (``hosts = ["a", "b"]``): two simulated
hosts on their own loopback addresses, each with its agent and simulated GPU, the real
proxy process, and the official ``openai`` client.

A request goes to the host where the copy runs (not the first host's address), its
in-flight count lands in that host's store (so that host's reclaim leaves a stream
alone), and when the copy has gone the next request starts it where ``ensure`` picks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gpuctl import api
from gpuctl.sim.host import SimHost, free_port
from tests.conftest import Closing, gpuctl_in_process
from tests.ensure_helpers import kill_servers, unique_name
from tests.proxy_helpers import Proxy
from tests.test_pool import claims, ensure, hold, sim_pool, write_config
from tests.test_proxy import inflight, wait_until

ADDRESSES = ("127.0.0.1", "127.0.0.2")
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[list[SimHost]]:
    """Two simulated hosts, each with its agent on its own loopback address."""
    with sim_pool(tmp_path, ADDRESSES) as hosts:
        yield hosts


@pytest.fixture
def service() -> Iterator[str]:
    name = unique_name("pxpool")
    yield name
    kill_servers(name)


@pytest.fixture
def fresh_api() -> Iterator[None]:
    """``gpuctl.api`` with nothing cached (configs, where it found services, counts)."""
    api._reset_for_tests()
    yield
    api._reset_for_tests()


def stream_in_thread(
    client: openai.OpenAI, model: str, tokens: int
) -> tuple[threading.Thread, list[str]]:
    got: list[str] = []

    def run() -> None:
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=MSG,  # type: ignore[arg-type]
                stream=True,
                max_tokens=tokens,
            )
            for chunk in stream:
                if chunk.choices:
                    got.append(chunk.choices[0].delta.content or "")
            got.append("[DONE]")
        except openai.APIError as e:
            got.append(f"error: {type(e).__name__}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


@pytest.mark.slow
def test_a_copy_ready_on_the_second_host_is_answered_and_counted_there(
    pool: list[SimHost], tmp_path: Path, service: str, closing: Closing, fresh_api: None
) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "c.toml", pool, ["a", "b"], service, port,
        more=[f'models = ["{service}"]', 'idle_timeout = "1s"'],
    )  # fmt: skip
    code, out = ensure(config, service, "--host", "b")
    assert (code, out["outcome"], out["host"]) == (0, "ready", "b"), out

    # The Python API: b answers its health check (no flow), the result names b, and a
    # use of it counts in b's store, none in a's.
    got = api.ensure_ready_sync(service, config=config)
    assert (got.ready, got.host, got.reason) == (True, "b", "answers its health check"), got
    use = api.in_use(service, config=config)
    assert use.host == "b"
    with use:
        assert inflight(pool[1]) == {service: 1}
        assert inflight(pool[0]) == {}
    assert inflight(pool[1]) == {}

    proxy = Proxy(pool[0], config)
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0))

    reply = client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    assert claims(pool[0], service) == []  # nothing started on the first host
    assert len(claims(pool[1], service)) == 1
    assert proxy.metric("gpuctl_proxy_cold_starts_total", service) == 0  # found by health

    # 250 tokens at 20 ms: a stream of about 5 s, long past the idle timeout. Its count
    # is in b's store, where the copy runs, and none in a's.
    t, got = stream_in_thread(client, service, 250)
    wait_until("the stream to flow", lambda: len(got) > 4)
    assert inflight(pool[1]) == {service: 1}
    assert inflight(pool[0]) == {}
    time.sleep(1.5)  # past idle_timeout since the request began
    r = gpuctl_in_process(config, "reclaim", "--json")
    assert r.returncode == 0, r.stderr
    t.join(60)
    assert got[-1] == "[DONE]" and len([p for p in got if p]) == 251, got[-3:]
    assert len(claims(pool[1], service)) == 1  # never stopped under the stream
    wait_until("the count to come off b", lambda: inflight(pool[1]) == {})  # after LINGER_S

    # Idle now: the same reclaim stops it on b (so it looked there, and spared it for
    # the stream's count alone).
    time.sleep(1.5)
    r = gpuctl_in_process(config, "reclaim")
    assert r.returncode == 0, r.stderr
    wait_until("the idle copy on b to stop", lambda: claims(pool[1], service) == [])
    assert claims(pool[0], service) == []


def test_the_copy_gone_from_b_the_next_request_starts_it_where_ensure_picks(
    pool: list[SimHost], tmp_path: Path, service: str, closing: Closing
) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "c.toml", pool, ["a", "b"], service, port, more=[f'models = ["{service}"]']
    )
    filler_a = pool[0].hold("filler-a", "120GiB")  # a is full: the proxy starts it on b
    wait_until("a's filler", lambda: claims(pool[0], "filler-a"))
    proxy = Proxy(pool[0], config)
    client = closing(openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0))

    reply = client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    assert len(claims(pool[1], service)) == 1 and claims(pool[0], service) == []
    assert proxy.metric("gpuctl_proxy_cold_starts_total", service) == 1

    # The copy stops on b, a is freed and b filled: the pool's pick is a now.
    r = gpuctl_in_process(config, "stop", service, "--host", "b")
    assert r.returncode == 0, r.stderr + r.stdout
    wait_until("the copy on b to stop", lambda: claims(pool[1], service) == [])
    pool[0].stop(filler_a)
    wait_until("a's filler to go", lambda: claims(pool[0], "filler-a") == [])
    hold(pool[1], "filler-b", "120GiB")

    reply = client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    assert len(claims(pool[0], service)) == 1 and claims(pool[1], service) == []
    code, out = ensure(config, service)  # where ensure finds it: the same copy
    assert (code, out["outcome"], out["host"]) == (0, "ready", "a"), out
    # Its count followed it: the one it held on b (where it looked first) comes off.
    reply = client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    wait_until("the count on b to come off", lambda: inflight(pool[1]) == {})
    assert len(claims(pool[0], service)) == 1 and claims(pool[1], service) == []


def test_a_proxy_for_one_host_fronts_that_hosts_copy_of_a_pool_alone(
    pool: list[SimHost], tmp_path: Path, service: str, closing: Closing
) -> None:
    """``gpuctl proxy --host b``: the pooled service is listed (placed on b), a request
    starts it on b alone, and while the pool's copy runs on a that proxy refuses and
    says where it is: never a second copy, never a request sent to another host."""
    port = free_port()
    config = write_config(
        tmp_path / "c.toml", pool, ["a", "b"], service, port, more=[f'models = ["{service}"]']
    )
    proxy_b = Proxy(pool[0], config, "--host", "b", name="proxy-b")
    client = closing(openai.OpenAI(base_url=proxy_b.v1, api_key="unused", max_retries=0))
    assert [m.id for m in client.models.list()] == [service]

    # Nothing runs: a (empty, listed first) is where the pool would pick; b's proxy
    # starts it on b.
    reply = client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert "simulated reply" in (reply.choices[0].message.content or "")
    assert len(claims(pool[1], service)) == 1 and claims(pool[0], service) == []

    # The copy moves to a: b's proxy does not follow it, nor start a second on b.
    r = gpuctl_in_process(config, "stop", service, "--host", "b")
    assert r.returncode == 0, r.stderr + r.stdout
    wait_until("the copy on b to stop", lambda: claims(pool[1], service) == [])
    code, out = ensure(config, service, "--host", "a")
    assert (code, out["outcome"], out["host"]) == (0, "ready", "a"), out
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=service, messages=MSG)  # type: ignore[arg-type]
    assert refused.value.status_code == 503, refused.value
    assert "on host a, not b" in str(refused.value.body), refused.value.body
    assert claims(pool[1], service) == [] and len(claims(pool[0], service)) == 1
