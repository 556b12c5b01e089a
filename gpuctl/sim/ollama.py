"""``gpuctl sim ollama``: a fake Ollama server on the simulated GPU.

It behaves like Ollama where gpuctl (and Ollama's own clients) look:

- It listens at once (Ollama's server does; its *models* load on demand) and answers
  ``GET /`` with "Ollama is running".
- A request for a model loads it first: the model's memory is claimed on the simulated
  GPU step by step over ``load_time``, one load at a time (Ollama's scheduler handles
  pending loads one by one), and requests for a model that is loading wait for it.
- ``/api/ps`` lists the loaded models, and those still loading (Ollama lists a runner
  from the moment its load begins), with ``size``, ``size_vram`` and ``expires_at``.
- ``keep_alive`` follows Ollama's rules: a duration (``"5m"``, seconds as a number), a
  negative one keeps the model forever, ``0`` unloads it once its requests are done; an
  empty ``/api/generate`` or ``/api/chat`` only loads (``done_reason: "load"``), or with
  ``keep_alive: 0`` only unloads (``done_reason: "unload"``). The default is
  ``--keep-alive`` (Ollama's ``OLLAMA_KEEP_ALIVE``, 5m). A model with a request in
  flight is never unloaded; its clock starts when its last request ends.
- A model that does not fit beside the others first evicts this server's idle models
  (Ollama's ``findRunnerToUnload``); what still does not fit is offloaded to the CPU,
  so ``size_vram`` is less than ``size`` ("48%/52% CPU/GPU" in ``ollama ps``).
- It serves ``/api/generate``, ``/api/chat`` (NDJSON streams by default, as Ollama),
  ``/api/tags``, ``/api/version``, and Ollama's OpenAI-compatible ``/v1/models`` and
  ``/v1/chat/completions`` (JSON or SSE).

Unlike Ollama, which runs one runner process per loaded model, this server holds each
model as a claim of its own process: the simulated probe shows one process with their
sum, as NVML shows a process with several CUDA allocations.

Standard library and ``gpuctl.core`` / ``gpuctl.sim`` only, so it also runs as
``python -m gpuctl.sim.ollama --model qwen3:32b=20GiB`` in a minimal container.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

from gpuctl.core.units import format_mib, parse_duration_s, parse_size_mib
from gpuctl.sim import openai_shapes
from gpuctl.sim.console import log
from gpuctl.sim.errors import SimError
from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.ollama_http import REPLY, Server
from gpuctl.sim.ollama_models import (
    DEFAULT_KEEP_ALIVE_S,
    ModelSpec,
    Ollama,
    iso_time,
    normalize_model,
    parse_keep_alive,
    parse_model_spec,
)
from gpuctl.sim.ollama_openai import OpenAIEndpoints
from gpuctl.sim.signals import StopFlag, stop_on_signals

DEFAULT_PORT = 11434
VERSION = "0.0.0+gpuctl.sim"


class _Handler(OpenAIEndpoints):
    """Ollama's native API, beside the OpenAI-compatible one."""

    def routes(self) -> dict[tuple[str, str], Callable[[dict[str, Any]], None]]:
        return {
            ("GET", "/"): self._root,
            ("GET", "/api/version"): self._version,
            ("GET", "/api/tags"): self._tags,
            ("GET", "/api/ps"): self._ps,
            ("POST", "/api/generate"): self._generate,
            ("POST", "/api/chat"): self._chat,
            ("POST", "/api/embed"): self._embed,
            ("POST", "/api/show"): self._show,
            ("POST", "/api/pull"): self._pull,
            ("GET", "/v1/models"): self._v1_models,
            ("POST", "/v1/chat/completions"): self._v1_chat,
        }

    def _root(self, _body: dict[str, Any]) -> None:
        self._send(HTTPStatus.OK, b"Ollama is running", "text/plain; charset=utf-8")

    def _version(self, _body: dict[str, Any]) -> None:
        self._json(HTTPStatus.OK, {"version": VERSION})

    def _tags(self, _body: dict[str, Any]) -> None:
        self._json(HTTPStatus.OK, {"models": self.ollama.tags()})

    def _ps(self, _body: dict[str, Any]) -> None:
        self.ollama.expire()
        self._json(HTTPStatus.OK, {"models": self.ollama.ps()})

    def _generate(self, body: dict[str, Any]) -> None:
        found = self._model_and_keep_alive(body)
        if found is None:
            return
        name, keep = found
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            self._json(HTTPStatus.BAD_REQUEST, {"error": "prompt must be a string"})
            return
        if not prompt:
            self._load_only(name, keep, {"model": name, "response": ""})
            return
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        tokens = self._tokens(name, cast(dict[str, Any], options).get("num_predict"))
        t0 = time.monotonic()

        def piece(tok: str) -> dict[str, Any]:
            return {
                "model": name,
                "created_at": iso_time(time.time()),
                "response": tok,
                "done": False,
            }

        def final(text: str, load_s: float) -> dict[str, Any]:
            return {
                "model": name,
                "created_at": iso_time(time.time()),
                "response": text,
                "done": True,
                "done_reason": openai_shapes.finish_reason(len(tokens), len(REPLY.split(" "))),
                "context": [1, 2, 3],
                **self._final_stats(t0, load_s, len(prompt.split()), len(tokens)),
            }

        stream = body.get("stream", True) is not False  # Ollama streams unless told not to
        self._generate_tokens(name, keep, tokens, stream=stream, piece=piece, final=final)

    def _chat(self, body: dict[str, Any]) -> None:
        found = self._model_and_keep_alive(body)
        if found is None:
            return
        name, keep = found
        messages = body.get("messages")
        if messages is not None and not isinstance(messages, list):
            self._json(HTTPStatus.BAD_REQUEST, {"error": "messages must be a list"})
            return
        if not messages:
            self._load_only(
                name, keep, {"model": name, "message": {"role": "assistant", "content": ""}}
            )
            return
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        tokens = self._tokens(name, cast(dict[str, Any], options).get("num_predict"))
        prompt = sum(
            len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)
        )
        t0 = time.monotonic()

        def piece(tok: str) -> dict[str, Any]:
            return {
                "model": name,
                "created_at": iso_time(time.time()),
                "message": {"role": "assistant", "content": tok},
                "done": False,
            }

        def final(text: str, load_s: float) -> dict[str, Any]:
            return {
                "model": name,
                "created_at": iso_time(time.time()),
                "message": {"role": "assistant", "content": text},
                "done": True,
                "done_reason": openai_shapes.finish_reason(len(tokens), len(REPLY.split(" "))),
                **self._final_stats(t0, load_s, prompt, len(tokens)),
            }

        stream = body.get("stream", True) is not False  # Ollama streams unless told not to
        self._generate_tokens(name, keep, tokens, stream=stream, piece=piece, final=final)

    def _known(self, body: dict[str, Any]) -> str | None:
        """The request's model (``model``, or the older ``name``), normalised, when the
        library has it; else None after answering 404 (or 400 without one)."""
        model = body.get("model", body.get("name"))
        if not isinstance(model, str) or not model.strip():
            self._json(HTTPStatus.BAD_REQUEST, {"error": "model is required"})
            return None
        name: str = normalize_model(model)
        if name not in self.ollama.library:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"model '{model}' not found"})
            return None
        return name

    def _show(self, body: dict[str, Any]) -> None:
        """``POST /api/show``: a model's details; nothing is loaded."""
        name = self._known(body)
        if name is None:
            return
        spec = self.ollama.library[name]
        self._json(
            HTTPStatus.OK,
            {
                "modelfile": f"FROM {name}\n",
                "parameters": "",
                "template": "{{ .Prompt }}",
                "details": spec.details(),
                "model_info": {"general.parameter_count": spec.size_bytes // 2},
                "capabilities": ["completion", "embedding"],
                "modified_at": iso_time(0.0),
            },
        )

    def _pull(self, body: dict[str, Any]) -> None:
        """``POST /api/pull``: the simulated library has every model it was given, so a
        pull of one of them succeeds at once (its progress, then ``success``); any other
        is not in the registry. Nothing is loaded."""
        name = self._known(body)
        if name is None:
            return
        spec = self.ollama.library[name]
        steps = [
            {"status": "pulling manifest"},
            {
                "status": f"pulling {spec.digest[:12]}",
                "digest": f"sha256:{spec.digest}",
                "total": spec.size_bytes,
                "completed": spec.size_bytes,
            },
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ]
        if body.get("stream", True) is False:
            self._json(HTTPStatus.OK, steps[-1])
            return
        self._start_chunks("application/x-ndjson")
        for step in steps:
            self._chunk(json.dumps(step).encode() + b"\n")
        self._end_chunks()

    def _embed(self, body: dict[str, Any]) -> None:
        """``POST /api/embed``: loads the model as a generation would, and answers a
        vector per input (``openai_shapes.embedding``)."""
        found = self._model_and_keep_alive(body)
        if found is None:
            return
        name, keep = found
        texts = openai_shapes.inputs(body.get("input"))
        if texts is None:
            self._json(HTTPStatus.BAD_REQUEST, {"error": "input must be a string or a list"})
            return
        t0 = time.monotonic()
        try:
            with self.ollama.use(name, keep):
                load_s = time.monotonic() - t0
        except RuntimeError as err:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(err)})
            return
        total_ns = int((time.monotonic() - t0) * 1e9)
        self._json(
            HTTPStatus.OK,
            {
                "model": name,
                "embeddings": [openai_shapes.embedding(t) for t in texts],
                "total_duration": total_ns,
                "load_duration": int(load_s * 1e9),
                "prompt_eval_count": sum(len(t.split()) for t in texts),
            },
        )


