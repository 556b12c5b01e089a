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
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlsplit

from gpuctl.core.units import format_mib, parse_duration_s, parse_size_mib
from gpuctl.sim.console import log
from gpuctl.sim.errors import SimError
from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.ollama_models import (
    DEFAULT_KEEP_ALIVE_S,
    ModelSpec,
    Ollama,
    iso_time,
    normalize_model,
    parse_keep_alive,
    parse_model_spec,
)
from gpuctl.sim.signals import StopFlag, stop_on_signals

DEFAULT_PORT = 11434
VERSION = "0.0.0+gpuctl.sim"
_MAX_BODY = 16 * 2**20
_REPLY = "This is a simulated reply from {model}, served by a simulated Ollama."


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], ollama: Ollama) -> None:
        super().__init__(address, _Handler)
        self.ollama = ollama


class _BadRequest(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ollama"
    sys_version = ""

    @property
    def ollama(self) -> Ollama:
        return cast(_Server, self.server).ollama

    def version_string(self) -> str:
        return self.server_version

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log(f'[GIN] {code} | {self.client_address[0]} | {self.command} "{self.path}"')

    def log_error(self, format: str, *args: Any) -> None:
        log(f"ERROR {format % args}", err=True)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        routes: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {
            ("GET", "/"): self._root,
            ("GET", "/api/version"): self._version,
            ("GET", "/api/tags"): self._tags,
            ("GET", "/api/ps"): self._ps,
            ("POST", "/api/generate"): self._generate,
            ("POST", "/api/chat"): self._chat,
            ("GET", "/v1/models"): self._v1_models,
            ("POST", "/v1/chat/completions"): self._v1_chat,
        }
        head = method == "HEAD"
        route = routes.get(("GET" if head else method, path))
        try:
            if route is None:
                self.close_connection = True
                status = (
                    HTTPStatus.METHOD_NOT_ALLOWED
                    if any(p == path for _, p in routes)
                    else HTTPStatus.NOT_FOUND
                )
                self._send(status, b"404 page not found" if status == 404 else b"", "text/plain")
                return
            try:
                body = self._read_json() if method == "POST" else {}
            except _BadRequest as err:
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
                return
            if head:
                self._head = True
            route(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-answer

    _head = False

    def _read_json(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise _BadRequest("bad Content-Length") from None
        if length < 0 or length > _MAX_BODY:
            self.close_connection = True
            raise _BadRequest("request body too large")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            raise _BadRequest("invalid character in the JSON request body") from None
        if not isinstance(data, dict):
            raise _BadRequest("the request body must be a JSON object")
        return data

    # -- responses

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not self._head:
            self.wfile.write(body)
        self.wfile.flush()

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json; charset=utf-8")

    def _openai_error(self, status: int, message: str, kind: str) -> None:
        self._json(
            status, {"error": {"message": message, "type": kind, "param": None, "code": None}}
        )

    def _start_chunks(self, content_type: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # -- plumbing shared by the endpoints

    def _model_and_keep_alive(self, body: dict[str, Any]) -> tuple[str, float | None] | None:
        """The request's model (normalised) and keep_alive; None after answering an error."""
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            self._json(HTTPStatus.BAD_REQUEST, {"error": "model is required"})
            return None
        keep: float | None = None
        if body.get("keep_alive") is not None:
            try:
                keep = parse_keep_alive(body["keep_alive"])
            except ValueError as err:
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
                return None
        name = normalize_model(model)
        if name not in self.ollama.library:
            self._json(
                HTTPStatus.NOT_FOUND,
                {"error": f'model "{model}" not found, try pulling it first'},
            )
            return None
        return name, keep

    def _tokens(self, model: str, max_tokens: object) -> list[str]:
        words = _REPLY.format(model=model).split(" ")
        base = [w if i == 0 else " " + w for i, w in enumerate(words)]
        n = len(base)
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
            n = max_tokens  # the way to make a request last: num_predict / max_tokens
        return [base[i % len(base)] for i in range(n)]

    def _final_stats(self, t0: float, load_s: float, prompt: int, n: int) -> dict[str, Any]:
        total_ns = int((time.monotonic() - t0) * 1e9)
        return {
            "total_duration": total_ns,
            "load_duration": int(load_s * 1e9),
            "prompt_eval_count": prompt,
            "prompt_eval_duration": 1000,
            "eval_count": n,
            "eval_duration": max(0, total_ns - int(load_s * 1e9)),
        }

    def _load_only(self, name: str, keep: float | None, base: dict[str, Any]) -> None:
        """An empty request: load (or with ``keep_alive: 0`` unload) and say which."""
        now = iso_time(time.time())
        if keep == 0:
            self.ollama.unload(name)
            self._json(
                HTTPStatus.OK, {**base, "created_at": now, "done": True, "done_reason": "unload"}
            )
            return
        try:
            with self.ollama.use(name, keep):
                pass
        except RuntimeError as err:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(err)})
            return
        self._json(HTTPStatus.OK, {**base, "created_at": now, "done": True, "done_reason": "load"})

    def _generate_tokens(
        self,
        name: str,
        keep: float | None,
        tokens: list[str],
        *,
        stream: bool,
        piece: Callable[[str], dict[str, Any]],
        final: Callable[[str, float], dict[str, Any]],
    ) -> None:
        """Serve a generation in Ollama's NDJSON stream, or as one object."""
        t0 = time.monotonic()
        try:
            with self.ollama.use(name, keep):
                load_s = time.monotonic() - t0
                if stream:
                    self._start_chunks("application/x-ndjson")
                    for tok in tokens:
                        time.sleep(self.ollama.token_delay_s)
                        self._chunk(json.dumps(piece(tok)).encode() + b"\n")
                    self._chunk(json.dumps(final("", load_s)).encode() + b"\n")
                    self._end_chunks()
                    return
                for _ in tokens:
                    time.sleep(self.ollama.token_delay_s)
                self._json(HTTPStatus.OK, final("".join(tokens), load_s))
        except RuntimeError as err:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(err)})

    # -- endpoints

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
                "done_reason": "length" if len(tokens) != len(_REPLY.split(" ")) else "stop",
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
                "done_reason": "length" if len(tokens) != len(_REPLY.split(" ")) else "stop",
                **self._final_stats(t0, load_s, prompt, len(tokens)),
            }

        stream = body.get("stream", True) is not False  # Ollama streams unless told not to
        self._generate_tokens(name, keep, tokens, stream=stream, piece=piece, final=final)

    def _v1_models(self, _body: dict[str, Any]) -> None:
        data = [
            {"id": m["name"], "object": "model", "created": 0, "owned_by": "library"}
            for m in self.ollama.tags()
        ]
        self._json(HTTPStatus.OK, {"object": "list", "data": data})

    def _v1_chat(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            self._openai_error(HTTPStatus.BAD_REQUEST, "model is required", "invalid_request_error")
            return
        name = normalize_model(model)
        if name not in self.ollama.library:
            self._openai_error(
                HTTPStatus.NOT_FOUND,
                f'model "{model}" not found, try pulling it first',
                "api_error",
            )
            return
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            self._openai_error(
                HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", "invalid_request_error"
            )
            return
        tokens = self._tokens(name, body.get("max_tokens", body.get("max_completion_tokens")))
        finish = "length" if len(tokens) != len(_REPLY.split(" ")) else "stop"
        prompt = sum(
            len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)
        )
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(tokens),
            "total_tokens": prompt + len(tokens),
        }
        ident = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        try:
            with self.ollama.use(name, None):
                if body.get("stream"):
                    self._v1_stream(
                        ident, created, name, tokens=tokens, finish=finish, usage=usage, body=body
                    )
                    return
                for _ in tokens:
                    time.sleep(self.ollama.token_delay_s)
                message = {"role": "assistant", "content": "".join(tokens)}
                choice = {"index": 0, "message": message, "finish_reason": finish}
                self._json(
                    HTTPStatus.OK,
                    {
                        "id": ident,
                        "object": "chat.completion",
                        "created": created,
                        "model": name,
                        "system_fingerprint": "fp_ollama",
                        "choices": [choice],
                        "usage": usage,
                    },
                )
        except RuntimeError as err:
            self._openai_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(err), "api_error")

    def _v1_stream(
        self,
        ident: str,
        created: int,
        name: str,
        *,
        tokens: list[str],
        finish: str,
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> None:
        self._start_chunks("text/event-stream")

        def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            obj = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "system_fingerprint": "fp_ollama",
                "choices": choices,
                **extra,
            }
            self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

        for tok in tokens:
            time.sleep(self.ollama.token_delay_s)
            delta = {"role": "assistant", "content": tok}
            event([{"index": 0, "delta": delta, "finish_reason": None}])
        event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": finish}]
        )
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            event([], usage=usage)
        self._chunk(b"data: [DONE]\n\n")
        self._end_chunks()


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
            server = _Server((host, port), ollama)
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
