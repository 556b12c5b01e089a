"""The GPU host agent as a raw ASGI application (DESIGN §5).

No web framework: Starlette/FastAPI would cost import time and a good share of the
throughput, and the agent needs only a handful of fixed routes. ``create_app`` builds the
callable; ``gpuctl.agent.server`` runs it under uvicorn.

Endpoints::

    GET /healthz          no auth   {"ok": true, "version": ...}
    GET /openapi.json     no auth   the OpenAPI 3.1 document of this API
    GET /status[?match=]  bearer    Snapshot.to_wire(); 503 when the probe fails
    GET /metrics          bearer    Prometheus text

Many pollers, one scan: the probe reading is cached for ``cache_ttl_s`` and refreshed by
one scan at a time (requests that arrive during a scan wait for it). Probes block (NVML,
an ``nvidia-smi`` subprocess), so scans run in a worker thread and the event loop keeps
serving. The encoded ``/status`` body is cached per keyword set, so the hot path is a
dict lookup and a ``send``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs

from gpuctl import __version__
from gpuctl.adapters.probes.base import Probe
from gpuctl.adapters.procinfo import describe_pids, find_matching, host_identity, on_pipes
from gpuctl.core.model import (
    STATUS_SCHEMA,
    HostIdentity,
    ProbeReading,
    Snapshot,
    StartingProcess,
)
from gpuctl.core.record import RECORD_SCHEMA, Phase, Record
from gpuctl.errors import GpuctlError, ProbeError

log = logging.getLogger("gpuctl.agent")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

T = TypeVar("T")

# A client can send any keyword set; these bound what it can make us remember.
MAX_MATCH_KEYWORDS = 32
MAX_KEYWORD_LEN = 200
MAX_MATCH_SETS = 128
MAX_BODY_BYTES = 1 << 20

_AUTH_HINT = (
    "send 'Authorization: Bearer <token>' with the token the agent was started with "
    "(GPUCTL_AGENT_TOKEN or --token-file on the GPU host)"
)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the agent answers.

    Attributes:
        token: the bearer token every endpoint but /healthz and /openapi.json requires;
            None means no auth (the server only allows that on loopback).
        cache_ttl_s: how long one probe reading (and one match scan) is reused.
        state_dir: the state directory this agent uses, reported in /status.
        gpu_memory_mib: the configured total, for devices that cannot tell (unified
            memory). The caller passes it to the probe; /status falls back to it too.
        host: this machine's identity, reported in /status.
    """

    token: str | None = None
    cache_ttl_s: float = 1.0
    state_dir: str | None = None
    gpu_memory_mib: int | None = None
    host: HostIdentity = field(default_factory=host_identity)


# --------------------------------------------------------------------------- HTTP plumbing