def run_ollama(
    sim: SimGpu,
    models: list[ModelSpec],
    port: int = DEFAULT_PORT,
    *,
    host: str = "127.0.0.1",
    load_time_s: float = 2.0,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    token_delay_s: float = 0.02,
    stop: StopFlag | None = None,
) -> int:
    """Serve a fake Ollama until SIGTERM/SIGINT; returns the exit code.

    Returns:
        0 after a clean stop (every model unloaded), 1 when the port is taken.
    """
    if not models:
        raise ValueError("at least one model is needed")
    ollama = Ollama(
        sim, models, load_time_s=load_time_s, keep_alive_s=keep_alive_s, token_delay_s=token_delay_s
    )
    with contextlib.ExitStack() as stack:
        flag = stop if stop is not None else stack.enter_context(stop_on_signals())
        try:
            server = Server((host, port), ollama, _Handler)
        except OSError as err:
            log(f"Error: listen tcp {host}:{port}: bind: {err.strerror}", err=True)
            return 1
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        thread.start()
        names = ", ".join(f"{m.name} ({format_mib(m.memory_mib)})" for m in models)
        log(f"INFO Listening on {host}:{server.server_address[1]} (version {VERSION})")
        log(f"INFO models: {names}")
        try:
            while not flag.is_set and thread.is_alive():
                flag.sleep(0.25)
                ollama.expire()  # keep_alive runs out even when nobody asks
        finally:
            server.shutdown()
            server.server_close()
            ollama.release_all()
        log("INFO Ollama stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuctl.sim.ollama``: ``gpuctl sim ollama`` without Typer."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuctl.sim.ollama", description="A fake Ollama on the simulated GPU."
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="NAME=SIZE of a model it can load, e.g. qwen3:32b=20GiB (repeatable)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-time", default="2s", help="how long a model takes to load")
    parser.add_argument("--keep-alive", default="5m", help="default keep_alive (-1: forever)")
    parser.add_argument("--token-delay", default="20ms", help="time per generated token")
    parser.add_argument("--sim-dir", help="simulated GPU directory (default $GPUCTL_SIM_DIR)")
    parser.add_argument("--gpu-memory", help="total memory of the simulated GPU, e.g. 128GiB")
    args = parser.parse_args(argv)
    try:
        models = [parse_model_spec(m) for m in args.model or ["qwen3:32b=20GiB"]]
        load_time = parse_duration_s(args.load_time, allow_zero=True)
        keep_alive = parse_keep_alive(args.keep_alive)
        token_delay = parse_duration_s(args.token_delay, allow_zero=True)
        total = parse_size_mib(args.gpu_memory) if args.gpu_memory else None
    except ValueError as err:
        parser.error(str(err))
    try:
        return run_ollama(
            SimGpu(args.sim_dir, total),
            models,
            args.port,
            host=args.host,
            load_time_s=load_time,
            keep_alive_s=keep_alive,
            token_delay_s=token_delay,
        )
    except SimError as err:
        log(f"Error: {err.message}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
