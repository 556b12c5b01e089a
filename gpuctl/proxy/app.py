"""The proxy as a raw ASGI application, run by ``gpuctl.proxy.server``.

Endpoints::

    GET  /healthz                   no auth   {"ok": true}
    GET  /metrics                   key       Prometheus text (metrics.py)
    GET  /openapi.json              key       the OpenAPI 3.1 document of these (openapi.py)
    GET  /v1/models                 key       every configured model, running or not
    GET  /v1/models/<id>            key       the server's card when it answers, else ours
    POST /v1/chat/completions, /v1/completions, /v1/embeddings,
         /v1/audio/transcriptions, /v1/audio/translations, /v1/rerank, /v1/score
                                    key       routed by the body's ``model``
    ANY  /services/<name>/<path>    key       passed through to that service's /<path>

A request for a service that is not known to be ready is held while the service is
checked or started (``ready.SingleFlight``: the CLI's ensure flow, one per service), up
to its ``queue_timeout``; a streaming request gets SSE comment lines meanwhile. While
any request is in flight on a service, it counts in the store (``use.ServiceUse`` over
``gpuctl.api.in_use``: written on 0 <-> 1, at most once per ``LINGER_S``, renewed every
few seconds, never per request), so reclaim never stops a server that is answering.
Once a ready service's count comes off, its entry lingers a few seconds: a request
within them goes at once, its count written meanwhile (``use``: why no stop cuts it).

A pooled service (``hosts = [...]``) is forwarded to the host of its pool where its copy
was last found, and counted in that host's store (the one whose reclaim would stop it):
its readiness and count are kept per service and host. When that host's server stops
answering (a refused connection, a failed health check) the ensure flow picks the host
anew, over the whole pool, and requests follow it there.

Answers are relayed as they arrive, with backpressure, and a client that goes away
cancels its upstream request (``relay``). No framework: see ``gpuctl.agent.app`` for why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from gpuctl import __version__
from gpuctl.api import in_use
from gpuctl.config import Config, ServiceConfig
from gpuctl.proxy.errors import ClientGone, Refusal, error_body, retry_after, shutting_down
from gpuctl.proxy.metrics import ProxyMetrics
from gpuctl.proxy.ready import UNTRUSTED, Readiness, SingleFlight, run_ensure
from gpuctl.proxy.relay import (
    HOP,
    Message,
    Receive,
    Scope,
    Send,
    Watch,
    client_gone,
    end_with_error,
    hop_filter,
    relay,
    send_json,
    send_whole,
)
from gpuctl.proxy.routes import (
    MODEL_IN_BODY,
    SERVICES_PREFIX,
    RouteTable,
    Upstream,
    form_field,
    header_of,
    loads_a_model,
    model_from_json,
    multipart_boundary,
    read_body,
    safe_query,
    shown,
    split_services_path,
    wants_stream,
    why_no_model,
)
from gpuctl.proxy.served import ServedBatches
from gpuctl.proxy.upstream import (
    CLIENT_ENV,
    ConnectFailed,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeout,
    is_idempotent,
    make_client,
)
from gpuctl.proxy.use import ServiceUse

log = logging.getLogger("gpuctl.proxy")
access = logging.getLogger("gpuctl.proxy.access")

# A streaming request's first SSE comment waits this long: a service that turns out
# ready (or busy) within it gets its real status line instead of our 200.
FIRST_COMMENT_DELAY_S = 1.0
UPSTREAM_CONNECT_TIMEOUT_S = 10.0
# A non-streaming completion can take minutes; an upstream silent for longer is gone.
UPSTREAM_READ_TIMEOUT_S = 600.0
_JSON = (b"content-type", b"application/json")
MAX_HEADER_BYTES = 64 * 1024
# The request targets of the routed paths, encoded once.
_TARGETS = {p: p.encode() for p in MODEL_IN_BODY}


class ProxySettings(msgspec.Struct, frozen=True):
    """How the proxy answers (from ``[proxy]``; see ``gpuctl.config.ProxyConfig``)."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 2**20
    sse_keepalive: bool = True
    sse_interval_s: float = 10.0
    retry_after_s: float = 30.0
    access_log: bool = True
    pass_authorization: bool = False  # no keys of our own: the client's goes upstream


