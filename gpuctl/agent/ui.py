"""The live web view at ``/ui`` (docs/how-to/web-view.md).

=======  ==================  ==========================================================
GET      /ui, /ui/FILE       the page and its static files: no token, no data, shipped
                            inside the wheel (``ui_static/``), under a strict CSP
GET      /ui/state           bearer: everything the page draws, in one answer
POST     /actions/ensure     write token: ``{"service": S}``, the CLI's flows (``UiBackend``)
POST     /actions/stop       write token
POST     /actions/resume     write token
=======  ==================  ==========================================================

The page holds no secret and runs no inline script: every byte of data comes through a
request that carries the bearer token (the event stream too: the page reads
``/events?follow=1`` with ``fetch``, since ``EventSource`` cannot send a header).

The agent may not build a caller's adapters (its layer fence), so the flows the buttons
run come in through ``UiBackend``, which ``gpuctl agent`` builds from the config.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from gpuctl.agent import wire
from gpuctl.agent.http import HttpError, Request, Response, json_response, make_response
from gpuctl.core.durations import expected_start_s
from gpuctl.core.names import is_service_name
from gpuctl.core.record import Record

STATIC_DIR = Path(__file__).with_name("ui_static")
ACTIONS = ("ensure", "stop", "resume")
HISTORY_EVERY_S = 10.0
HISTORY_POINTS = 360  # an hour at HISTORY_EVERY_S

# Nothing from another origin, no inline script or style, no plugins, no framing: data
# reaches the page only through fetch() to this agent.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
_SECURITY_HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)
_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
}


def secured(headers: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[bytes, bytes], ...]:
    """``headers`` with the page's security headers where they are missing: every answer
    under ``/ui`` carries them, ``/ui/state`` and an error (which quotes the path) too."""
    have = {name for name, _ in headers}
    return (*headers, *(h for h in _SECURITY_HEADERS if h[0] not in have))


class UiBackend(Protocol):
    """What the page needs beyond the agent's own reading: the config's view.

    ``has_config``: False when the agent started without a config; then ``status``
    returns None and ``act`` refuses ensure and resume (a command taken from a record
    is never run). Both block: the agent calls them in a worker thread.
    """

    has_config: bool

    def status(self) -> dict[str, Any] | None:
        """The ``gpuctl status --json`` object for this host, or None without a config."""
        ...

    def act(
        self, op: str, service: str, seen: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Run ``op`` (ensure, stop, resume) on ``service`` as the CLI would, the journal
        naming the page as the actor and ``seen`` (the caller's peer and token role, as
        the agent saw them) in each event's ``who``. Returns the HTTP status and a JSON
        object with at least ``ok`` and ``message``."""
        ...


def static_routes() -> dict[str, Response]:
    """The page's files as answers, read once: ``/ui`` is the page itself."""
    out: dict[str, Response] = {}
    for path in sorted(STATIC_DIR.iterdir()):
        kind = _TYPES.get(path.suffix)
        if kind is None or not path.is_file():
            continue
        response = make_response(200, path.read_bytes(), kind, _SECURITY_HEADERS)
        out["/ui" if path.name == "index.html" else f"/ui/{path.name}"] = response
    return out


def static_paths() -> list[tuple[str, str]]:
    """(path, media type) of each file ``static_routes`` serves, for the OpenAPI document."""
    out: list[tuple[str, str]] = []
    for path in sorted(STATIC_DIR.iterdir()):
        kind = _TYPES.get(path.suffix)
        if kind is not None and path.is_file():
            name = "/ui" if path.name == "index.html" else f"/ui/{path.name}"
            out.append((name, kind.decode().split(";")[0]))
    return out


class MemoryHistory:
    """An hour of GPU memory readings, one every ``HISTORY_EVERY_S``: the sparkline."""

    def __init__(self) -> None:
        self.points: collections.deque[tuple[float, list[int | None]]] = collections.deque(
            maxlen=HISTORY_POINTS
        )

    def add(self, at: float, used: list[int | None]) -> None:
        self.points.append((round(at, 1), used))

    def to_wire(self) -> dict[str, Any]:
        return {"every_s": HISTORY_EVERY_S, "points": [[t, u] for t, u in self.points]}


def record_row(rec: Record) -> dict[str, Any]:
    """What the page shows of a record: phase and times, never its command or secrets."""
    pid = (rec.handle or {}).get("pid")
    return {
        "service": rec.service,
        "phase": rec.phase.value,
        "since": rec.since,
        "last_used": rec.last_used,
        "expected_s": expected_start_s(rec),
        "pid": pid if isinstance(pid, int) else None,
        "failed": rec.failure is not None,
    }


# Actions under way at once; more wait in line for a thread. A stop waits out its
# server's grace period in its thread: in the shared pool (cpu + 4 threads) a handful of
# clicks, or of posts with the write token, would hold every read the agent makes.
ACTION_WORKERS = 4
_ACTIONS = ThreadPoolExecutor(ACTION_WORKERS, thread_name_prefix="gpuctl-action")


async def act(
    backend: UiBackend | None, op: str, request: Request, seen: dict[str, str]
) -> Response:
    """``POST /actions/{op}``: checked here, run by the backend in a worker thread."""
    body = wire.parse_body(await request.body())
    if not isinstance(body, dict) or set(body) != {"service"}:
        raise HttpError(400, 'expected {"service": NAME}', "name the service to " + op)
    service = body["service"]
    if not isinstance(service, str) or not is_service_name(service):
        raise HttpError(400, "not a service name", "use the name the config gives it")
    if backend is None:  # an app built without one (tests, embedders): nothing to run
        return json_response(
            409,
            {
                "ok": False,
                "message": "this agent runs no flows",
                "hint": "start it with `gpuctl agent` (it reads the config of the GPU host)",
            },
        )
    # Its own pool (``ACTION_WORKERS``); the flows' journal context (``story.seen_as``)
    # is set in the thread by the backend itself.
    loop = asyncio.get_running_loop()
    status, payload = await loop.run_in_executor(
        _ACTIONS, functools.partial(backend.act, op, service, seen)
    )
    return json_response(status, payload)


def now() -> float:
    return time.time()
