"""The simulated Ollama's HTTP plumbing: the server, request bodies, JSON and chunked
answers, and what the native and the OpenAI-compatible endpoints share.

Standard library and ``gpuctl.sim`` only (see ``gpuctl.sim.ollama``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlsplit

from gpuctl.sim.console import log
from gpuctl.sim.ollama_models import Ollama, iso_time, normalize_model, parse_keep_alive

_MAX_BODY = 16 * 2**20
REPLY = "This is a simulated reply from {model}, served by a simulated Ollama."


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], ollama: Ollama, handler: type[BaseHTTPRequestHandler]
    ) -> None:
        super().__init__(address, handler)
        self.ollama = ollama


class BadRequest(Exception):
    pass


class HandlerBase(BaseHTTPRequestHandler):
    """Plumbing for the endpoints; a subclass names its routes in ``routes``."""

    protocol_version = "HTTP/1.1"
    server_version = "ollama"
    sys_version = ""

    @property
    def ollama(self) -> Ollama:
        return cast(Server, self.server).ollama

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

    def routes(self) -> dict[tuple[str, str], Callable[[dict[str, Any]], None]]:
        """(method, path) -> the endpoint, given the request's JSON body."""
        return {}

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        routes = self.routes()
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
            except BadRequest as err:
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
            raise BadRequest("bad Content-Length") from None
        if length < 0 or length > _MAX_BODY:
            self.close_connection = True
            raise BadRequest("request body too large")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            raise BadRequest("invalid character in the JSON request body") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        return data

    # -- responses

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:  # a client that keeps connections must know
            self.send_header("Connection", "close")
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
        words = REPLY.format(model=model).split(" ")
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
