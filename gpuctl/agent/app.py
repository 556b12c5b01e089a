"""The GPU host agent as a raw ASGI application (docs/reference/agent.md).

No web framework: Starlette/FastAPI would cost import time and a good share of the
throughput, and the agent needs only a handful of fixed routes. ``create_app`` builds the
callable; ``gpuctl.agent.server`` runs it under uvicorn.

Endpoints::

    GET /healthz          no auth   {"ok": true, "version": ...}
    GET /openapi.json     no auth   the OpenAPI 3.1 document of this API (openapi.py)
    GET /status[?match=]  bearer    Snapshot.to_wire(); 503 when the probe fails (?fresh=1:
                                    bypass the reading cache; query.py)
    GET /metrics          bearer    Prometheus text (metrics.py)
    … /records…           bearer    the state store (store_api.py)
    GET /ui, /ui/…        no auth   the live web view: static files, no data (ui.py)
    GET /ui/state         bearer    everything the page draws
    POST /actions/{op}    write     ensure, stop, resume through the CLI's flows (ui.py)

Many pollers, one scan: the probe reading is cached for ``cache_ttl_s`` and refreshed by
one scan at a time (requests that arrive during a scan wait for it, cache.py). Probes
block (NVML, an ``nvidia-smi`` subprocess), so scans run in a worker thread and the event
loop keeps serving. The encoded ``/status`` body is cached per keyword set, so the hot
path is a dict lookup and a ``send``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from gpuctl import __version__
from gpuctl.adapters.pipeline import on_pipes
from gpuctl.adapters.probes.base import Probe
from gpuctl.adapters.procinfo import describe_pids, find_matching
from gpuctl.adapters.store.journal import counters as journal_counters
from gpuctl.adapters.store.journal import failures as journal_failures
from gpuctl.adapters.store.journal import journal_for
from gpuctl.agent import events_api, ui
from gpuctl.agent.auth import Tokens
from gpuctl.agent.cache import FolderStamp, Outcome, TtlCell
from gpuctl.agent.events_api import seen_by
from gpuctl.agent.http import (
    ASGIApp,
    Handler,
    HttpError,
    Receive,
    Request,
    Response,
    Router,
    Scope,
    Send,
    error_response,
    json_response,
    make_response,
)
from gpuctl.agent.metrics import render_metrics
from gpuctl.agent.openapi import openapi_document
from gpuctl.agent.query import (
    MAX_MATCH_SETS,
    check_known,
    parse_exclude,
    parse_fresh,
    parse_match,
    parse_pids,
)
from gpuctl.agent.settings import AgentSettings
from gpuctl.agent.snapshot import Scan, Servers, agent_snapshot, scan_servers
from gpuctl.agent.store_api import StoreApi, read_all
from gpuctl.agent.upkeep import HealthGate, promote_loop
from gpuctl.core.durations import StartTally
from gpuctl.core.health_reach import HealthReach
from gpuctl.core.record import Record
from gpuctl.core.snapshot import Snapshot, StartingProcess
from gpuctl.core.timestamps import iso_utc
from gpuctl.errors import GpuctlError, ProbeError

# AgentSettings lives in settings.py; callers build both from here.
__all__ = ["AgentApp", "AgentSettings", "create_app"]

log = logging.getLogger("gpuctl.agent")
PRUNE_EVERY_S = 3600.0


class _MatchSlot(msgspec.Struct):
    cell: TtlCell[tuple[StartingProcess, ...]]
    # (scan, match, servers outcomes, response): valid while all three are current.
    body: tuple[object, object, object, Response] | None = None


# --------------------------------------------------------------------------- the agent


class AgentApp:
    """The ASGI callable. Build it with ``create_app``."""

    def __init__(
        self, settings: AgentSettings, probe: Probe, ui_backend: ui.UiBackend | None = None
    ) -> None:
        self.settings = settings
        self.probe = probe
        self.ui_backend = ui_backend
        self.history = ui.MemoryHistory()
        self._ui_status: TtlCell[dict[str, Any] | None] | None = (
            TtlCell(ui_backend.status, max(settings.cache_ttl_s, 0.5))
            if ui_backend is not None
            else None
        )
        self._sampler: asyncio.Future[None] | None = None
        self._tokens = Tokens(settings.token, settings.read_token)
        self.router = Router()
        self.requests_total: dict[str, int] = {}
        self.probe_errors_total = 0
        # Every successful start seen in the records, for the start histogram: kept for
        # the agent's life, so its counts never go down (records keep only the last few).
        self.starts = StartTally()
        self._scan = TtlCell(self._read_probe, settings.cache_ttl_s)
        self._plain_body: tuple[object, object, Response] | None = None
        self._matches: dict[tuple[str, ...], _MatchSlot] = {}
        self._promoter: asyncio.Task[None] | None = None
        self._pruner: asyncio.Future[None] | None = None

        self._healthz = json_response(200, {"ok": True, "version": __version__})
        # Built on the first GET /openapi.json: most agents never serve it, and its
        # schemas cost about 30 ms of CPU at every start.
        self._openapi: Response | None = None

        self.router.add("GET", "/healthz", self._get_healthz, auth=False)
        self.router.add("GET", "/openapi.json", self._get_openapi, auth=False)
        self.router.add("GET", "/status", self._get_status)
        self.router.add("GET", "/metrics", self._get_metrics)
        self.router.add("GET", "/events", self._get_events)
        self.router.add("POST", "/events", self._post_events)
        self.router.add("GET", "/usage", self._get_usage)
        for path, response in ui.static_routes().items():
            self.router.add("GET", path, self._static(response), auth=False)
        self.router.add("GET", "/ui/state", self._get_ui_state)
        for op in ui.ACTIONS:
            self.router.add("POST", f"/actions/{op}", self._action(op))

        self.store_api = StoreApi(settings.state_dir, on_write=self.invalidate, host=settings.host)
        store = self.store_api.store
        self.journal = journal_for(store.state_dir) if store is not None else None
        self._servers = TtlCell(
            lambda: scan_servers(store, settings.match, settings.match_max_age_s, settings.sim_dir),
            settings.cache_ttl_s,
        )
        # Writes straight to the files (not through us) must not leave a stale reading.
        self._records_stamp = (
            FolderStamp(store.state_dir / "records") if store is not None else None
        )

    async def _get_events(self, request: Request) -> Response:
        return await events_api.get_events(self.journal, request)

    async def _get_usage(self, request: Request) -> Response:
        return await events_api.get_usage(self.journal, request)

    async def _post_events(self, request: Request) -> Response:
        writer = self._tokens.check(request.scope, write=True)
        seen = seen_by(request.scope, writer, self.settings.token is not None)
        return await events_api.post_events(self.journal, request, seen)

    @staticmethod
    def _static(response: Response) -> Handler:
        async def get(request: Request) -> Response:
            return response

        return get

    def _action(self, op: str) -> Handler:
        async def post(request: Request) -> Response:
            # The route's own check passed: the write token, or an agent without one.
            seen = seen_by(request.scope, True, self.settings.token is not None)
            return await ui.act(self.ui_backend, op, request, seen)

        return post

    async def _sample_loop(self) -> None:
        """The sparkline's hour: GPU memory every ``ui.HISTORY_EVERY_S``, the first one
        an interval after start (an agent that only refuses requests, or serves one
        /status, reads the GPU no more than that)."""
        while True:
            await asyncio.sleep(ui.HISTORY_EVERY_S)
            outcome = await self._scan.get()
            if outcome.value is not None:
                devices = outcome.value.reading.device_list()
                self.history.add(time.time(), [d.memory_used_mib for d in devices])

    async def _get_ui_state(self, request: Request) -> Response:
        """Everything the page draws: the config's view (or, without one, the agent's own
        snapshot), the records' phases and times, the wait queue, the memory history."""
        writer = self._tokens.check(request.scope, write=False)
        role = seen_by(request.scope, writer, self.settings.token is not None)["role"]
        status: dict[str, Any] | None = None
        if self._ui_status is not None:
            got = await self._ui_status.get()
            if got.error is not None:
                raise HttpError(
                    503, f"reading the status failed: {got.error}", "see the agent's log"
                )
            status = got.value
        snapshot: dict[str, Any] | None = None
        if status is None:
            scan = await self._current_scan()
            servers = await self._current_servers(False)
            assert scan.value is not None and servers.value is not None
            snapshot = self.snapshot(scan.value, None, servers.value).to_wire()
        records: list[dict[str, Any]] = []
        queue: list[dict[str, Any]] = []
        store = self.store_api.store
        if store is not None:
            recs, _ = await asyncio.to_thread(read_all, store)
            records = [ui.record_row(r) for r in recs]
            waiters = await asyncio.to_thread(store.waiters)
            queue = [
                {
                    "name": w.name,
                    "priority": w.priority,
                    "memory_mib": w.memory_mib,
                    "seq": w.seq,
                    "since": w.since,
                }
                for w in waiters
            ]
        return json_response(
            200,
            {
                "role": role,
                "config": self.ui_backend is not None and self.ui_backend.has_config,
                "actions": self.ui_backend is not None,
                "now": time.time(),
                "status": status,
                "snapshot": snapshot,
                "records": records,
                "queue": queue,
                "history": self.history.to_wire(),
            },
        )

    async def _prune_loop(self) -> None:
        """Retention (``journal.maintain``): at start, then every ``PRUNE_EVERY_S``."""
        assert self.journal is not None
        while True:
            await asyncio.to_thread(self.journal.maintain, self.settings.journal_days)
            await asyncio.sleep(PRUNE_EVERY_S)

    def invalidate(self) -> None:
        """The store changed: the next /status reads the GPU and the processes afresh."""
        self._scan.invalidate()
        self._servers.invalidate()
        for slot in self._matches.values():
            slot.cell.invalidate()

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
                if self.store_api.store is not None:
                    interval = min(max(self.settings.cache_ttl_s, 0.5), 5.0)
                    self._promoter = asyncio.ensure_future(
                        promote_loop(
                            self.store_api.store,
                            interval,
                            self.invalidate,
                            HealthGate(HealthReach(self.settings.health_ports)),
                        )
                    )
                if self.journal is not None:
                    self._pruner = asyncio.ensure_future(self._prune_loop())
                self._sampler = asyncio.ensure_future(self._sample_loop())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for task in (self._promoter, self._pruner, self._sampler):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        route = self.router.routes.get(path)
        store_path = route is None and (path == "/records" or path.startswith("/records/"))
        # One label for the whole store (service names would make the label set unbounded).
        label = route.path if route is not None else "/records" if store_path else "other"
        self.requests_total[label] = self.requests_total.get(label, 0) + 1
        method = scope["method"]
        try:
            if (
                path == "/events"
                and method == "GET"
                and b"follow=1" in scope.get("query_string", b"")
            ):
                self._tokens.check(scope, write=False)
                await events_api.follow_events(self.journal, scope, receive, send)
                return
            if store_path:
                # The state store: path parameters, so it routes itself (store_api.py).
                op, service = self.store_api.route(method, path)
                writer = self._tokens.check(scope, write=self.store_api.is_write(op))
                body = await Request(scope, receive).body()
                status, payload = await self.store_api.handle(
                    op,
                    service,
                    body,
                    masked=not writer,
                    seen=seen_by(scope, writer, self.settings.token is not None),
                )
                response = json_response(status, payload)
            else:
                if route is None:
                    raise HttpError(404, f"no such endpoint: {path[:200]}", "see /openapi.json")
                handler = route.handlers.get("GET" if method == "HEAD" else method)
                if handler is None:
                    allowed = ", ".join(self.router.allowed(route))
                    raise HttpError(
                        405,
                        f"{method} is not allowed on {route.path}",
                        f"use {allowed}",
                        [(b"allow", allowed.encode())],
                    )
                if route.auth:
                    self._tokens.check(scope, write=method not in ("GET", "HEAD"))
                response = await handler(Request(scope, receive))
        except HttpError as err:
            response = error_response(err.status, err.error, err.hint, err.headers)
        except Exception as err:
            log.exception("%s %s failed", method, path)
            response = error_response(
                500,
                f"internal error in the agent: {type(err).__name__}: {err}",
                "see the agent's log on the GPU host, and report it",
            )
        headers = response.headers
        if path == "/ui" or path.startswith("/ui/"):
            headers = ui.secured(headers)
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if method == "HEAD" else response.body}
        )

    # -- probe

    def _read_probe(self) -> Scan:
        """Runs in a worker thread, one at a time (see TtlCell)."""
        try:
            reading = self.probe.read()
        except Exception:
            self.probe_errors_total += 1
            raise
        return Scan(reading, iso_utc())

    async def _current_scan(self, fresh: bool = False) -> Outcome[Scan]:
        outcome = await self._scan.get(fresh)
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

    def snapshot(
        self, scan: Scan, starting: tuple[StartingProcess, ...] | None, servers: Servers
    ) -> Snapshot:
        return agent_snapshot(
            scan,
            starting,
            host=self.settings.host,
            state_dir=self.settings.state_dir,
            gpu_memory_mib=self.settings.gpu_memory_mib,
            loading=servers.recorded + servers.loading,
            servers=servers.owners,
            promised=servers.promised,
        )

    def _match_slot(self, keywords: tuple[str, ...]) -> _MatchSlot:
        slot = self._matches.get(keywords)
        if slot is None:
            if len(self._matches) >= MAX_MATCH_SETS:
                # Forget the oldest keyword set (dicts keep insertion order).
                del self._matches[next(iter(self._matches))]
            slot = _MatchSlot(
                TtlCell(
                    lambda: tuple(
                        find_matching(
                            keywords,
                            state_dir=self.settings.state_dir,
                            sim_dir=self.settings.sim_dir,
                        )
                    ),
                    self.settings.cache_ttl_s,
                )
            )
            self._matches[keywords] = slot
        return slot

    async def _current_servers(self, fresh: bool) -> Outcome[Servers]:
        outcome = await self._servers.get(fresh)
        if outcome.error is not None:
            raise HttpError(
                503,
                f"reading the host's processes failed: {outcome.error}",
                "see the agent's log on the GPU host",
            )
        return outcome

    # -- handlers

    async def _get_healthz(self, request: Request) -> Response:
        return self._healthz

    async def _get_openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = json_response(200, openapi_document())
        return self._openapi

    async def _get_status(self, request: Request) -> Response:
        query = request.query() if request.query_string else {}
        check_known(query)
        keywords = parse_match(query)
        fresh = parse_fresh(query)
        # Checked whether or not they are used: a bad value is a 400 wherever it is.
        exclude, pipes = parse_exclude(query, self.settings.host.boot_id)
        pids = parse_pids(query)
        if self._records_stamp is not None and self._records_stamp.changed():
            self.invalidate()
        scan = await self._current_scan(fresh)
        servers = await self._current_servers(fresh)
        assert scan.value is not None and servers.value is not None
        if keywords is None:
            cached = self._plain_body
            if cached is not None and cached[0] is scan and cached[1] is servers:
                return cached[2]
            response = json_response(200, self.snapshot(scan.value, None, servers.value).to_wire())
            self._plain_body = (scan, servers, response)
            return response
        slot = self._match_slot(keywords)
        matched = await slot.cell.get(fresh)
        if matched.error is not None:
            raise HttpError(
                503,
                f"reading the host's processes failed: {matched.error}",
                "see the agent's log on the GPU host",
            )
        assert matched.value is not None
        # The servers the records name count whatever their command line.
        seen = {p.pid for p in matched.value}
        found = matched.value + tuple(p for p in servers.value.recorded if p.pid not in seen)
        if exclude or pipes or pids:
            # Per caller, so not cached. A caller on this host names its own process tree
            # and its pipes (its shell and `| tee vllm.log` name the service, but are not
            # it); `pids` are servers the records name, reported whatever their command.
            mine = [p for p in found if p.pid not in exclude and not on_pipes(p.pid, pipes)]
            seen = {p.pid for p in mine}
            extra = [p for p in pids if p not in seen]
            if extra:
                mine += await asyncio.to_thread(describe_pids, extra)
            snap = self.snapshot(scan.value, tuple(mine), servers.value)
            return json_response(200, snap.to_wire())
        body = slot.body
        if body is not None and body[0] is scan and body[1] is matched and body[2] is servers:
            return body[3]
        response = json_response(200, self.snapshot(scan.value, found, servers.value).to_wire())
        slot.body = (scan, matched, servers, response)
        return response

    async def _get_metrics(self, request: Request) -> Response:
        scan = await self._scan.get()
        found = await self._servers.get()  # whose each server process is, as /status says
        records: list[Record] | None = None
        store_up: bool | None = None
        unreadable = 0
        store = self.store_api.store
        if store is not None:
            # A worker thread: reading a record that needs recovery takes its file lock.
            try:
                read, bad = await asyncio.to_thread(read_all, store)
                records, unreadable, store_up = read, len(bad), True
                self.starts.fold(read)
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
            unreadable_records=unreadable,
            now=time.time(),
            servers=dict(found.value.owners) if found.value is not None else None,
            journal={**journal_counters(), "write_failures": journal_failures()}
            if self.journal is not None
            else None,
            starts=self.starts,
        )
        return make_response(200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")


def create_app(
    settings: AgentSettings, probe: Probe, ui_backend: ui.UiBackend | None = None
) -> ASGIApp:
    """Build the agent's ASGI application around ``probe``.

    Args:
        settings: token, cache TTL and what /status reports about this host.
        probe: the GPU probe; its ``read`` may block (it runs in a worker thread).
        ui_backend: the config's view and the flows behind the page's buttons
            (``gpuctl agent`` builds it); None: the page watches, and actions are 503.

    Returns:
        The ASGI callable (an ``AgentApp``).
    """
    return AgentApp(settings, probe, ui_backend)
