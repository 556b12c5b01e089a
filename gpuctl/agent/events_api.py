"""The journal over HTTP (``adapters.store.journal``).

=======  ==================================  =========================================
GET      /events?since=2h&service=S          {"events": [{"id": N, **event}, …], "next":
         &after=ID&limit=N                   ID | null} oldest first (``since``: a span or
                                             a Unix time; default 1h): a page of at most
                                             ``limit`` (``PAGE_MAX``) from ``after``;
                                             ``next``: read on with ``after=next``.
                                             Without ``limit``: the newest ``PAGE_MAX``
GET      /usage?since=30d                    {"since": T, "rows": [{"day", "service",
                                             "user", totals…}, …]} (``core.usage``)
GET      /events?follow=1&since=…            server-sent events: one ``data:`` line per
                                             event (JSON, with its ``id:``), as written
POST     /events                             {"events": [event, …]} → {"written": N}
                                             (events that ride on no record write: a
                                             refusal, a queue join; write token)
=======  ==================================  =========================================

The read-only token may read. Every event written through the agent (riding on a record
write, or posted here) gets the caller's peer address and the token's role in ``who``:
what the agent saw, beside what the caller says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpuctl.adapters.store.journal import Journal
from gpuctl.agent import wire
from gpuctl.agent.http import HttpError, Receive, Request, Response, Scope, Send, json_response
from gpuctl.agent.openapi_events import MAX_ID, PAGE_MAX, SINCE_PATTERN
from gpuctl.core.events import Event, parse_since

log = logging.getLogger("gpuctl.agent")
T = TypeVar("T")

MAX_READ = 100_000
FOLLOW_POLL_S = 0.5
PING_EVERY = 30
FOLLOW_MAX_S = 3600.0  # a follower reconnects after an hour (``id:`` lets it resume)
TAIL_WINDOW_S = 3600.0
# What one follower may make the agent hold. A follower that never reads holds the
# catch-up it was sent (the newest ``FOLLOW_CATCH_UP`` events, sent ``FRAME_EVENTS`` at
# a time so the socket's flow control holds back the rest), and ``MAX_BEHIND`` polls'
# batches: past that it is let go, its stream ends, and it resumes with ``?after=ID``.
# Unbounded, 20 stalled followers of a 12,819-event journal took the agent from 120 to
# 1,014 MiB and /healthz to 2 s.
FOLLOW_CATCH_UP = 1000
FRAME_EVENTS = 100
MAX_BEHIND = 120


def seen_by(scope: Scope, writer: bool, has_token: bool = True) -> dict[str, str]:
    """What the agent sees of a caller: its address and its token's role."""
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "?"
    role = "write" if writer and has_token else "read" if has_token else "open"
    return {"peer": peer, "role": role}


def _query(request: Request) -> tuple[float, str | None, bool, int, int | None]:
    q = request.query()

    def one(name: str) -> str | None:
        got = q.get(name)
        return got[-1] if got else None

    unknown = sorted(set(q) - {"since", "service", "follow", "after", "limit"})
    if unknown:
        raise HttpError(400, f"unknown query parameter {unknown[0]!r}", "see /openapi.json")
    try:
        text = one("since") or "1h"
        if not re.fullmatch(SINCE_PATTERN, text):
            raise ValueError(f"not a span of time nor a Unix time: {text[:40]!r}")
        since = parse_since(text, time.time())
        after = int(one("after") or "0")
        if not 0 <= after <= MAX_ID:
            raise ValueError(f"after must be from 0 to {MAX_ID}")
        asked = one("limit")
        limit = None if asked is None else int(asked)
        if limit is not None and not 1 <= limit <= PAGE_MAX:
            raise ValueError(f"limit must be from 1 to {PAGE_MAX}")
    except ValueError as e:
        raise HttpError(
            400,
            f"bad since, after or limit: {e}",
            f"since=2h, since=7d or a Unix time; limit from 1 to {PAGE_MAX}",
        ) from None
    follow = (one("follow") or "0") in ("1", "true", "yes")
    return since, one("service"), follow, after, limit


