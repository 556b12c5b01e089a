"""``gpuctl sim ollama``, driven by the official ``ollama`` and ``openai`` clients.

Each test runs the simulated Ollama as a real process on a simulated GPU in tmp_path,
and reads that GPU's claims to check what Ollama says about its memory.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from gpuctl.sim.ollama_models import normalize_model, parse_keep_alive, parse_model_spec
from tests.conftest import tagged
from tests.ollama_helpers import SimOllama, claims_mib, wait_until

GIB = 1024


COMFY = tagged("comfyui")


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    return tmp_path / "sim"


@pytest.fixture
def start(tmp_path: Path, sim_dir: Path) -> Iterator[type[SimOllama]]:
    started: list[SimOllama] = []

    class Started(SimOllama):
        def __init__(self, *args: str) -> None:
            super().__init__(sim_dir, tmp_path, *args)
            started.append(self)

    yield Started
    for s in started:
        s.kill()


@pytest.fixture
def clients() -> Iterator[list[ollama.Client | openai.OpenAI]]:
    """Clients to close at the end (an open socket is a ResourceWarning, an error here)."""
    made: list[ollama.Client | openai.OpenAI] = []
    yield made
    for c in made:
        c.close()


def ollama_client(clients: list[ollama.Client | openai.OpenAI], url: str) -> ollama.Client:
    c = ollama.Client(host=url)
    clients.append(c)
    return c


# ---------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        ("0", 0.0),
        (300, 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5s", 1.5),
        (-1, math.inf),
        ("-1", math.inf),
        ("-1m", math.inf),
    ],
)
def test_keep_alive_follows_ollama(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, None, [1], float("nan"), "1e999"])
def test_keep_alive_rejects_garbage(value: object) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_model_names_and_specs() -> None:
    assert normalize_model("qwen3") == "qwen3:latest"
    assert normalize_model("qwen3:32b") == "qwen3:32b"
    assert normalize_model("library/qwen3") == "library/qwen3:latest"
    spec = parse_model_spec("qwen3:32b=20GiB")
    assert (spec.name, spec.memory_mib) == ("qwen3:32b", 20 * GIB)
    for bad in ("qwen3", "=20GiB", "qwen3=lots", "qwen3=0"):
        with pytest.raises(ValueError, match="model"):
            parse_model_spec(bad)


# ---------------------------------------------------------------------------- a real server


def test_load_ps_and_unload_with_the_ollama_client(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "qwen3:32b=20GiB", "-m", "llama3=8GiB", "--load-time", "300ms")
    client = ollama_client(clients, srv.url)
    assert sorted(m.model or "" for m in client.list().models) == ["llama3:latest", "qwen3:32b"]
    assert client.ps().models == []
    assert claims_mib(sim_dir) == {}

    # An empty generate only loads: what gpuctl's Ollama launcher sends.
    loaded = client.generate(model="qwen3:32b", prompt="", keep_alive="10m")
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    (model,) = client.ps().models
    assert model.model == "qwen3:32b"
    assert model.size == model.size_vram == 20 * 2**30
    assert claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}

    reply = client.chat(model="qwen3:32b", messages=[{"role": "user", "content": "hi"}])
    assert reply.done and "simulated reply" in reply.message.content

    gone = client.generate(model="qwen3:32b", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    assert client.ps().models == []
    assert claims_mib(sim_dir) == {}
    assert srv.stop() == 0


def test_streams_and_errors_with_the_ollama_client(
    start: type[SimOllama], clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB", "--load-time", "0s")
    client = ollama_client(clients, srv.url)
    parts = list(
        client.generate(model="llama3", prompt="hi", stream=True, options={"num_predict": 3})
    )
    assert [p.done for p in parts] == [False, False, False, True]
    assert "".join(p.response or "" for p in parts) == "This is a"
    assert parts[-1].eval_count == 3
    chat = list(
        client.chat(
            model="llama3", messages=[{"role": "user", "content": "x"}], stream=True,
            options={"num_predict": 2},
        )
    )  # fmt: skip
    assert "".join(p.message.content or "" for p in chat) == "This is"

    with pytest.raises(ollama.ResponseError) as missing:
        client.generate(model="nope", prompt="x")
    assert missing.value.status_code == 404
    assert "not found" in missing.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        client.generate(model="llama3", prompt="x", keep_alive="soon")
    assert bad.value.status_code == 400
    assert "keep_alive" in bad.value.error
    # Hostile bodies are 400s, never a crash.
    for body in (b"[", b"[1]", b'{"model": 5}', b'{"model": "llama3", "prompt": 5}'):
        r = httpx.post(srv.url + "/api/generate", content=body, timeout=5)
        assert r.status_code == 400, body
        assert "error" in r.json()
    assert httpx.get(srv.url + "/api/nope", timeout=5).status_code == 404
    assert httpx.get(srv.url + "/api/generate", timeout=5).status_code == 405
    assert httpx.head(srv.url + "/", timeout=5).status_code == 200


def test_openai_compatible_endpoint_with_the_openai_client(
    start: type[SimOllama], clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "qwen3:32b=20GiB", "--load-time", "0s")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="ollama", max_retries=0)
    clients.append(client)
    assert [m.id for m in client.models.list()] == ["qwen3:32b"]
    done = client.chat.completions.create(
        model="qwen3:32b", messages=[{"role": "user", "content": "x"}], max_tokens=4
    )
    assert done.choices[0].message.content == "This is a simulated"
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model="qwen3:32b",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "This is a"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens >= 3
    assert "qwen3:32b" in srv.ps()  # the OpenAI endpoint loads the model too
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_keep_alive_runs_out_by_itself(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB", "--load-time", "0s")
    client = ollama_client(clients, srv.url)
    client.generate(model="llama3", prompt="", keep_alive="1s")
    assert claims_mib(sim_dir) == {"ollama llama3:latest": 8 * GIB}
    # Nobody asks: the server's own loop unloads it.
    wait_until("the model to unload after its keep_alive", lambda: claims_mib(sim_dir) == {})
    assert srv.ps() == {}


def test_a_request_in_flight_holds_its_model_through_keep_alive_zero(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB", "--load-time", "0s", "--token-delay", "50ms")
    client = ollama_client(clients, srv.url)
    seen: list[str] = []
    first = threading.Event()

    def long_request() -> None:
        for part in client.generate(
            model="llama3", prompt="hi", stream=True, options={"num_predict": 40}
        ):
            seen.append(part.response or "")
            first.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert first.wait(10)
    assert client.generate(model="llama3", prompt="", keep_alive=0).done_reason == "unload"
    # The request is still streaming: the model stays, with its memory.
    assert t.is_alive()
    assert "llama3:latest" in srv.ps()
    assert claims_mib(sim_dir) == {"ollama llama3:latest": 8 * GIB}
    t.join(20)
    assert len(seen) == 41  # 40 tokens and the final object: nothing was cut
    wait_until("the model to unload once its request ended", lambda: srv.ps() == {})
    assert claims_mib(sim_dir) == {}


def test_concurrent_requests_share_one_load(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "qwen3:32b=20GiB", "--load-time", "1s")
    client = ollama_client(clients, srv.url)
    reasons: list[str | None] = []

    def load() -> None:
        reasons.append(client.generate(model="qwen3:32b", prompt="").done_reason)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert reasons == ["load"] * 6
    assert srv.output().count("INFO loading qwen3:32b") == 1
    assert claims_mib(sim_dir) == {"ollama qwen3:32b": 20 * GIB}


def test_no_room_evicts_idle_models_then_offloads_to_cpu(
    start: type[SimOllama],
    sim_dir: Path,
    tmp_path: Path,
    clients: list[ollama.Client | openai.OpenAI],
) -> None:
    srv = start("-m", "big=20GiB", "-m", "small=8GiB", "--load-time", "0s", "--gpu-memory", "24GiB")
    client = ollama_client(clients, srv.url)
    client.generate(model="small", prompt="")
    assert claims_mib(sim_dir) == {"ollama small:latest": 8 * GIB}
    # 20 GiB does not fit beside 8 GiB on 24 GiB: Ollama unloads the idle one first.
    client.generate(model="big", prompt="")
    assert claims_mib(sim_dir) == {"ollama big:latest": 20 * GIB}
    assert set(srv.ps()) == {"big:latest"}
    client.generate(model="big", prompt="", keep_alive=0)

    # Someone else holds 10 GiB: the model is split, part on the GPU, the rest on the CPU.
    holder = subprocess.Popen(
        [sys.executable, "-m", "gpuctl", "sim", "hold", "--name", COMFY, "--memory", "10GiB",
         "--sim-dir", str(sim_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until("the holder on the GPU", lambda: COMFY in claims_mib(sim_dir))
        client.generate(model="big", prompt="")
        (model,) = client.ps().models
        assert model.size == 20 * 2**30
        assert model.size_vram == 14 * 2**30  # what was free; never more than the GPU has
        assert claims_mib(sim_dir)["ollama big:latest"] == 14 * GIB
    finally:
        holder.kill()
        holder.wait(10)


def test_sigterm_unloads_everything(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB", "--load-time", "0s", "--keep-alive", "-1")
    ollama_client(clients, srv.url).generate(model="llama3", prompt="")
    assert "llama3:latest" in srv.ps()
    assert claims_mib(sim_dir) != {}
    assert srv.stop() == 0
    assert claims_mib(sim_dir) == {}


def test_kill_9_frees_the_memory(
    start: type[SimOllama], sim_dir: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB", "--load-time", "0s")
    ollama_client(clients, srv.url).generate(model="llama3", prompt="")
    srv.kill()
    assert claims_mib(sim_dir) == {}


def test_port_taken_and_bad_options(
    start: type[SimOllama], tmp_path: Path, clients: list[ollama.Client | openai.OpenAI]
) -> None:
    srv = start("-m", "llama3=8GiB")
    second = subprocess.run(
        [sys.executable, "-m", "gpuctl", "sim", "ollama", "--port", str(srv.port),
         "--sim-dir", str(tmp_path / "sim")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert second.returncode == 1
    assert "bind" in second.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "gpuctl", "sim", "ollama", "-m", "llama3"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "NAME=SIZE" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_pull_show_and_embed_with_the_ollama_client(
    start: type[SimOllama], clients: list[ollama.Client | openai.OpenAI], sim_dir: Path
) -> None:
    """What a client meets first besides chat: a pull of a model the library has (at
    once; another is not in the registry), its details (nothing loaded), embeddings
    (the model loads, as Ollama's do); a 404 says the connection closes."""
    srv = start("-m", "nomic-embed-text=1GiB", "--load-time", "0s")
    client = ollama_client(clients, srv.url)
    steps = list(client.pull("nomic-embed-text", stream=True))
    assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
    assert client.pull("nomic-embed-text").status == "success"
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("nope:1b")
    assert missing.value.status_code == 404

    shown = client.show("nomic-embed-text")
    assert shown.details is not None and shown.details.family == "nomic-embed-text"
    assert client.ps().models == [] and claims_mib(sim_dir) == {}

    emb = client.embed(model="nomic-embed-text", input=["a", "b"])
    assert len(emb.embeddings) == 2 and all(len(v) == 16 for v in emb.embeddings)
    assert emb.embeddings[0] != emb.embeddings[1]
    assert [m.model for m in client.ps().models] == ["nomic-embed-text:latest"]

    # done_reason is "length" only when num_predict cut the answer: its reply sentence
    # (12 tokens), said again as often as num_predict asks.
    reasons = [
        client.generate(
            model="nomic-embed-text", prompt="hi", options={"num_predict": n}
        ).done_reason
        for n in (12, 24, 5)
    ]
    assert reasons == ["stop", "stop", "length"]

    r = httpx.get(srv.url + "/api/nope", timeout=5)
    assert r.status_code == 404 and r.headers["connection"] == "close"