@dataclass(frozen=True, slots=True)
class Response:
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
    body = json.dumps(obj, separators=(",", ":")).encode()
    return make_response(status, body, b"application/json", extra_headers)


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
                raise HttpError(413, f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class Route:
    """One path: its handlers by method, and whether it needs the bearer token."""

    path: str
    auth: bool
    handlers: dict[str, Handler] = field(default_factory=dict)


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


# --------------------------------------------------------------------------- caching


@dataclass(frozen=True, slots=True, eq=False)
class Outcome(Generic[T]):
    """One computation's result or error, and until when it may be reused.

    Compared by identity: a new outcome means a new scan, so whatever was derived from
    the old one (an encoded body) is stale.
    """

    value: T | None
    error: Exception | None
    expires: float


class TtlCell(Generic[T]):
    """A value computed in a worker thread, reused for ``ttl_s``, one computation at a time.

    Callers that arrive while a computation runs await that one instead of starting
    another. Errors are cached like values, so a failing probe is not hammered either.
    """

    def __init__(
        self,
        compute: Callable[[], T],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self._ttl_s = ttl_s
        self._clock = clock
        self._outcome: Outcome[T] | None = None
        self._inflight: asyncio.Future[Outcome[T]] | None = None

    @property
    def latest(self) -> Outcome[T] | None:
        return self._outcome

    async def get(self) -> Outcome[T]:
        outcome = self._outcome
        if outcome is not None and self._clock() < outcome.expires:
            return outcome
        inflight = self._inflight
        if inflight is None:
            inflight = self._inflight = asyncio.ensure_future(self._refresh())
        # shield: a client that hangs up must not cancel the scan the others wait for.
        return await asyncio.shield(inflight)

    async def _refresh(self) -> Outcome[T]:
        try:
            try:
                value = await asyncio.to_thread(self._compute)
            except Exception as err:  # kept and re-delivered to every waiter
                outcome: Outcome[T] = Outcome(None, err, self._clock() + self._ttl_s)
            else:
                outcome = Outcome(value, None, self._clock() + self._ttl_s)
            self._outcome = outcome
            return outcome
        finally:
            self._inflight = None


@dataclass(frozen=True, slots=True)
class Scan:
    """One probe reading and when it was taken (UTC, ISO 8601 with 'Z')."""

    reading: ProbeReading
    taken_at: str


@dataclass(slots=True)
class _MatchSlot:
    cell: TtlCell[tuple[StartingProcess, ...]]
    # (scan outcome, match outcome, response): valid while both outcomes are current.
    body: tuple[object, object, Response] | None = None


def utc_now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_match(query: dict[str, list[str]]) -> tuple[str, ...] | None:
    """The normalised keyword set of ``?match=kw1,kw2`` (None when absent).

    Matching is case-insensitive, so ``vLLM,vllm`` and ``vllm`` share one cache entry.
    """
    values = query.get("match")
    if values is None:
        return None
    words = {w.strip().lower() for v in values for w in v.split(",")}
    words.discard("")
    if len(words) > MAX_MATCH_KEYWORDS:
        raise HttpError(400, f"at most {MAX_MATCH_KEYWORDS} match keywords per request")
    if any(len(w) > MAX_KEYWORD_LEN for w in words):
        raise HttpError(400, f"a match keyword is longer than {MAX_KEYWORD_LEN} characters")
    return tuple(sorted(words))


def parse_exclude(
    query: dict[str, list[str]], boot_id: str
) -> tuple[frozenset[int], tuple[str, ...]]:
    """``?exclude=pid,pid&pipes=inode,inode&boot_id=B``: the caller's own process tree,
    and the pipes on its stdio, to leave out of ``starting``.

    Only honoured when ``boot_id`` is this host's: pids mean nothing on another machine.
    """
    if not boot_id or query.get("boot_id", [""])[0] != boot_id:
        return frozenset(), ()
    try:
        pids = frozenset(
            int(w) for v in query.get("exclude", []) for w in v.split(",") if w.strip()
        )
        pipes = tuple(str(int(w)) for v in query.get("pipes", []) for w in v.split(",") if w)
    except ValueError:
        raise HttpError(400, "exclude must be pids, and pipes pipe inodes") from None
    return pids, pipes


def parse_pids(query: dict[str, list[str]]) -> list[int]:
    """``?pids=1,2``: recorded servers to report under ``starting`` whatever their command."""
    try:
        pids = [int(w) for v in query.get("pids", []) for w in v.split(",") if w.strip()]
    except ValueError:
        raise HttpError(400, "pids must be a comma-separated list of pids") from None
    if len(pids) > MAX_MATCH_KEYWORDS:
        raise HttpError(400, f"at most {MAX_MATCH_KEYWORDS} pids per request")
    return [p for p in pids if p > 0]


# --------------------------------------------------------------------------- the agent


class AgentApp:
    """The ASGI callable. Build it with ``create_app``."""

    def __init__(self, settings: AgentSettings, probe: Probe) -> None:
        self.settings = settings
        self.probe = probe
        self._token = settings.token.encode() if settings.token else None
        self.router = Router()
        self.requests_total: dict[str, int] = {}
        self.probe_errors_total = 0
        self._scan = TtlCell(self._read_probe, settings.cache_ttl_s)
        self._plain_body: tuple[object, Response] | None = None
        self._matches: dict[tuple[str, ...], _MatchSlot] = {}

        self._healthz = json_response(200, {"ok": True, "version": __version__})
        self._openapi = json_response(200, openapi_document())
        self._not_found_label = "other"

        self.router.add("GET", "/healthz", self._get_healthz, auth=False)
        self.router.add("GET", "/openapi.json", self._get_openapi, auth=False)
        self.router.add("GET", "/status", self._get_status)
        self.router.add("GET", "/metrics", self._get_metrics)

        from gpuctl.agent.store_api import StoreApi

        self.store_api = StoreApi(settings.state_dir)

    # -- ASGI entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:  # websocket: not part of this API
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.router.routes.get(scope["path"])
        label = route.path if route is not None else self._not_found_label
        self.requests_total[label] = self.requests_total.get(label, 0) + 1
        method = scope["method"]
        try:
            if route is None and (
                scope["path"] == "/records" or scope["path"].startswith("/records/")
            ):
                # The state store: path parameters, so it routes itself (store_api.py).
                if self._token is not None:
                    self._check_token(scope)
                request = Request(scope, receive)
                status, payload = await self.store_api.handle(
                    method, scope["path"], await request.body()
                )
                response = json_response(status, payload)
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": response.headers,
                    }
                )
                await send({"type": "http.response.body", "body": response.body})
                return
            if route is None:
                raise HttpError(404, f"no such endpoint: {scope['path']}", "see /openapi.json")
            handler = route.handlers.get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(self.router.allowed(route))
                raise HttpError(
                    405,
                    f"{method} is not allowed on {route.path}",
                    f"use {allowed}",
                    [(b"allow", allowed.encode())],
                )
            if route.auth and self._token is not None:
                self._check_token(scope)
            response = await handler(Request(scope, receive))
        except HttpError as err:
            response = error_response(err.status, err.error, err.hint, err.headers)
        except Exception as err:
            log.exception("%s %s failed", method, scope["path"])
            response = error_response(
                500,
                f"internal error in the agent: {type(err).__name__}: {err}",
                "see the agent's log on the GPU host, and report it",
            )
        await send(
            {"type": "http.response.start", "status": response.status, "headers": response.headers}
        )
        await send(
            {"type": "http.response.body", "body": b"" if method == "HEAD" else response.body}
        )

    def _check_token(self, scope: Scope) -> None:
        assert self._token is not None
        value: bytes | None = None
        for key, val in scope["headers"]:
            if key == b"authorization":
                value = bytes(val)
                break
        if value is None:
            raise HttpError(
                401,
                "this agent requires a bearer token",
                _AUTH_HINT,
                [(b"www-authenticate", b'Bearer realm="gpuctl"')],
            )
        scheme, _, credentials = value.partition(b" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self._token):
            raise HttpError(
                401,
                "the bearer token is wrong",
                _AUTH_HINT,
                [(b"www-authenticate", b'Bearer realm="gpuctl", error="invalid_token"')],
            )

    # -- probe

    def _read_probe(self) -> Scan:
        """Runs in a worker thread, one at a time (see TtlCell)."""
        try:
            reading = self.probe.read()
        except Exception:
            self.probe_errors_total += 1
            raise
        return Scan(reading, utc_now_iso())

    async def _current_scan(self) -> Outcome[Scan]:
        outcome = await self._scan.get()
        if outcome.error is not None:
            err = outcome.error
            if isinstance(err, ProbeError):
                # Never an idle-looking answer: a GPU we cannot read is not a free GPU.
                raise HttpError(503, f"the GPU probe failed: {err.message}", err.hint)
            raise HttpError(
                503,
                f"the GPU probe failed: {type(err).__name__}: {err}",
                "see the agent's log on the GPU host",
            )
        return outcome

    def snapshot(self, scan: Scan, starting: tuple[StartingProcess, ...] | None) -> Snapshot:
        reading = scan.reading
        used = reading.memory_used_mib
        if used is None:
            # Unified memory reports no device figure: the processes' sum is the truth.
            used = sum(p.memory_mib or 0 for p in reading.processes)
        total = reading.memory_total_mib
        if total is None:
            total = self.settings.gpu_memory_mib
        if starting is not None:
            on_gpu = {p.pid for p in reading.processes}
            starting = tuple(s for s in starting if s.pid not in on_gpu)
        return Snapshot(
            memory_used_mib=used,
            memory_total_mib=total,
            unified_memory=reading.unified_memory,
            probe=reading.probe,
            taken_at=scan.taken_at,
            processes=reading.processes,
            starting=starting,
            host=self.settings.host,
            state_dir=self.settings.state_dir,
            gpus=reading.gpus,
        )

    def _match_slot(self, keywords: tuple[str, ...]) -> _MatchSlot:
        slot = self._matches.get(keywords)
        if slot is None:
            if len(self._matches) >= MAX_MATCH_SETS:
                # Forget the oldest keyword set (dicts keep insertion order).
                del self._matches[next(iter(self._matches))]

            store = self.store_api.store

            def scan_processes() -> tuple[StartingProcess, ...]:
                found = list(find_matching(keywords))
                if store is not None:
                    # The servers the records name count whatever their command line.
                    seen = {p.pid for p in found}
                    found += describe_pids(p for p in store.recorded_pids() if p not in seen)
                return tuple(found)

            slot = _MatchSlot(TtlCell(scan_processes, self.settings.cache_ttl_s))
            self._matches[keywords] = slot
        return slot

    # -- handlers

    async def _get_healthz(self, request: Request) -> Response:
        return self._healthz

    async def _get_openapi(self, request: Request) -> Response:
        return self._openapi

    async def _get_status(self, request: Request) -> Response:
        keywords = parse_match(request.query()) if request.query_string else None
        scan = await self._current_scan()
        if keywords is None:
            cached = self._plain_body
            if cached is not None and cached[0] is scan:
                return cached[1]
            assert scan.value is not None
            response = json_response(200, self.snapshot(scan.value, None).to_wire())
            self._plain_body = (scan, response)
            return response
        slot = self._match_slot(keywords)
        matched = await slot.cell.get()
        if matched.error is not None:
            raise HttpError(
                500,
                f"reading the host's processes failed: {matched.error}",
                "see the agent's log on the GPU host",
            )
        query = request.query()
        exclude, pipes = parse_exclude(query, self.settings.host.boot_id)
        pids = parse_pids(query)
        if exclude or pipes or pids:
            # Per caller, so not cached. A caller on this host names its own process tree
            # and its pipes (its shell and `| tee vllm.log` name the service, but are not
            # it); `pids` are servers the records name, reported whatever their command.
            assert scan.value is not None and matched.value is not None
            mine = [p for p in matched.value if p.pid not in exclude and not on_pipes(p.pid, pipes)]
            seen = {p.pid for p in mine}
            extra = [p for p in pids if p not in seen]
            if extra:
                mine += await asyncio.to_thread(describe_pids, extra)
            return json_response(200, self.snapshot(scan.value, tuple(mine)).to_wire())
        body = slot.body
        if body is not None and body[0] is scan and body[1] is matched:
            return body[2]
        assert scan.value is not None and matched.value is not None
        response = json_response(200, self.snapshot(scan.value, matched.value).to_wire())
        slot.body = (scan, matched, response)
        return response

    async def _get_metrics(self, request: Request) -> Response:
        scan = await self._scan.get()
        records: list[Record] | None = None
        store_up: bool | None = None
        store = self.store_api.store
        if store is not None:
            # A worker thread: reading a record that needs recovery takes its file lock.
            try:
                records = await asyncio.to_thread(store.records)
                store_up = True
            except GpuctlError as err:
                log.warning("reading the records for /metrics failed: %s", err)
                store_up = False
        text = render_metrics(
            scan.value.reading if scan.value is not None else None,
            probe_up=scan.error is None,
            probe_name=self.probe.name,
            probe_errors_total=self.probe_errors_total,
            requests_total=self.requests_total,
            host=self.settings.host,
            gpu_memory_mib=self.settings.gpu_memory_mib,
            records=records,
            store_up=store_up,
            now=time.time(),
        )
        return make_response(200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")


def create_app(settings: AgentSettings, probe: Probe) -> ASGIApp:
    """Build the agent's ASGI application around ``probe``.

    Args:
        settings: token, cache TTL and what /status reports about this host.
        probe: the GPU probe; its ``read`` may block (it runs in a worker thread).

    Returns:
        The ASGI callable (an ``AgentApp``).
    """
    return AgentApp(settings, probe)


# --------------------------------------------------------------------------- /metrics


def _label(value: str) -> str:
    """Escape a Prometheus label value (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value: integers in full (``:g`` would print 1.12795e+06), floats exactly."""
    if isinstance(value, int):
        return str(int(value))  # int(): a bool prints as 1 or 0
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render_metrics(
    reading: ProbeReading | None,
    *,
    probe_up: bool,
    probe_name: str,
    probe_errors_total: int,
    requests_total: dict[str, int],
    host: HostIdentity,
    gpu_memory_mib: int | None,
    records: Sequence[Record] | None = None,
    store_up: bool | None = None,
    now: float | None = None,
) -> str:
    """The Prometheus text exposition of one reading, the services' records and the
    agent's counters.

    Gauges that the probe could not measure are left out rather than reported as 0:
    a missing sample is "unknown", a zero is "free". ``records`` (None: the agent has no
    state directory, or it could not be read, see ``store_up``) gives each service's
    phase, lease and idle seconds (``now`` minus its ``last_used``).
    """
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    metric(
        "gpuctl_agent_info",
        "gauge",
        "The agent's version, probe and host (always 1).",
        [
            (
                f'{{version="{_label(__version__)}",probe="{_label(probe_name)}",'
                f'hostname="{_label(host.hostname)}"}}',
                1,
            )
        ],
    )
    metric(
        "gpuctl_probe_up",
        "gauge",
        "1 when the last GPU probe succeeded.",
        [("", 1 if probe_up else 0)],
    )
    if reading is not None:
        used = reading.memory_used_mib
        if used is None:
            used = sum(p.memory_mib or 0 for p in reading.processes)
        total = reading.memory_total_mib if reading.memory_total_mib is not None else gpu_memory_mib
        metric("gpuctl_gpu_memory_used_mib", "gauge", "GPU memory in use, MiB.", [("", used)])
        if total is not None:
            metric(
                "gpuctl_gpu_memory_total_mib", "gauge", "GPU memory in total, MiB.", [("", total)]
            )
        metric(
            "gpuctl_gpu_processes",
            "gauge",
            "Processes that hold GPU memory.",
            [("", len(reading.processes))],
        )
        metric(
            "gpuctl_process_memory_mib",
            "gauge",
            "GPU memory held by one process, MiB.",
            [
                (
                    f'{{pid="{p.pid}",gpu="{p.gpu}",command="{_label((p.command or "")[:80])}"}}',
                    p.memory_mib,
                )
                for p in reading.processes
                if p.memory_mib is not None
            ],
        )
    if store_up is not None:
        metric(
            "gpuctl_store_up",
            "gauge",
            "1 when the agent could read the records in its state directory.",
            [("", 1 if store_up else 0)],
        )
    if records is not None:
        at = time.time() if now is None else now
        metric(
            "gpuctl_service_phase",
            "gauge",
            "A service's phase (stopped, starting, running, sleeping, stopping, preempted, "
            "failed): one sample, 1, labelled with its current phase.",
            [
                (f'{{service="{_label(r.service)}",phase="{_label(r.phase.value)}"}}', 1)
                for r in records
            ],
        )
        idle = [(r.service, r.idle_for(at)) for r in records]
        metric(
            "gpuctl_service_idle_seconds",
            "gauge",
            "Seconds since a service was last used (services never used have no sample).",
            [(f'{{service="{_label(svc)}"}}', round(s, 3)) for svc, s in idle if s is not None],
        )
        metric(
            "gpuctl_service_lease_held",
            "gauge",
            "1 while a live lease on the service is held (it is being started or stopped).",
            [(f'{{service="{_label(r.service)}"}}', 1 if r.lease else 0) for r in records],
        )
    metric(
        "gpuctl_probe_errors_total",
        "counter",
        "GPU probe scans that failed.",
        [("", probe_errors_total)],
    )
    metric(
        "gpuctl_agent_requests_total",
        "counter",
        "HTTP requests by endpoint ('other' for unknown paths).",
        [(f'{{path="{_label(path)}"}}', n) for path, n in sorted(requests_total.items())],
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- /openapi.json


def openapi_document() -> dict[str, Any]:
    """The hand-written OpenAPI 3.1 description of every endpoint (DESIGN §5)."""
    error = {"$ref": "#/components/schemas/Error"}
    nullable_int = {"type": ["integer", "null"]}
    nullable_str = {"type": ["string", "null"]}

    def err(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error}}}

    unauthorized = {
        **err("Missing or wrong bearer token."),
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpuctl agent",
            "version": __version__,
            "description": (
                "The GPU host agent of gpuctl: who holds the GPU, at process level, and "
                "the host's state store (one record per service, with its lease). "
                "Every endpoint except /healthz and /openapi.json needs "
                "'Authorization: Bearer <token>' when the agent runs with a token."
            ),
        },
        "security": [{"bearerAuth": []}],
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "Liveness of the agent itself (not of the GPU).",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "The agent runs.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Health"}
                                }
                            },
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/status": {
                "get": {
                    "summary": "The GPU's processes and memory, cached for the agent's cache TTL.",
                    "parameters": [
                        {
                            "name": "match",
                            "in": "query",
                            "required": False,
                            "description": (
                                "Comma-separated keywords. Adds `starting`: host processes whose "
                                "command line contains one of them (case-insensitive) and that "
                                "hold no GPU memory yet."
                            ),
                            "schema": {"type": "string"},
                            "example": "vllm,translategemma",
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "What the probe saw.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Status"}
                                }
                            },
                        },
                        "400": err("A bad `match` parameter."),
                        "401": unauthorized,
                        "503": err("The GPU probe failed: the GPU state is unknown, not idle."),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": (
                        "Prometheus metrics: GPU and per-process memory, per-service phase, "
                        "lease and idle seconds, agent counters."
                    ),
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format 0.0.4.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": unauthorized,
                    },
                }
            },
            **_records_paths(unauthorized),
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "hint"],
                    "properties": {
                        "error": {"type": "string", "description": "What went wrong."},
                        "hint": {"type": "string", "description": "What fixes it (may be empty)."},
                    },
                },
                "Health": {
                    "type": "object",
                    "required": ["ok", "version"],
                    "properties": {"ok": {"const": True}, "version": {"type": "string"}},
                },
                "GpuProcess": {
                    "type": "object",
                    "required": ["pid", "command", "memory_mib", "user", "container", "gpu"],
                    "properties": {
                        "pid": {"type": "integer"},
                        "command": {
                            **nullable_str,
                            "description": "Full command line; null where it cannot be read.",
                        },
                        "memory_mib": {
                            **nullable_int,
                            "description": "null where the driver cannot tell.",
                        },
                        "user": nullable_str,
                        "container": {
                            **nullable_str,
                            "description": "Container id, null for a host process.",
                        },
                        "gpu": {"type": "integer"},
                    },
                },
                "StartingProcess": {
                    "type": "object",
                    "required": ["pid", "command", "user"],
                    "properties": {
                        "pid": {"type": "integer"},
                        "command": {"type": "string"},
                        "user": nullable_str,
                    },
                },
                "HostIdentity": {
                    "type": "object",
                    "required": ["hostname", "boot_id"],
                    "properties": {"hostname": {"type": "string"}, "boot_id": {"type": "string"}},
                },
                "Status": {
                    "type": "object",
                    "required": [
                        "schema",
                        "is_idle",
                        "memory_used_mib",
                        "memory_total_mib",
                        "unified_memory",
                        "probe",
                        "taken_at",
                        "gpus",
                        "processes",
                        "host",
                        "state_dir",
                    ],
                    "properties": {
                        "schema": {"const": STATUS_SCHEMA},
                        "is_idle": {
                            "type": "boolean",
                            "description": "True exactly when `processes` is empty.",
                        },
                        "memory_used_mib": nullable_int,
                        "memory_total_mib": {
                            **nullable_int,
                            "description": "From the device, else the configured --gpu-memory.",
                        },
                        "unified_memory": {"type": "boolean"},
                        "probe": {"type": "string", "examples": ["nvml", "nvidia-smi", "sim"]},
                        "taken_at": {
                            "type": "string",
                            "format": "date-time",
                            "description": "UTC, e.g. 2026-11-29T10:00:00Z.",
                        },
                        "gpus": {"type": "integer"},
                        "processes": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/GpuProcess"},
                        },
                        "host": {"$ref": "#/components/schemas/HostIdentity"},
                        "state_dir": nullable_str,
                        "starting": {
                            "type": "array",
                            "description": "With ?match= only: matching, not on the GPU yet.",
                            "items": {"$ref": "#/components/schemas/StartingProcess"},
                        },
                    },
                },
                **_records_schemas(),
            },
        },
    }


