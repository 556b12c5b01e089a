"""The fake vLLM's HTTP API: OpenAI chat completions (JSON or SSE), models, health,
metrics and the sleep-mode endpoints, on a socket bound long before it listens."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from gpuctl.sim import openai_shapes, sleep_mode
from gpuctl.sim.console import log
from gpuctl.sim.engine import Engine, Request

_MAX_BODY = 16 * 2**20
_REPLY = "This is a simulated reply from {model}, served on a simulated GPU by gpuctl."


class Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer on a socket that was bound long before it listens."""

    daemon_threads = True  # idle keep-alive connections must not hold up a shutdown
    # vLLM (uvicorn) listens with a backlog of 2048; socketserver's 5 reset connections
    # as soon as a few dozen clients connect at once.
    request_queue_size = 2048
    block_on_close = False

    def __init__(self, sock: socket.socket, engine: Engine) -> None:
        self.address_family = sock.family
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made; ours is already bound
        self.socket = sock
        self.server_address = sock.getsockname()
        self.engine = engine


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body waits
    # for the client's delayed ACK (40 ms a request). uvicorn, and so vLLM, set NODELAY.
    disable_nagle_algorithm = True
    server_version = "uvicorn"
    sys_version = ""

    @property
    def engine(self) -> Engine:
        return cast(Server, self.server).engine

    def version_string(self) -> str:
        return self.server_version

    # -- logging: uvicorn's access-log line on stdout, errors on stderr

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        log(f'INFO:     {host}:{port} - "{self.requestline}" {code} {phrase}'.rstrip())

    def log_error(self, format: str, *args: Any) -> None:
        log(f"ERROR {format % args}", err=True)

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
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/v1/audio/transcriptions"): self._transcriptions,
            ("GET", "/metrics"): self._metrics,
        }
        if self.engine.enable_sleep_mode:
            # vLLM registers these only in its dev mode with --enable-sleep-mode; else 404.
            routes[("POST", "/sleep")] = self._sleep
            routes[("POST", "/wake_up")] = self._wake_up
            routes[("GET", "/is_sleeping")] = self._is_sleeping
            routes[("POST", "/collective_rpc")] = self._collective_rpc
        route = routes.get((method, path))
        if route is None and method == "GET" and path.startswith("/v1/models/"):
            route = self._model_card
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
        if self.close_connection:  # said, as uvicorn does, before it closes
            self.send_header("Connection", "close")
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
        self._send_json(HTTPStatus.OK, {"object": "list", "data": [self._card()]})

    def _model_card(self, _query: dict[str, list[str]], _body: bytes) -> None:
        """``GET /v1/models/{id}``: the card of the model it serves, else 404."""
        from urllib.parse import unquote

        wanted = unquote(urlsplit(self.path).path[len("/v1/models/") :])
        if wanted != self.engine.model_id:
            self._error(
                HTTPStatus.NOT_FOUND, f"The model `{wanted}` does not exist.", "NotFoundError"
            )
            return
        self._send_json(HTTPStatus.OK, self._card())

    def _card(self) -> dict[str, Any]:
        e = self.engine
        return {
            "id": e.model_id,
            "object": "model",
            "created": e.started,
            "owned_by": "vllm",
            "root": e.model_id,
            "parent": None,
            "max_model_len": 32768,
            "permission": [],
        }

    def _metrics(self, _query: dict[str, list[str]], _body: bytes) -> None:
        e = self.engine
        text = e.metrics.render(e.model_id, e.gauges())
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
        if e.weights_lost:
            # Woken from a level-2 sleep without reload_weights: vLLM computes with
            # whatever the memory holds, and answers nonsense.
            words = ["!!!!"] * len(words)
        base = [w if i == 0 else " " + w for i, w in enumerate(words)]
        # max_tokens makes a reply exactly that long: the way to make a request last.
        n = max_tokens if max_tokens is not None else len(base)
        tokens = [base[i % len(base)] for i in range(n)]
        finish = openai_shapes.finish_reason(n, len(base))
        prompt_tokens = sum(
            len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        with e.request(prompt_tokens) as tracker:
            epoch = e.epoch
            if req.get("stream"):
                opts = req.get("stream_options")
                with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                try:
                    self._stream(ident, tokens, finish, usage if with_usage else None, tracker)
                except (BrokenPipeError, ConnectionResetError):
                    # The client went away: vLLM aborts the request and frees its slot.
                    with e.lock:
                        e.cancelled += 1
                    log(f"INFO:     Aborted request {ident}.")
                    raise
                return
            for i in range(len(tokens)):
                time.sleep(e.token_delay_s)
                if e.epoch != epoch:  # put to sleep in "abort" mode: the request ends here
                    tokens, finish = tokens[:i], "abort"
                    break
                tracker.token()
            tracker.end()
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

    def _request(self, body: bytes) -> dict[str, Any] | None:
        """The JSON object of a request naming this model (or none); None once refused."""
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            self._error(HTTPStatus.BAD_REQUEST, "the request body is not valid JSON")
            return None
        if not isinstance(req, dict):
            self._error(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
            return None
        model = req.get("model")
        if model is not None and model != self.engine.model_id:
            self._error(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "NotFoundError"
            )
            return None
        if self.engine.sleeping:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is sleeping; POST /wake_up")
            return None
        return req

    def _completions(self, _query: dict[str, list[str]], body: bytes) -> None:
        """``POST /v1/completions``: the legacy text completion, JSON (no stream)."""
        e = self.engine
        req = self._request(body)
        if req is None:
            return
        prompt = req.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            self._error(HTTPStatus.BAD_REQUEST, "'prompt' must be a non-empty string or list")
            return
        max_tokens = req.get("max_tokens", 16)  # OpenAI's default for completions
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            self._error(HTTPStatus.BAD_REQUEST, "'max_tokens' must be a positive integer")
            return
        words = _REPLY.format(model=e.model_id).split(" ")
        base = [w if i == 0 else " " + w for i, w in enumerate(words)]
        tokens = [base[i % len(base)] for i in range(max_tokens)]
        prompt_tokens = len(str(prompt).split())
        with e.request(prompt_tokens) as tracker:
            for _ in tokens:
                time.sleep(e.token_delay_s)
                tracker.token()
        self._send_json(
            HTTPStatus.OK,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": e.model_id,
                "choices": [
                    {"index": 0, "text": "".join(tokens), "logprobs": None,
                     "finish_reason": openai_shapes.finish_reason(len(tokens), len(base))}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(tokens),
                    "total_tokens": prompt_tokens + len(tokens),
                },
            },
        )  # fmt: skip

    def _embeddings(self, _query: dict[str, list[str]], body: bytes) -> None:
        """``POST /v1/embeddings``: a vector per input (``openai_shapes.embedding``)."""
        req = self._request(body)
        if req is None:
            return
        texts = openai_shapes.inputs(req.get("input"))
        if texts is None:
            self._error(HTTPStatus.BAD_REQUEST, "'input' must be a string or a list of them")
            return
        fmt = req.get("encoding_format", "float")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": openai_shapes.encoded(openai_shapes.embedding(t), fmt),
            }
            for i, t in enumerate(texts)
        ]
        n = sum(len(t.split()) for t in texts)
        with self.engine.request(n):
            pass
        self._send_json(
            HTTPStatus.OK,
            {
                "object": "list",
                "data": data,
                "model": self.engine.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            },
        )

    def _transcriptions(self, _query: dict[str, list[str]], body: bytes) -> None:
        """``POST /v1/audio/transcriptions``, as a whisper model served by vLLM: a
        multipart form with ``file`` (and ``model``, ``response_format``); the text says
        what it was given."""
        fields = openai_shapes.form_fields(body, self.headers.get("Content-Type", ""))
        if "file" not in fields:
            self._error(HTTPStatus.BAD_REQUEST, "a multipart form with a 'file' is expected")
            return
        model = fields.get("model", (None, b""))[1].decode("utf-8", "replace")
        if model and model != self.engine.model_id:
            self._error(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "NotFoundError"
            )
            return
        filename, audio = fields["file"]
        text = openai_shapes.TRANSCRIPT.format(name=filename or "the upload", size=len(audio))
        with self.engine.request(0) as tracker:
            for _ in text.split():
                time.sleep(self.engine.token_delay_s)
                tracker.token()
        fmt = fields.get("response_format", (None, b"json"))[1].decode("ascii", "replace")
        if fmt == "text":
            self._send(HTTPStatus.OK, text.encode(), "text/plain; charset=utf-8")
            return
        self._send_json(HTTPStatus.OK, {"text": text})

    def _stream(
        self,
        ident: str,
        tokens: list[str],
        finish: str,
        usage: dict[str, int] | None,
        tracker: Request,
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
        epoch = e.epoch
        for tok in tokens:
            time.sleep(e.token_delay_s)
            if e.epoch != epoch:  # put to sleep in "abort" mode: the request ends here
                finish = "abort"
                break
            event(chunk({"content": tok}, None))
            tracker.token()
        tracker.end()
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
        self._send_json(*sleep_mode.sleep(self.engine, query))

    def _wake_up(self, query: dict[str, list[str]], _body: bytes) -> None:
        self._send_json(*sleep_mode.wake_up(self.engine, query))

    def _collective_rpc(self, _query: dict[str, list[str]], body: bytes) -> None:
        self._send_json(*sleep_mode.collective_rpc(self.engine, body))

    def _is_sleeping(self, _query: dict[str, list[str]], _body: bytes) -> None:
        self._send_json(HTTPStatus.OK, {"is_sleeping": self.engine.sleeping})
