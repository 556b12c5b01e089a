"""``gpuctl sim model-server``: a fake vLLM that behaves like the real one where gpuctl looks.

What it copies from vLLM (see the reference notes on vLLM readiness):

- It binds its port at once but listens only when the model is loaded, so a health
  check during the load gets *connection refused*, and a second server on the same
  port fails at once with "address already in use".
- It claims its GPU memory step by step while loading, after a first step with none
  (the window in which NVML does not see a model server yet, DESIGN §4), and dies with
  a CUDA-style out-of-memory error when a step does not fit.
- Then it serves ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``
  (JSON or SSE stream), ``GET /metrics`` (``vllm:num_requests_running``), and with
  ``--enable-sleep-mode`` ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``.
- SIGTERM/SIGINT shut it down cleanly: the memory is released and it exits 0.

Standard library and ``gpuctl.sim`` only: it also runs in a minimal container that
mounts nothing but Python and the gpuctl package, as
``python -m gpuctl.sim.model_server --name vllm --memory 80GiB --port 8000``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from gpuctl.core.units import format_mib, parse_duration_s, parse_size_mib
from gpuctl.errors import GpuctlError
from gpuctl.sim.gpu import Claim, SimGpu, SimOutOfMemory, StopFlag, stop_on_signals

_MAX_BODY = 16 * 2**20
_REPLY = "This is a simulated reply from {model}, served on a simulated GPU by gpuctl."
_log_lock = threading.Lock()


def _log(message: str, *, err: bool = False) -> None:
    """One log line, vLLM style: ``INFO ...`` on stdout, errors on stderr."""
    stream = sys.stderr if err else sys.stdout
    with _log_lock:
        try:
            stream.write(message + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed log must not take the server down


def _info(message: str) -> None:
    _log(f"INFO {message}")


class _Engine:
    """The server's state, shared by the request threads."""

    def __init__(
        self,
        claim: Claim,
        memory_mib: int,
        model_id: str,
        enable_sleep_mode: bool,
        token_delay_s: float,
        *,
        dies_at: float | None = None,
    ) -> None:
        self.dies_at = dies_at
        self.claim = claim
        self.memory_mib = memory_mib
        self.model_id = model_id
        self.enable_sleep_mode = enable_sleep_mode
        self.token_delay_s = token_delay_s
        self.started = int(time.time())
        self.lock = threading.Lock()
        self.sleep_lock = threading.Lock()  # one sleep/wake at a time
        self.running = 0
        self.succeeded = 0
        self.sleeping = False
        self.sleep_level = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count a request as running (``vllm:num_requests_running``) while it is served."""
        with self.lock:
            self.running += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            with self.lock:
                self.running -= 1
                self.succeeded += ok


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer on a socket that was bound long before it listens."""

    daemon_threads = True  # idle keep-alive connections must not hold up a shutdown
    block_on_close = False

    def __init__(self, sock: socket.socket, engine: _Engine) -> None:
        self.address_family = sock.family
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made; ours is already bound
        self.socket = sock
        self.server_address = sock.getsockname()
        self.engine = engine


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    @property
    def engine(self) -> _Engine:
        return cast(_Server, self.server).engine

    def version_string(self) -> str:
        return self.server_version

    # -- logging: uvicorn's access-log line on stdout, errors on stderr

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        _log(f'INFO:     {host}:{port} - "{self.requestline}" {code} {phrase}'.rstrip())

    def log_error(self, format: str, *args: Any) -> None:
        _log(f"ERROR {format % args}", err=True)

    # -- dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = parse_qs(url.query)
        try:
            body = self._read_body()
        except ValueError as err:
            self.close_connection = True
            self._error(HTTPStatus.BAD_REQUEST, str(err))
            return
        routes: dict[tuple[str, str], Callable[[dict[str, list[str]], bytes], None]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/metrics"): self._metrics,
        }
        if self.engine.enable_sleep_mode:
            # vLLM registers these only in its dev mode with --enable-sleep-mode; else 404.
            routes[("POST", "/sleep")] = self._sleep
            routes[("POST", "/wake_up")] = self._wake_up
            routes[("GET", "/is_sleeping")] = self._is_sleeping
        route = routes.get((method, path))
        try:
            if route is not None:
                route(query, body)
            elif any(p == path for _, p in routes):
                self._send_json(HTTPStatus.METHOD_NOT_ALLOWED, {"detail": "Method Not Allowed"})
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-answer

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ValueError("bad Content-Length") from None
        if length < 0 or length > _MAX_BODY:
            raise ValueError("request body too large")
        return self.rfile.read(length) if length else b""

    def _read_chunked(self) -> bytes:
        data = b""
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError("bad chunked request body") from None
            if size == 0:
                while self.rfile.readline(1024).strip():
                    pass  # trailers
                return data
            data += self.rfile.read(size)
            self.rfile.readline(1024)
            if len(data) > _MAX_BODY:
                raise ValueError("request body too large")

    # -- responses

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _send_json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str, kind: str = "") -> None:
        """OpenAI's error object, as vLLM sends it."""
        self._send_json(
            status,
            {
                "object": "error",
                "message": message,
                "type": kind or status.phrase.replace(" ", ""),
                "param": None,
                "code": int(status),
            },
        )

    # -- endpoints

    def _health(self, _query: dict[str, list[str]], _body: bytes) -> None:
        # 200 with an empty body, sleeping or not: vLLM's check is "the engine is not dead".
        # 503 once the engine has died (vLLM with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).
        dies_at = self.engine.dies_at
        if dies_at is not None and time.monotonic() >= dies_at:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"", "application/json")
            return
        self._send(HTTPStatus.OK, b"", "application/json")

    def _models(self, _query: dict[str, list[str]], _body: bytes) -> None:
        e = self.engine
        card = {
            "id": e.model_id,
            "object": "model",
            "created": e.started,
            "owned_by": "vllm",
            "root": e.model_id,
            "parent": None,
            "max_model_len": 32768,
            "permission": [],
        }
        self._send_json(HTTPStatus.OK, {"object": "list", "data": [card]})

    def _metrics(self, _query: dict[str, list[str]], _body: bytes) -> None:
        e = self.engine
        with e.lock:
            running, succeeded = e.running, e.succeeded
        escaped = e.model_id.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{escaped}"}}'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} 0.0\n"
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f"vllm:request_success_total{label} {float(succeeded)}\n"
        )
        self._send(HTTPStatus.OK, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _chat(self, _query: dict[str, list[str]], body: bytes) -> None:
        e = self.engine
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            self._error(HTTPStatus.BAD_REQUEST, "the request body is not valid JSON")
            return
        if not isinstance(req, dict):
            self._error(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
            return
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            self._error(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list")
            return
        model = req.get("model")
        if model is not None and model != e.model_id:
            self._error(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "NotFoundError"
            )
            return
        max_tokens = req.get("max_tokens", req.get("max_completion_tokens"))
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            self._error(HTTPStatus.BAD_REQUEST, "'max_tokens' must be a positive integer")
            return
        if e.sleeping:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is sleeping; POST /wake_up")
            return
        words = _REPLY.format(model=e.model_id).split(" ")
        base = [w if i == 0 else " " + w for i, w in enumerate(words)]
        # max_tokens makes a reply exactly that long: the way to make a request last.
        n = max_tokens if max_tokens is not None else len(base)
        tokens = [base[i % len(base)] for i in range(n)]
        finish = "length" if max_tokens is not None else "stop"
        prompt_tokens = sum(
            len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        with e.request():
            if req.get("stream"):
                opts = req.get("stream_options")
                with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                self._stream(ident, tokens, finish, usage if with_usage else None)
                return
            for _ in tokens:
                time.sleep(e.token_delay_s)
            self._send_json(
                HTTPStatus.OK,
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": e.model_id,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(tokens)},
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    ],
                    "usage": usage,
                },
            )

    def _stream(
        self, ident: str, tokens: list[str], finish: str, usage: dict[str, int] | None
    ) -> None:
        """Server-sent events in HTTP/1.1 chunks, ending with ``data: [DONE]``."""
        e = self.engine
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        created = int(time.time())

        def event(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.wfile.flush()

        def chunk(delta: dict[str, str], finish_reason: str | None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return json.dumps(
                {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": e.model_id,
                    "choices": [choice],
                }
            )

        event(chunk({"role": "assistant", "content": ""}, None))
        for tok in tokens:
            time.sleep(e.token_delay_s)
            event(chunk({"content": tok}, None))
        event(chunk({}, finish))
        if usage is not None:
            event(
                json.dumps(
                    {
                        "id": ident,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": e.model_id,
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _sleep(self, query: dict[str, list[str]], _body: bytes) -> None:
        e = self.engine
        try:
            level = int(query.get("level", ["1"])[0])
        except ValueError:
            level = -1
        if level not in (0, 1, 2):
            self._error(HTTPStatus.BAD_REQUEST, "'level' must be 0, 1 or 2")
            return
        t0 = time.monotonic()
        with e.sleep_lock:
            # Level 0 only pauses scheduling; levels 1 and 2 give the GPU memory back.
            e.claim.set(0 if level >= 1 else e.memory_mib)
            e.sleeping, e.sleep_level = True, level
        _info(f"It took {time.monotonic() - t0:.6f} seconds to fall asleep (level {level}).")
        self._send_json(HTTPStatus.OK, {"status": "sleeping", "level": level})

    def _wake_up(self, _query: dict[str, list[str]], _body: bytes) -> None:
        e = self.engine
        t0 = time.monotonic()
        with e.sleep_lock:
            if e.sleeping:
                try:
                    e.claim.set(e.memory_mib)
                except SimOutOfMemory as err:
                    message = f"torch.OutOfMemoryError: {err.message}"
                    _log(message, err=True)
                    self._error(HTTPStatus.INTERNAL_SERVER_ERROR, message, "OutOfMemoryError")
                    return
                e.sleeping, e.sleep_level = False, 0
                _info(f"It took {time.monotonic() - t0:.6f} seconds to wake up.")
        self._send_json(HTTPStatus.OK, {"status": "awake"})

    def _is_sleeping(self, _query: dict[str, list[str]], _body: bytes) -> None:
        self._send_json(HTTPStatus.OK, {"is_sleeping": self.engine.sleeping})


def _port_guard(port: int) -> socket.socket | None:
    """Hold an abstract unix socket named after the port while this server lives.

    Binding with SO_REUSEADDR (needed so a restart right after a stop is not refused
    by the old connections' TIME_WAIT) lets some kernels accept a second bind of a port
    that is bound but not listening. This name makes a second simulated server on the
    port fail at once, on every Linux kernel; the kernel drops it when we die.

    Raises:
        OSError: EADDRINUSE when another simulated server holds the port.
    """
    if not sys.platform.startswith("linux"):
        return None
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        guard.bind(f"\0gpuctl-sim-model-server-port-{port}")
    except OSError as err:
        guard.close()
        if err.errno == errno.EADDRINUSE:
            raise
        return None
    return guard


def _bind(host: str, port: int) -> socket.socket:
    """Bind (without listening) the way vLLM does before it loads its model."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        # Off while we load, so that (where the kernel checks it) another bind fails at
        # once; back on just before listen(), which checks TIME_WAIT again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except BaseException:
        sock.close()
        raise
    return sock


def _load(
    claim: Claim, memory_mib: int, load_time_s: float, *, steps: int, log_every: int, stop: StopFlag
) -> bool:
    """Claim the memory in ``steps`` equal steps over ``load_time_s``; False when stopped.

    Each step waits first: the first ``load_time_s / steps`` seconds hold no memory, like
    a server that is still importing and reading weights before its CUDA context exists.

    Raises:
        SimOutOfMemory: a step did not fit.
    """
    t0 = time.monotonic()
    for i in range(1, steps + 1):
        if not stop.sleep(t0 + load_time_s * i / steps - time.monotonic()):
            return False
        target = memory_mib * i // steps
        claim.set(target)
        if i % log_every == 0 or i == steps:
            _info(f"Loading weights step {i}/{steps} ({format_mib(target)})")
    _info(f"Model loading took {format_mib(memory_mib)} and {time.monotonic() - t0:.1f} seconds")
    return True


def run_model_server(
    sim: SimGpu,
    name: str,
    memory_mib: int,
    load_time_s: float,
    port: int,
    *,
    host: str = "127.0.0.1",
    steps: int = 10,
    model: str | None = None,
    log_every: int = 1,
    enable_sleep_mode: bool = False,
    token_delay_s: float = 0.02,
    engine_dies_after_s: float | None = None,
) -> int:
    """Run a fake vLLM on the simulated GPU until SIGTERM/SIGINT; returns the exit code.

    Args:
        sim: the simulated GPU.
        name: the claim's name (and the model id unless ``model`` is given).
        memory_mib: the memory it holds once loaded.
        load_time_s: how long loading takes (connections are refused meanwhile).
        port: the TCP port; bound at once, listened on once loaded.
        host: the address to bind.
        steps: how many steps the memory grows in.
        model: the model id ``/v1/models`` reports; default ``name``.
        log_every: log a loading line every this many steps (the last step always logs).
        enable_sleep_mode: serve ``/sleep``, ``/wake_up`` and ``/is_sleeping``.
        token_delay_s: the time each generated token takes.
        engine_dies_after_s: once loaded, /health answers 503 after this long (the
            engine died, the server lives on), for testing how callers handle it.

    Returns:
        0 after a clean stop; 1 when the port is taken, or the memory does not fit
        (a CUDA-style line on stderr).

    Raises:
        ValueError: a bad argument (steps < 1, negative times).
        GpuctlError: the sim directory cannot be written.
    """
    if steps < 1 or log_every < 1:
        raise ValueError("steps and log_every must be at least 1")
    if load_time_s < 0 or token_delay_s < 0 or memory_mib < 0:
        raise ValueError("memory, load time and token delay cannot be negative")
    model_id = model or name
    with stop_on_signals() as stop, contextlib.ExitStack() as stack:
        try:
            guard = _port_guard(port)
            if guard is not None:
                stack.callback(guard.close)
            sock = _bind(host, port)
        except OSError as err:
            reason = "address already in use" if err.errno == errno.EADDRINUSE else err.strerror
            _log(
                f"ERROR [Errno {err.errno}] error while attempting to bind on address "
                f"({host!r}, {port}): {reason}",
                err=True,
            )
            return 1
        stack.callback(sock.close)
        _info(f"vLLM API server version 0.0.0+gpuctl.sim (pid {os.getpid()})")
        _info(
            f"non-default args: model={model_id!r}, name={name!r}, host={host!r}, port={port}, "
            f"memory={format_mib(memory_mib)}, load_time={load_time_s:g}s, steps={steps}, "
            f"enable_sleep_mode={enable_sleep_mode}"
        )
        claim = stack.enter_context(sim.claim(name))
        try:
            if not _load(
                claim, memory_mib, load_time_s, steps=steps, log_every=log_every, stop=stop
            ):
                _info("Shutting down before the model was loaded")
                return 0
        except SimOutOfMemory as err:
            _log(f"torch.OutOfMemoryError: {err.message}", err=True)
            return 1
        dies_at = None
        if engine_dies_after_s is not None:
            dies_at = time.monotonic() + engine_dies_after_s
        engine = _Engine(
            claim, memory_mib, model_id, enable_sleep_mode, token_delay_s, dies_at=dies_at
        )
        server = _Server(sock, engine)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.server_activate()  # listen(): from now on connections are accepted
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        thread.start()
        shown = f"[{host}]" if ":" in host else host
        _info(f"Starting vLLM API server on http://{shown}:{port}")
        _info("Application startup complete.")
        while not stop.is_set and thread.is_alive():
            time.sleep(0.05)
        _info("Shutting down")
        server.shutdown()
        server.server_close()
        if not stop.is_set:
            _log("ERROR the HTTP server stopped on its own", err=True)
            return 1
        _info(f"Finished server process [{os.getpid()}]")
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuctl.sim.model_server``: ``gpuctl sim model-server`` without Typer."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuctl.sim.model_server", description="A fake vLLM on the simulated GPU."
    )
    parser.add_argument("--name", required=True, help="claim name (and model id by default)")
    parser.add_argument("--memory", required=True, help="memory once loaded, e.g. 80GiB")
    parser.add_argument("--load-time", default="30s", help="loading time, e.g. 30s (default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", help="model id for /v1/models (default: --name)")
    parser.add_argument("--steps", type=int, default=10, help="memory grows in this many steps")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--token-delay", default="20ms", help="time per generated token")
    parser.add_argument("--engine-dies-after", help="/health answers 503 this long after loading")
    parser.add_argument("--sim-dir", help="simulated GPU directory (default $GPUCTL_SIM_DIR)")
    parser.add_argument("--gpu-memory", help="total memory of the simulated GPU, e.g. 128GiB")
    args = parser.parse_args(argv)
    try:
        memory = parse_size_mib(args.memory)
        load_time = parse_duration_s(args.load_time)
        token_delay = parse_duration_s(args.token_delay)
        dies = parse_duration_s(args.engine_dies_after) if args.engine_dies_after else None
        total = parse_size_mib(args.gpu_memory) if args.gpu_memory else None
        if args.steps < 1:
            raise ValueError("--steps must be at least 1")
    except ValueError as err:
        parser.error(str(err))
    try:
        return run_model_server(
            SimGpu(args.sim_dir, total),
            args.name,
            memory,
            load_time,
            args.port,
            host=args.host,
            steps=args.steps,
            model=args.model,
            enable_sleep_mode=args.enable_sleep_mode,
            token_delay_s=token_delay,
            engine_dies_after_s=dies,
        )
    except GpuctlError as err:
        _log(f"error: {err.message}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
