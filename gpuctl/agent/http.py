"""The agent's HTTP plumbing: requests, responses, errors and exact-path routing.

No web framework (see ``gpuctl.agent.app``): these few types are all the raw ASGI
application needs. Handlers take a ``Request`` and return a ``Response``, or raise
``HttpError`` for a JSON ``{"error", "hint"}`` answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import msgspec

from gpuctl.core.safe_text import json_safe

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
# Past this an oversized body is not read on: the connection is closed on its sender.
DRAIN_BYTES = 64 << 20


class Response(msgspec.Struct, frozen=True):
    """A complete response; built once and re-sent as is where it can be cached."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]


class HttpError(Exception):
    """Raised by a handler to answer ``status`` with a JSON ``{"error", "hint"}`` body."""

    def __init__(
        self,
        status: int,
        error: str,
        hint: str = "",
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.hint = hint
        self.headers = tuple(headers)


def make_response(
    status: int,
    body: bytes,
    content_type: bytes,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> Response:
    headers = (
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *extra_headers,
    )
    return Response(status, body, headers)


def json_response(
    status: int, obj: Any, extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> Response:
    # A process's command line read with surrogateescape would go out as "\udcff", which
    # strict JSON parsers refuse: lone surrogates are written as `\xff` (core.safe_text).
    body = json.dumps(json_safe(obj), separators=(",", ":")).encode()
    return make_response(status, body, b"application/json", extra_headers)


def error_body(error: str, hint: str = "") -> bytes:
    """The JSON body of an error answer: ``{"error", "hint"}``."""
    return json.dumps({"error": error, "hint": hint}, separators=(",", ":")).encode()


def error_response(
    status: int, error: str, hint: str = "", extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> Response:
    return json_response(status, {"error": error, "hint": hint}, extra_headers)


class Request:
    """The parts of an ASGI HTTP scope a handler needs, and the body on demand."""

    __slots__ = ("receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    @property
    def query_string(self) -> bytes:
        return bytes(self.scope.get("query_string", b""))

    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.query_string.decode("latin-1"), keep_blank_values=True)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return None

    async def body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The request body; 413 when it exceeds ``limit`` bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "the client went away while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                # Drain only a body still coming: after its last chunk, another receive
                # waits for a disconnect that never comes, and the 413 is never sent.
                if message.get("more_body", False):
                    await self._drain(size)
                raise HttpError(413, f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drain(self, size: int) -> None:
        """Read and drop the rest of an oversized body (up to ``DRAIN_BYTES`` in all),
        so a client still sending it reads our 413 instead of a connection reset."""
        more = True
        while more and size <= DRAIN_BYTES:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            more = bool(message.get("more_body", False))


Handler = Callable[[Request], Awaitable[Response]]


class Route(msgspec.Struct):
    """One path: its handlers by method, and whether it needs the bearer token."""

    path: str
    auth: bool
    handlers: dict[str, Handler] = msgspec.field(default_factory=dict)


class Router:
    """Exact-path routing; add endpoints with ``add`` (HEAD is served for every GET)."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}

    def add(self, method: str, path: str, handler: Handler, *, auth: bool = True) -> None:
        route = self.routes.setdefault(path, Route(path=path, auth=auth))
        if route.auth != auth:
            raise ValueError(f"{path}: every method of a path shares one auth setting")
        route.handlers[method.upper()] = handler

    def allowed(self, route: Route) -> list[str]:
        methods = set(route.handlers)
        if "GET" in methods:
            methods.add("HEAD")
        return sorted(methods)