async def _reading(read: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``read`` in a worker thread; a journal that cannot be read (a corrupt file, a
    folder in its place) is a 503 that says so, never an internal error."""
    try:
        return await asyncio.to_thread(read, *args, **kw)
    except (sqlite3.Error, OSError) as e:
        raise HttpError(
            503, f"the journal cannot be read: {e}", "see the agent's log on the GPU host"
        ) from None


def _row(rid: int, e: Event) -> dict[str, Any]:
    return {"id": rid, **e.to_dict()}


async def get_events(journal: Journal | None, request: Request) -> Response:
    if journal is None:
        return json_response(503, {"error": "this agent has no state directory", "hint": ""})
    since, service, _, after, limit = _query(request)

    def answer() -> Response:
        # Read and encoded in the worker thread: twenty answers of 100,000 events each
        # encoded on the event loop kept /healthz waiting 5 s.
        if limit is None:  # a whole window, as a client that does not page asks it
            rows = journal.read(since, service=service, after_id=after, limit=PAGE_MAX)
            nxt = None
        else:
            rows, nxt = journal.page(since, service=service, after_id=after, size=limit)
        return json_response(200, {"events": [_row(i, e) for i, e in rows], "next": nxt})

    return await _reading(answer)


async def get_usage(journal: Journal | None, request: Request) -> Response:
    """``GET /usage?since=30d``: the journal's rows (UTC day, service, user) from
    ``since`` (closed days from the daily rows: ``Journal.usage``)."""
    if journal is None:
        return json_response(503, {"error": "this agent has no state directory", "hint": ""})
    q = request.query()
    unknown = sorted(set(q) - {"since"})
    if unknown:
        raise HttpError(400, f"unknown query parameter {unknown[0]!r}", "see /openapi.json")
    text = (q.get("since") or ["7d"])[-1]
    if not re.fullmatch(SINCE_PATTERN, text):
        raise HttpError(400, f"bad since: {text[:40]!r}", "since=7d, since=30d or a Unix time")
    since = parse_since(text, time.time())
    rows = await _reading(journal.usage, since)
    out = [
        {"day": day, "service": svc, "user": user, **t.to_dict()}
        for (day, svc, user), t in sorted(rows.items())
    ]
    return json_response(200, {"since": since, "rows": out})


async def post_events(journal: Journal | None, request: Request, seen: dict[str, str]) -> Response:
    if journal is None:
        return json_response(503, {"error": "this agent has no state directory", "hint": ""})
    body = await request.body()
    events = wire.events_request(wire.parse_body(body))
    ok = await asyncio.to_thread(journal.write, *(e.seen_by(**seen) for e in events))
    return json_response(200, {"written": len(events) if ok else 0})


class _Tail:
    """One journal poll every ``FOLLOW_POLL_S`` for every follower of one journal: each
    follower reads its own catch-up, then takes the new rows from here. Fifty open web
    views polling the journal each in a worker thread cost ``/status`` its p99."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.subscribers: set[asyncio.Queue[list[tuple[int, Event]]]] = set()
        self.task: asyncio.Future[None] | None = None

    def subscribe(self) -> asyncio.Queue[list[tuple[int, Event]]]:
        queue: asyncio.Queue[list[tuple[int, Event]]] = asyncio.Queue(MAX_BEHIND)
        self.subscribers.add(queue)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        return queue

    async def _run(self) -> None:
        # Bounded by time too (the journal is indexed on it): an event is written as it
        # happens, so one stamped an hour before it reaches the journal is not waited for.
        last: int | None = None
        while self.subscribers:
            # A journal that cannot be read now (a file set aside meanwhile) is tried
            # again at the next poll: the followers stay, and hear of what comes after.
            try:
                if last is None:
                    newest = await asyncio.to_thread(
                        self.journal.read, time.time() - TAIL_WINDOW_S, limit=1
                    )
                    last = newest[-1][0] if newest else 0
                rows = await asyncio.to_thread(
                    self.journal.read, time.time() - TAIL_WINDOW_S, after_id=last, limit=MAX_READ
                )
            except (sqlite3.Error, OSError) as e:
                log.warning("following the journal: %s", e)
                rows = []
            if rows:
                last = max(i for i, _ in rows)
                for queue in list(self.subscribers):
                    try:
                        queue.put_nowait(rows)
                    except asyncio.QueueFull:  # it does not read: let go (see MAX_BEHIND)
                        self.subscribers.discard(queue)
            await asyncio.sleep(FOLLOW_POLL_S)


# One tail per journal and event loop (an agent's; tests run several in one process).
_TAILS: dict[tuple[str, int], _Tail] = {}


def _tail(journal: Journal) -> _Tail:
    key = (str(journal.state_dir), id(asyncio.get_running_loop()))
    tail = _TAILS.get(key)
    if tail is None:
        tail = _TAILS[key] = _Tail(journal)
    return tail


async def follow_events(
    journal: Journal | None, scope: Scope, receive: Receive, send: Send
) -> None:
    """``?follow=1``: server-sent events until the client goes (or ``FOLLOW_MAX_S``)."""
    request = Request(scope, receive)
    since, service, _, after, _ = _query(request)
    if journal is None:
        raise HttpError(503, "this agent has no state directory", "start it with --state-dir")
    tail = _tail(journal)
    # Subscribed before the catch-up: a row written in between comes twice, never not
    # at all (the ids sort the repeat out). The catch-up is read before the answer
    # starts, so a journal that cannot be read is a 503 like ``GET /events``.
    queue = tail.subscribe()
    try:
        rows = await _reading(
            journal.read, since, service=service, after_id=after, limit=FOLLOW_CATCH_UP
        )
    except HttpError:
        tail.subscribers.discard(queue)
        raise
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
            ],
        }
    )
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()
                return

    def frames(rows: list[tuple[int, Event]]) -> bytes:
        return b"".join(
            f"id: {i}\ndata: {json.dumps(_row(i, e), separators=(',', ':'))}\n\n".encode()
            for i, e in rows
        )

    async def send_rows(rows: list[tuple[int, Event]]) -> None:
        for at in range(0, len(rows), FRAME_EVENTS):
            chunk = frames(rows[at : at + FRAME_EVENTS])
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    watcher = asyncio.create_task(watch())
    deadline = time.monotonic() + FOLLOW_MAX_S
    polls = 0
    try:
        last = max((i for i, _ in rows), default=after)
        await send_rows(rows)
        while not gone.is_set() and time.monotonic() < deadline and queue in tail.subscribers:
            batch: list[tuple[int, Event]] = []
            with contextlib.suppress(TimeoutError):
                batch = await asyncio.wait_for(queue.get(), FOLLOW_POLL_S)
            fresh = [
                (i, e)
                for i, e in batch
                if i > last and e.at >= since and (service is None or e.service == service)
            ]
            if fresh:
                last = max(i for i, _ in fresh)
            polls += 1
            await send_rows(fresh)
            if not fresh and polls % PING_EVERY == 0:  # keeps proxies from closing it
                await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        tail.subscribers.discard(queue)
        watcher.cancel()