# The state store's endpoints (gpuctl.agent.store_api). Their errors carry "error" and,
# for store failures, a "hint".
SERVICE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _records_paths(unauthorized: dict[str, Any]) -> dict[str, Any]:
    """The /records paths: list, read, lease (take, renew, release), patch, touch."""

    def err(description: str) -> dict[str, Any]:
        return {
            "description": description,
            "content": {"application/json": {"schema": _ref("StoreError")}},
        }

    def body(schema: str, description: str) -> dict[str, Any]:
        return {
            "required": True,
            "description": description,
            "content": {"application/json": {"schema": _ref(schema)}},
        }

    def ok(schema: str, description: str) -> dict[str, Any]:
        return {
            "description": description,
            "content": {"application/json": {"schema": _ref(schema)}},
        }

    service = {
        "name": "service",
        "in": "path",
        "required": True,
        "description": "The service's name, as in the config.",
        "schema": {"type": "string", "pattern": SERVICE_NAME_PATTERN},
    }
    bad = err("A bad service name or request body.")
    down = err(
        "The store cannot be used: no state directory (agent started without one), "
        "or it cannot be read, written or locked."
    )
    conflict = err("The caller does not hold the lease (any more): it expired, or was voided.")
    common = {"400": bad, "401": unauthorized, "503": down}

    def op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"summary": summary, **extra, "responses": {**responses, **common}}

    record = ok("Record", "The record after the operation.")
    return {
        "/records": {
            "get": {
                "summary": "Every service's record (an expired or void lease reads as none).",
                "responses": {
                    "200": ok("RecordList", "The records, by service name."),
                    "401": unauthorized,
                    "503": down,
                },
            }
        },
        "/records/{service}": {
            "parameters": [service],
            "get": op(
                "One service's record; a service without one reads as stopped.",
                {"200": ok("Record", "The record (an expired or void lease reads as none).")},
            ),
            "patch": op(
                "Change the record, as the lease holder.",
                {"200": record, "409": conflict},
                requestBody=body("HolderUpdate", "Who asks, and what changes."),
            ),
        },
        "/records/{service}/lease": {
            "parameters": [service],
            "post": op(
                "Take the lease (the right to start or stop the service) unless another "
                "holder has a live one. A holder may take its own lease again.",
                {"200": ok("LeaseGrant", "Granted, or not, with the record as it stands.")},
                requestBody=body("LeaseRequest", "Who asks, and for how long."),
            ),
        },
        "/records/{service}/lease/renew": {
            "parameters": [service],
            "post": op(
                "Extend the lease, as its holder.",
                {"200": record, "409": conflict},
                requestBody=body("RenewRequest", "The holder's id and the new time to live."),
            ),
        },
        "/records/{service}/lease/release": {
            "parameters": [service],
            "post": op(
                "Apply an update and drop the lease, if the caller still holds it; "
                "otherwise nothing changes.",
                {"200": record},
                requestBody=body("ReleaseRequest", "The holder's id and a last update."),
            ),
        },
        "/records/{service}/touch": {
            "parameters": [service],
            "post": op(
                "Mark a use: last_used = now. Needs no lease.",
                {"200": record},
            ),
        },
    }


