"""Relaying an upstream answer to the proxy's client, and the ASGI types both use.

A small answer (a length up to ``WHOLE_MAX``, or a body that came whole with its head)
goes in one message once whole; any other is sent as it arrives, chunk by chunk,
whatever its framing (a length, chunked, SSE, until the connection closes), each
``send`` awaited: uvicorn holds it while the client's socket is full, and the upstream socket is not read while a
chunk waits (the upstream client's backpressure), so a slow client slows its upstream and the proxy's
memory stays bounded whatever the answer's size. An answer cut short after its head
went is cut for the client too (uvicorn closes the connection short of the length or
of the last chunk), never ended as if whole. A client that goes away cancels its
upstream request: the caller then closes the response, which closes the upstream
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from gpuctl.proxy.errors import sse_error_event
from gpuctl.proxy.upstream import Response, UpstreamError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("gpuctl.proxy")

# Not forwarded either way (RFC 9110 §7.6.1), plus what the client or uvicorn set themselves.
HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_HOP_RESPONSE = HOP | {b"date"}
# An answer with a length up to this is read whole before its head goes (one message);
# a longer one, or one without a length, is relayed as it arrives.
WHOLE_MAX = 64 * 1024


def connection_named(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names listed in ``Connection`` (any number of them, comma-separated):
    hop-by-hop for this connection only, so not forwarded either (RFC 9110 §7.6.1)."""
    names: set[bytes] = set()
    for k, v in headers:
        if k == b"connection":
            names.update(t for t in (p.strip().lower() for p in bytes(v).split(b",")) if t)
    return frozenset(names)


def hop_filter(headers: Iterable[tuple[bytes, bytes]], hop: frozenset[bytes]) -> frozenset[bytes]:
    """``hop`` and, when a ``Connection`` header names more, those too."""
    named = connection_named(headers)
    return hop | named if named - hop else hop