class _Reply:
    """What has been sent of one response (our own SSE head, or the upstream's)."""

    __slots__ = ("raw_send", "relayed_sse", "sse", "started", "status")

    def __init__(self, raw_send: Send) -> None:
        self.started = False
        self.sse = False  # we opened an SSE stream ourselves while holding the request
        self.relayed_sse = False  # the upstream's answer is an SSE stream, under way
        self.status = 0
        self.raw_send = raw_send  # uvicorn's own: for bodies, once the status is known


class _Call(msgspec.Struct):
    """One proxied request on its way through."""

    scope: Scope
    receive: Receive
    send: Send
    reply: _Reply
    info: dict[str, Any]
    up: Upstream
    path: str
    body: bytes
    stream: bool
    ended: bool = False  # its in-flight count is off (its last byte is on its way)
    # Its service's use on the host it goes to (set by ``_serve``; moved by ``_move``).
    st: ServiceUse | None = None


class ProxyApp:
    """The ASGI callable."""

    def __init__(
        self,
        conf: Config,
        routes: RouteTable,
        settings: ProxySettings,
        *,
        ensure: Callable[..., Readiness] = run_ensure,
    ) -> None:
        self.conf = conf
        self.routes = routes
        self.settings = settings
        self.metrics = ProxyMetrics()
        # Requests served, told to the journal from the metrics' counts (proxy.served).
        # service -> the host of its pool where its copy was last found (pooled only).
        self._where: dict[str, str] = {}
        self.served = ServedBatches(conf, self.metrics.requests, where=self._where)
        self._served_task: asyncio.Task[None] | None = None
        self._keys = tuple(k.encode() for k in settings.api_keys)
        self._ensure = ensure
        self._client: httpx.AsyncClient | None = None  # health checks, model cards
        self.upstream: UpstreamClient = new_client(
            UPSTREAM_CONNECT_TIMEOUT_S, UPSTREAM_READ_TIMEOUT_S
        )
        self._flight: SingleFlight | None = None
        # (service, host) -> its use there: a pooled service's copy may move between
        # the hosts of its pool, and neither its count nor the trust in it moves along.
        self._states: dict[tuple[str, str], ServiceUse] = {}
        self.cancelled_upstream = 0  # streams cut short because their client left
        self._openapi: bytes | None = None  # /openapi.json, made on its first request
        self._draining: asyncio.Event | None = None  # set when the proxy is stopping
        self._models_body = json.dumps(
            {
                "object": "list",
                "data": [self._card(m, up) for m, up in routes.models()],
            },
            separators=(",", ":"),
        ).encode()

    # ------------------------------------------------------------------ plumbing

    def _openapi_body(self) -> bytes:
        if self._openapi is None:
            from gpuctl.proxy.openapi import openapi_document

            doc = openapi_document(sorted(self.routes.by_model), sorted(self.routes.by_name))
            self._openapi = json.dumps(doc, separators=(",", ":")).encode()
        return self._openapi

    @property
    def client(self) -> httpx.AsyncClient:
        """httpx, for the cold paths; requests go through ``self.upstream``."""
        if self._client is None:
            self._client = make_client(
                UPSTREAM_READ_TIMEOUT_S, UPSTREAM_CONNECT_TIMEOUT_S, https=self.routes.https()
            )
        return self._client

    @property
    def flight(self) -> SingleFlight:
        if self._flight is None:
            self._flight = SingleFlight(
                self.conf,
                self.client,
                self._ensure,
                cold_starts=self.metrics.cold_starts,
                only=self.routes.only,
            )
        return self._flight

    @property
    def launches(self) -> int:
        return self._flight.launches if self._flight else 0

    async def aclose(self) -> None:
        for st in self._states.values():
            await st.let_go(closing=True)
            await st.unlinger()  # nothing of a proxy that stopped lingers
        if self._served_task is not None:
            self._served_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._served_task
            self._served_task = None
        try:  # what was served since the last batch: told before the process goes
            await self.served.flush()
        except Exception as err:  # a witness: stopping goes on
            log.warning("telling served requests failed: %s: %s", type(err).__name__, err)
        await self.upstream.aclose()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def drain(self) -> None:
        """The proxy is stopping: requests held for a start are answered now (503, or an
        error event on their stream), not cut when uvicorn's grace runs out. Call it on
        the event loop's thread, before uvicorn's own shutdown."""
        self._drained().set()

    def _drained(self) -> asyncio.Event:
        if self._draining is None:
            self._draining = asyncio.Event()
        return self._draining

    @property
    def draining(self) -> bool:
        return self._draining is not None and self._draining.is_set()

    def _state(self, svc: ServiceConfig) -> ServiceUse:
        """``svc``'s use on its host (``svc`` placed there: ``ServiceConfig.on``)."""
        key = (svc.name, svc.host)
        st = self._states.get(key)
        if st is None:
            use = in_use(svc.name, config=self.conf, host=svc.host)
            st = self._states[key] = ServiceUse(use, svc.idle_timeout_s)
        return st

    def _placed(self, up: Upstream) -> Upstream:
        """``up`` on the host of its pool where its copy was last found (itself for a
        service of one host, or before the copy was found anywhere)."""
        if not up.service.pooled:
            return up
        return self.routes.on(up, self._where.get(up.service.name, up.service.host))

    async def _move(self, call: _Call, host: str) -> None:
        """The copy of ``call``'s pooled service is on ``host``: forward there, count
        there; its use where it was loses this request (and its trust)."""
        old = call.st
        assert old is not None
        call.up = self.routes.on(call.up, host)
        self._where[call.up.service.name] = host
        new = self._state(call.up.service)
        if new is old:
            return
        new.in_flight += 1
        call.st = new
        old.ready = False
        old.kept = None
        await old.end()  # with its last request, its count comes off that host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._served_task = asyncio.create_task(
                    self.served.loop(), name="gpuctl-proxy-served"
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ requests

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        reply = _Reply(send)
        info: dict[str, Any] = {}

        async def sender(message: Message) -> None:
            if message["type"] == "http.response.start":
                reply.started = True
                reply.status = message["status"]
            await send(message)

        try:
            await self._route(scope, receive, sender, reply, info)
        except Refusal as r:
            await self._refuse(sender, reply, r, info)
        except ClientGone:
            info["gone"] = True
            reply.status = reply.status or 499  # nginx's word for it, in the log and metrics
        except UpstreamError as e:  # the server failed while its answer was relayed
            log.warning("%s: the upstream failed mid-answer: %s", info.get("service"), e)
            with contextlib.suppress(Exception):  # once its head went, the cut shows
                await self._refuse(
                    sender,
                    reply,
                    Refusal(
                        502,
                        f"{info.get('service')}'s server failed mid-answer: {e}",
                        "upstream_error",
                        "upstream_failed",
                    ),
                    info,
                )
        except asyncio.CancelledError:
            if not self.draining:
                raise
            # uvicorn's grace after a stop ran out with this answer under way: it ends
            # here with the reason (an error event on a stream), and the task ends as
            # uvicorn asked, without the traceback of a cancelled ASGI application.
            with contextlib.suppress(Exception):
                await self._refuse(sender, reply, shutting_down(), info)
        except Exception as e:  # a bug: one line (the traceback with GPUCTL_DEBUG=1), and
            # an answer in the shape clients parse instead of uvicorn's bare 500
            debug = os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")
            log.error(
                "%s %s failed: %s: %s (a bug in gpuctl; GPUCTL_DEBUG=1 logs the traceback)",
                scope["method"],
                shown(scope["path"]),
                type(e).__name__,
                e,
                exc_info=debug,
            )
            with contextlib.suppress(Exception):  # the client may be gone too
                await self._refuse(
                    sender,
                    reply,
                    Refusal(
                        500, f"the proxy failed: {type(e).__name__}", "server_error", "internal"
                    ),
                    info,
                )
        finally:
            svc = info.get("service")
            # What happened, which is not always the status line that went: an answer
            # cut short, or an error event ending a stream that had said 200.
            status = info.get("status") or reply.status
            # Under service="" what no service answered: the proxy's own endpoints, and
            # refusals before a route (no such model or service, a bad key, a bad path).
            self.metrics.requests[(svc or "", status)] += 1
            if self.settings.access_log:
                client = scope.get("client") or ("-", 0)
                access.info(
                    '%s:%s "%s %s" %s service=%s model=%s %.1fms wait=%.2fs%s%s',
                    client[0],
                    client[1],
                    shown(scope["method"]),
                    # as sent (escapes kept): /services/a%2Fb is not /services/a/b
                    shown((scope.get("raw_path") or b"").decode("latin-1") or scope["path"]),
                    status or "-",
                    svc or "-",
                    shown(info["model"]) if info.get("model") else "-",
                    (time.perf_counter() - t0) * 1000,
                    info.get("waited", 0.0),
                    f" sent={reply.status} error={info['error']}" if "error" in info else "",
                    " client-gone" if info.get("gone") else "",
                )

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, reply: _Reply, info: dict[str, Any]
    ) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        # uvicorn's httptools parser takes a header block of any size (64 MiB was read
        # whole): one over nginx's order of limit is refused here, never forwarded.
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            raise Refusal(
                431,
                f"request headers over {MAX_HEADER_BYTES // 1024} KiB",
                "invalid_request_error",
                "headers_too_large",
            )
        if path == "/healthz":
            await send_json(send, 200, {"ok": True, "version": __version__})
            return
        if not self._authorized(scope):
            raise Refusal(
                401,
                "Incorrect API key provided: send one 'Authorization: Bearer <key>' with a key "
                "from the proxy's api_keys_file or api_keys_env",
                "invalid_request_error",
                "invalid_api_key",
            )
        if path == "/metrics" and method in ("GET", "HEAD"):
            body = self.metrics.render(sorted(self.routes.by_name)).encode()
            await send_whole(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")
            return
        if path == "/v1/models" and method in ("GET", "HEAD"):
            await send_whole(send, 200, self._models_body, b"application/json")
            return
        if path == "/openapi.json" and method in ("GET", "HEAD"):
            await send_whole(send, 200, self._openapi_body(), b"application/json")
            return
        if path.startswith("/v1/models/") and method in ("GET", "HEAD"):
            await self._model_card(scope, send, path[len("/v1/models/") :], info)
            return
        raw_path: bytes = scope.get("raw_path") or path.encode("utf-8", "surrogateescape")
        if raw_path.startswith(SERVICES_PREFIX.encode()):
            split = split_services_path(raw_path)
            if split is None:
                raise Refusal(
                    400,
                    "a /services/<name>/ path may not hold '.' or '..' segments: "
                    "send the path the service should see",
                    "invalid_request_error",
                    "bad_path",
                )
            name, rest = split
            up = self.routes.by_name.get(name)
            if up is None:
                raise Refusal(
                    404,
                    f"no service '{shown(name)}' behind this proxy",
                    "invalid_request_error",
                    "service_not_found",
                )
            info["service"] = name
            body = await read_body(scope, receive, self.settings.max_body_bytes)
            stream = wants_stream(scope, body)
            call = _Call(scope, receive, send, reply, info, up, rest, body, stream)
            if not loads_a_model(up.service, method, rest):
                # Ollama's model list and the like: Ollama answers them whatever it has
                # loaded, so nothing is started (or counted as a use) for them.
                await self._pass(call)
                return
            await self._serve(call)
            return
        if path in MODEL_IN_BODY:
            if method != "POST":
                raise Refusal(
                    405, f"{path} takes POST", "invalid_request_error", "method_not_allowed"
                )
            body = await read_body(scope, receive, self.settings.max_body_bytes)
            model, stream = self._model_of(scope, body)
            info["model"] = model
            if model is None:
                ctype = header_of(scope, b"content-type").decode("latin-1")
                message, code = why_no_model(ctype, body)
                raise Refusal(400, message, "invalid_request_error", code)
            up = self.routes.by_model.get(model)
            if up is None:
                raise Refusal(
                    404,
                    f"The model `{shown(model)}` does not exist behind this proxy; "
                    "GET /v1/models lists the configured ones",
                    "invalid_request_error",
                    "model_not_found",
                )
            info["service"] = up.service.name
            await self._serve(_Call(scope, receive, send, reply, info, up, path, body, stream))
            return
        raise Refusal(
            404,
            f"no route for {shown(method)} {shown(path)}; models route by their 'model', "
            "other paths go under /services/<name>/",
            "invalid_request_error",
            "not_found",
        )

    def _authorized(self, scope: Scope) -> bool:
        if not self._keys:
            return True
        sent = [bytes(v) for k, v in scope["headers"] if k == b"authorization"]
        if len(sent) != 1:
            return False  # none, or two that could each be read as the one (refused)
        scheme, _, key = sent[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        key = key.strip()
        ok = False
        for k in self._keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(key, k)
        return ok

    def _model_of(self, scope: Scope, body: bytes) -> tuple[str | None, bool]:
        ctype = header_of(scope, b"content-type").decode("latin-1")
        boundary = multipart_boundary(ctype)
        if boundary is not None:
            model = form_field(body, boundary, "model")
            stream = form_field(body, boundary, "stream")
            return model, stream == "true"
        return model_from_json(body)

    @staticmethod
    def _card(model: str, up: Upstream) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": f"gpuctl:{up.service.name}",
        }

    async def _model_card(self, scope: Scope, send: Send, model: str, info: dict[str, Any]) -> None:
        up = self.routes.by_model.get(model)
        if up is None:
            raise Refusal(
                404,
                f"The model `{shown(model)}` does not exist behind this proxy",
                "invalid_request_error",
                "model_not_found",
            )
        info["service"], info["model"] = up.service.name, model
        up = self._placed(up)
        # The server's own card when it answers now; never a start for a metadata read.
        try:
            r = await self.client.get(
                f"{up.origin}/v1/models/{quote(model, safe='/:@')}", timeout=2.0
            )
            if r.status_code == 200:
                await send_whole(send, 200, r.content, b"application/json")
                return
        except httpx.HTTPError:
            pass
        await send_json(send, 200, self._card(model, up))

    # ------------------------------------------------------------------ one request

    async def _serve(self, call: _Call) -> None:
        call.up = self._placed(call.up)
        svc = call.up.service
        st = call.st = self._state(svc)
        if svc.max_concurrent is not None and st.in_flight >= svc.max_concurrent:
            raise Refusal(
                429,
                f"{svc.name} has {st.in_flight} requests in flight, its max_concurrent",
                "rate_limit_error",
                "max_concurrent",
                retry_s=1,
            )
        st.in_flight += 1
        self.metrics.in_flight[svc.name] += 1
        # The request ends with its last byte: its count comes off just before, whichever
        # of the two sends (heads, or bodies straight to uvicorn) carries it.
        send, raw_send = call.send, call.reply.raw_send
        call.send = self._ending(call, send)
        call.reply.raw_send = self._ending(call, raw_send)
        try:
            attempts = 2  # a refused connection once: the server went, start it again
            while True:
                if not st.ready and not await st.again():
                    await self._wait_ready(call, st)  # may move it to another host
                    assert call.st is not None
                    st = call.st
                    svc = call.up.service
                # Use (the store's in-flight count, last_used) begins only now that the
                # server is there to serve it: a request refused on the way (busy,
                # unknown, not ready in time) was no use of it. A stop that lands
                # between the check and this count makes the connection fail: one
                # start again, below.
                await st.hold()
                try:
                    await self._forward(call)
                    return
                except ConnectFailed as e:
                    attempts -= 1
                    st.ready = False
                    if attempts == 0:
                        raise Refusal(
                            502,
                            f"{svc.name}'s server at {call.up.origin} refused the connection: {e}",
                            "upstream_error",
                            "upstream_refused",
                        ) from None
        finally:
            # However it ended (a refusal, its client gone, an error): before the answer.
            await self._end(call)
            # The wrappers hold the call that holds them: a reference cycle a request,
            # which only the collector frees (with uvicorn's cycle and everything it
            # holds, ~30 objects a request). Its collections of that garbage paused the
            # loop for 11-31 ms, every few seconds under load: a tail for every
            # request in flight. Put back, the call is freed when its request ends.
            call.send, call.reply.raw_send = send, raw_send

    async def _pass(self, call: _Call) -> None:
        """Forward a request that needs nothing started (``routes.loads_a_model``)."""
        call.up = self._placed(call.up)
        try:
            await self._forward(call)
        except ConnectFailed as e:
            svc = call.up.service
            raise Refusal(
                502,
                f"{svc.name}'s server at {call.up.origin} refused the connection: {e}",
                "upstream_error",
                "upstream_refused",
            ) from None

    def _ending(self, call: _Call, send: Send) -> Send:
        async def send_ending(message: Message) -> None:
            if not message.get("more_body", True) or (
                "more_body" not in message and message["type"] == "http.response.body"
            ):
                await self._end(call)
            await send(message)

        return send_ending

    async def _end(self, call: _Call) -> None:
        """One request's end (once): its count off, and the store's with the last one
        (on the host it went to)."""
        if not call.ended:
            call.ended = True
            self.metrics.in_flight[call.up.service.name] -= 1
            assert call.st is not None
            await call.st.end()

    async def _wait_ready(self, call: _Call, st: ServiceUse) -> None:
        svc, info = call.up.service, call.info
        t0 = time.monotonic()
        if svc.name not in self.flight.tasks:
            # The start may weigh other services' in-flight counts: this proxy's own
            # must not make an idle service look busy to it.
            for other in list(self._states.values()):
                await other.let_go(linger=False)  # only those with nothing in flight
                await other.unlinger()  # a preemption would wait for it
        task = self.flight.get(svc)
        limit = svc.queue_timeout_s if svc.queue_timeout_s is not None else svc.health_timeout_s
        deadline = t0 + limit
        keepalive = call.stream and self.settings.sse_keepalive
        # A client that leaves while it is held is let go at once (its request is never
        # forwarded); the start goes on for the others.
        gone = asyncio.create_task(client_gone(call.receive))
        stop = asyncio.create_task(self._drained().wait())
        try:
            await self._hold_until_ready(
                call, task, gone, stop, t0=t0, deadline=deadline, keepalive=keepalive
            )
        finally:
            gone.cancel()
            stop.cancel()
        result = task.result()
        waited = time.monotonic() - t0
        info["waited"] = info.get("waited", 0.0) + waited
        self.metrics.waited(svc.name, waited)
        if result.ok:
            if svc.pooled and result.host and result.host != svc.host:
                await self._move(call, result.host)
            assert call.st is not None
            call.st.ready = True
            return
        raise self._refusal_for(svc, result)

    async def _hold_until_ready(
        self,
        call: _Call,
        task: asyncio.Task[Readiness],
        gone: asyncio.Task[None],
        stop: asyncio.Task[bool],
        *,
        t0: float,
        deadline: float,
        keepalive: bool,
    ) -> None:
        svc, reply, info, send = call.up.service, call.reply, call.info, call.send
        limit = deadline - t0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                info["waited"] = time.monotonic() - t0
                self.metrics.waited(svc.name, info["waited"])
                raise Refusal(
                    503,
                    f"{svc.name} is not ready after {limit:g}s (its queue_timeout); "
                    f"it may still be loading: {self.flight.loading_text(svc.name)}",
                    "service_unavailable",
                    "model_loading",
                    retry_s=self.flight.retry_after_s(svc.name, self.settings.retry_after_s),
                )
            step = remaining
            if keepalive:
                step = min(
                    step,
                    self.settings.sse_interval_s if reply.sse else FIRST_COMMENT_DELAY_S,
                )
            done, _ = await asyncio.wait(
                {task, gone, stop}, timeout=step, return_when=asyncio.FIRST_COMPLETED
            )
            if gone in done:
                info["waited"] = time.monotonic() - t0
                raise ClientGone
            if stop in done and task not in done:
                info["waited"] = time.monotonic() - t0
                raise shutting_down()
            if task in done:
                return
            if keepalive:
                if not reply.sse:
                    reply.sse = True
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [
                                (b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"),
                            ],
                        }
                    )
                comment = f": {self.flight.loading_text(svc.name)}\n\n".encode()
                await send({"type": "http.response.body", "body": comment, "more_body": True})

    def _refusal_for(self, svc: ServiceConfig, r: Readiness) -> Refusal:
        text = r.reason + (f" ({r.hint})" if r.hint else "")
        later = self.settings.retry_after_s
        if r.outcome == "busy":
            return Refusal(503, text, "service_unavailable", "gpu_busy", retry_s=later)
        if r.outcome == "unknown":
            return Refusal(503, text, "service_unavailable", "gpu_unknown", retry_s=later)
        if r.outcome == "timeout":
            return Refusal(503, text, "service_unavailable", "model_loading", retry_s=later)
        if r.outcome == "failed":
            return Refusal(502, text, "upstream_error", "start_failed")
        if r.outcome == UNTRUSTED:
            return Refusal(502, text, "upstream_error", "upstream_untrusted")
        return Refusal(503, text, "service_unavailable", r.outcome, retry_s=later)

    async def _forward(self, call: _Call) -> None:
        scope = call.scope
        method: str = scope["method"]
        target = _TARGETS.get(call.path)
        qs: bytes = scope.get("query_string") or b""
        if target is None or qs:
            # call.path is URL text already: a model route's own path, or a /services
            # path as the client escaped it (routes.split_services_path)
            target = call.path.encode("ascii")
            if qs:
                target += b"?" + safe_query(qs).encode("ascii")
        keep_auth = self.settings.pass_authorization
        drop = hop_filter(scope["headers"], HOP)
        headers = [
            (k, v)
            for k, v in scope["headers"]
            if k not in drop and (keep_auth or k != b"authorization")
        ]
        # Watched from the moment the request goes upstream: a client that leaves before
        # the answer's head, or while a small answer is read whole, cancels this task
        # (relay.Watch), which aborts the upstream request (its connection is closed).
        me = asyncio.current_task()
        assert me is not None
        watch = Watch(call.receive, me)
        try:
            await self._exchange(call, method, target, headers, watch=watch)
        except asyncio.CancelledError:
            if not watch.fired:
                raise  # a stop (see _http), not the client
            me.uncancel()
            self.cancelled_upstream += 1
            raise ClientGone from None
        finally:
            watch.close()

    async def _exchange(
        self,
        call: _Call,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        *,
        watch: Watch,
    ) -> None:
        svc = call.up.service
        t0 = time.perf_counter()
        try:
            resp = await self.upstream.pool(call.up.origin).request(
                method,
                target,
                headers,
                call.body,
                # The OpenAI inference paths change no state: one that met a keep-alive
                # connection closed under it may go again (upstream.py's retry rule).
                idempotent=call.path in MODEL_IN_BODY or is_idempotent(method),
            )
        except ConnectFailed:
            raise
        except UpstreamTimeout as e:
            raise Refusal(
                504,
                f"{svc.name}'s server did not answer in time: {e}",
                "upstream_error",
                "upstream_timeout",
            ) from None
        except UpstreamError as e:
            raise Refusal(
                502,
                f"{svc.name}'s server failed: {e}",
                "upstream_error",
                "upstream_error",
            ) from None
        self.metrics.upstream(svc.name, time.perf_counter() - t0)
        # A stream cut by a stop ends with an error event (_http), as our own do.
        call.reply.relayed_sse = (resp.header(b"content-type") or b"").startswith(
            b"text/event-stream"
        )
        try:
            if await relay(
                resp,
                send=call.send,
                send_body=call.reply.raw_send,
                name=svc.name,
                opened_sse=call.reply.sse,
                info=call.info,
                watch=watch,
            ):
                call.info["gone"] = True
                self.cancelled_upstream += 1
        finally:
            resp.aclose()

    async def _refuse(self, send: Send, reply: _Reply, r: Refusal, info: dict[str, Any]) -> None:
        if reply.started:
            # Its status line went (a 200, often): the access log and the metrics say
            # what happened instead.
            info["status"], info["error"] = r.status, r.code
            if reply.sse or reply.relayed_sse:  # a stream: it ends with an error event
                await end_with_error(
                    send, r.message, r.kind, r.code, status=r.status, retry_s=r.retry_s
                )
            # else the answer is under way; nothing sound can be added (uvicorn cuts it)
            return
        headers = [_JSON]
        if r.retry_s is not None:
            headers.append((b"retry-after", retry_after(r.retry_s)))
        body = error_body(r.message, r.kind, r.code)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def new_client(connect_timeout_s: float, read_timeout_s: float) -> UpstreamClient:
    """The implementation ``GPUCTL_PROXY_CLIENT`` names (``h1``, the default, or
    ``aiohttp``); each is imported only here, when the proxy starts. It lives here, not in
    ``upstream``, which both implementations import: no import circle."""
    kind = os.environ.get(CLIENT_ENV, "h1")
    if kind == "h1":
        from gpuctl.proxy import h1

        return h1.Client(connect_timeout_s, read_timeout_s)
    if kind != "aiohttp":
        raise ValueError(f"{CLIENT_ENV}={kind!r}: 'aiohttp' or 'h1'")
    from gpuctl.proxy import aio

    return aio.Client(connect_timeout_s, read_timeout_s)