def _records_schemas() -> dict[str, Any]:
    """The schemas of the /records endpoints (``gpuctl.core.record``, ``Holder``)."""
    number = {"type": "number"}
    nullable_number = {"type": ["number", "null"]}
    epoch = {**number, "description": "Seconds since the epoch."}
    ttl = {
        "type": "number",
        "exclusiveMinimum": 0,
        "description": "Seconds until the lease expires by itself (finite).",
    }
    holder_id = {"type": "string", "description": "The holder's id (Holder.id)."}
    return {
        "StoreError": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"type": "string", "description": "What went wrong."},
                "hint": {"type": "string", "description": "What fixes it (may be empty)."},
            },
        },
        "Phase": {"type": "string", "enum": [p.value for p in Phase]},
        "Lease": {
            "type": "object",
            "description": "The right to start (or stop) a service; only the holder launches.",
            "required": [
                "holder",
                "host",
                "boot_id",
                "pid",
                "pid_start",
                "entry",
                "granted",
                "expires",
            ],
            "properties": {
                "holder": holder_id,
                "host": {"type": "string", "description": "The holder's hostname."},
                "boot_id": {"type": "string", "description": "The holder's kernel boot id."},
                "pid": {"type": "integer"},
                "pid_start": {
                    **nullable_number,
                    "description": "The holder process's start time: a reused pid is not it.",
                },
                "entry": {"type": "string", "description": "ensure, proxy, cron, …"},
                "granted": epoch,
                "expires": epoch,
            },
        },
        "Failure": {
            "type": "object",
            "required": ["at", "error", "log_tail", "count", "backoff_until"],
            "properties": {
                "at": epoch,
                "error": {"type": "string"},
                "log_tail": {"type": "string"},
                "count": {"type": "integer", "description": "Consecutive failed starts."},
                "backoff_until": {
                    **epoch,
                    "description": "No new start before this (10 s, doubling, at most 300 s).",
                },
            },
        },
        "Record": {
            "type": "object",
            "description": "A service's state on this host (DESIGN §3).",
            "required": [
                "schema",
                "service",
                "phase",
                "since",
                "last_used",
                "lease",
                "handle",
                "attempts",
                "failure",
                "recovered",
            ],
            "properties": {
                "schema": {"const": RECORD_SCHEMA},
                "service": {"type": "string"},
                "phase": _ref("Phase"),
                "since": {**epoch, "description": "When the phase last changed."},
                "last_used": {**nullable_number, "description": "When it was last used."},
                "lease": {
                    "oneOf": [_ref("Lease"), {"type": "null"}],
                    "description": "A live lease, else null (expired and void ones read as null).",
                },
                "handle": {
                    "type": ["object", "null"],
                    "description": "What the launcher needs to find the server again.",
                },
                "attempts": {
                    "type": "array",
                    "items": {"type": "object"},
                    "description": "The last start attempts (at most 10).",
                },
                "failure": {"oneOf": [_ref("Failure"), {"type": "null"}]},
                "recovered": {
                    "type": ["string", "null"],
                    "description": "Set once when a broken record file was set aside.",
                },
            },
        },
        "RecordList": {
            "type": "object",
            "required": ["records"],
            "properties": {"records": {"type": "array", "items": _ref("Record")}},
        },
        "Holder": {
            "type": "object",
            "description": "Who asks for a lease: a fresh id per call, and its process.",
            "required": ["id"],
            "properties": {
                "id": {"type": "string"},
                "host": {"type": "string"},
                "boot_id": {"type": "string"},
                "pid": {"type": "integer"},
                "pid_start": nullable_number,
                "entry": {"type": "string"},
            },
        },
        "RecordUpdate": {
            "type": "object",
            "description": "Changes to a record; every key is optional.",
            "additionalProperties": False,
            "properties": {
                "phase": _ref("Phase"),
                "handle": {"type": ["object", "null"], "description": "null clears it."},
                "attempt": {"type": "object", "description": "Appended to the attempts."},
                "failure": {
                    "type": ["object", "null"],
                    "description": (
                        "A failed start: phase failed, count + 1, a back-off. null clears it."
                    ),
                    "properties": {"error": {"type": "string"}, "log_tail": {"type": "string"}},
                },
                "touch": {"type": "boolean", "description": "true: last_used = now."},
            },
        },
        "LeaseRequest": {
            "type": "object",
            "required": ["holder", "ttl_s"],
            "properties": {"holder": _ref("Holder"), "ttl_s": ttl},
        },
        "LeaseGrant": {
            "type": "object",
            "required": ["granted", "record"],
            "properties": {
                "granted": {
                    "type": "boolean",
                    "description": "false: someone else holds a live lease (see record.lease).",
                },
                "record": _ref("Record"),
            },
        },
        "RenewRequest": {
            "type": "object",
            "required": ["holder", "ttl_s"],
            "properties": {"holder": holder_id, "ttl_s": ttl},
        },
        "HolderUpdate": {
            "type": "object",
            "required": ["holder", "update"],
            "properties": {"holder": holder_id, "update": _ref("RecordUpdate")},
        },
        "ReleaseRequest": {
            "type": "object",
            "required": ["holder"],
            "properties": {"holder": holder_id, "update": _ref("RecordUpdate")},
        },
    }