async def relay(
    resp: Response,
    *,
    send: Send,
    send_body: Send,
    name: str,
    opened_sse: bool,
    info: dict[str, Any],
    watch: Watch,
) -> bool:
    """Send the upstream's answer (for service ``name``) to the client; True when the
    client went away before it ended.

    ``send`` takes the head (the caller notes the status); ``send_body`` the body,
    uvicorn's own, one call less per chunk.

    ``opened_sse``: the proxy already opened an SSE stream (and said 200) while the
    service loaded, so only the events go.

    ``watch``: the request's watch on its client, set since the request went upstream;
    it cancels the caller while the answer is awaited whole, and is put off here once
    the answer is relayed piece by piece, where its task is watched beside the upstream.

    ``info`` (the access log's): a stream that ends with an error event after its 200
    gets ``status`` (what happened: the upstream's status, or 502 for an upstream that
    failed mid-stream) and ``error`` (the event's code).
    """
    sse = (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
    if opened_sse:
        # The upstream's status line has nowhere to go: a refusal becomes the stream's
        # error event, with the first 2,000 bytes of what it said (never all of it).
        if resp.status != 200:
            said = b""
            while len(said) < 2000 and (chunk := await resp.next()):
                said += chunk
            info["status"], info["error"] = resp.status, "upstream_status"
            await end_with_error(
                send,
                f"{name} answered {resp.status}: {said[:2000].decode('utf-8', 'replace')}",
                "upstream_error",
                "upstream_status",
            )
            return False
    else:
        drop = hop_filter(resp.headers, _HOP_RESPONSE)
        headers = [(k, v) for k, v in resp.headers if k not in drop]
        if resp.status in (204, 304) or resp.head_only:
            # No body, whatever its length says: a HEAD's length is the GET's (passed
            # on); a 204 or 304 goes without one (uvicorn would count it against the
            # empty body).
            length = resp.header(b"content-length")
            if resp.head_only and length is not None:
                headers.append((b"content-length", b"%d" % int(length)))
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": headers})  # fmt: skip
            await send_body({"type": "http.response.body", "body": b""})
            return False
        if not sse:
            length = resp.header(b"content-length")
            # A small answer whose body is still on its way (a server that writes its
            # head and its body apart, as Python's http.server does) is awaited whole:
            # its length bounds the memory, and one message spares the relay's two tasks
            # (CPU per request in bench/proxy_bench.py, 64 clients, side by side: 0.168
            # vs 0.176 ms saturated, 0.276 vs 0.297 ms paced).
            small = length is not None and int(length) <= WHOLE_MAX
            content = await resp.read() if small else resp.complete_body()
            if content is not None:  # all here (a small answer): one message
                headers.append((b"content-length", str(len(content)).encode()))
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": headers})  # fmt: skip
                await send_body({"type": "http.response.body", "body": content})
                return False
            if length is not None:
                # Still arriving: its length goes ahead (llhttp checked it is one number),
                # so a cut shows as one.
                headers.append((b"content-length", b"%d" % int(length)))
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": headers})  # fmt: skip
    watch.on = False  # from here the pump watches the client itself
    return await _pump(resp, send_body, watch.start(), name, sse=sse, info=info)


async def _pump(
    resp: Response,
    send: Send,
    watch: asyncio.Task[None],
    name: str,
    *,
    sse: bool,
    info: dict[str, Any],
) -> bool:
    """Chunks as they arrive, until the upstream ends or the client goes (True then)."""

    async def copy() -> None:
        while chunk := await resp.next():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    gone = False
    pump = asyncio.create_task(copy())
    try:
        await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not pump.done():
            # The client went away (or we are shut down): stop reading; closing the
            # response (the caller's finally) aborts the upstream connection, which
            # is how an OpenAI-compatible server learns to abort the request.
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            gone = watch.done() and not watch.cancelled()
    if gone:
        return True
    err = pump.exception()
    if err is None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return False
    if isinstance(err, UpstreamError) and sse:
        log.warning("%s: the upstream stream failed: %s", name, err)
        info["status"], info["error"] = 502, "upstream_failed"
        await end_with_error(
            send,
            f"{name}'s server failed mid-stream: {type(err).__name__}: {err}",
            "upstream_error",
            "upstream_failed",
        )
        return False
    raise err  # not SSE: let uvicorn cut the connection, so the truncation shows


# How long a request waits upstream before its client is watched: a task a request
# costs about 20 us of CPU (+7 % a request at 64 clients, 15 % saturated), and most
# answers come sooner; a client that leaves is noticed within this.
WATCH_DELAY_S = 0.5


class Watch:
    """A request's watch on its client, from the moment the request goes upstream.

    After ``WATCH_DELAY_S`` (or at once, by ``start``) a task awaits the client's
    disconnect; while ``on``, a client that went away cancels ``task`` (the request's
    own, awaiting its upstream: the upstream client then closes the connection, which is how an
    OpenAI-compatible server learns to abort the request) and ``fired`` says so. A
    client that left before the answer's head, or while a small answer was read whole,
    left the upstream working and the request counted in flight until the answer came
    (ten minutes at most). ``close`` when the request is done with its upstream.
    """

    __slots__ = ("_handle", "_receive", "_request", "fired", "on", "task")

    def __init__(self, receive: Receive, request: asyncio.Task[Any]) -> None:
        self.on = True
        self.fired = False
        self.task: asyncio.Task[None] | None = None
        self._receive = receive
        self._request = request
        self._handle = asyncio.get_running_loop().call_later(WATCH_DELAY_S, self.start)

    def start(self) -> asyncio.Task[None]:
        """The task that ends when the client goes (started now if not yet)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(client_gone(self._receive))
            self.task.add_done_callback(self._gone)
        return self.task

    def _gone(self, task: asyncio.Task[None]) -> None:
        if self.on and not task.cancelled() and task.exception() is None:
            self.on = False
            self.fired = True
            self._request.cancel()

    def close(self) -> None:
        self.on = False
        self._handle.cancel()  # also drops its hold on this watch (no cycle left)
        if self.task is not None:
            self.task.cancel()


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (call it once the request body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def end_with_error(
    send: Send,
    message: str,
    kind: str,
    code: str,
    *,
    status: int | None = None,
    retry_s: float | None = None,
) -> None:
    """End the SSE stream the client holds with an OpenAI-style error event (with the
    status it stands for, and when to retry: ``errors.sse_error_event``)."""
    await send(
        {
            "type": "http.response.body",
            "body": sse_error_event(message, kind, code, status=status, retry_s=retry_s),
            "more_body": False,
        }
    )


async def send_whole(send: Send, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any) -> None:
    await send_whole(
        send, status, json.dumps(obj, separators=(",", ":")).encode(), b"application/json"
    )
