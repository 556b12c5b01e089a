"""``AgentStore``: the store through the host agent's ``/records`` endpoints.

``curl -H 'Authorization: Bearer …' http://dgx:9400/records`` lists the records. The agent
serves them with a ``DirectStore``, so both paths work on the same files under the same
locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuctl.adapters.store.base import check_name
from gpuctl.adapters.store.codec import (
    RecordError,
    decode_record,
    decode_set_aside,
    decode_voided,
    decode_waiter,
    decode_waiters,
)
from gpuctl.core.promise import Promise
from gpuctl.core.queue import Waiter
from gpuctl.core.record import INFLIGHT_TTL_MAX_S, Holder, Listing, Record, SetAside, Voided
from gpuctl.core.record_shapes import RecordUpdate
from gpuctl.errors import (
    AgentUnavailable,
    GpuctlError,
    LauncherError,
    NoStore,
    StoreError,
    UsageError,
)

# What agents before the "code" key said.
_NO_STORE = "this agent has no state directory"
# ``events``: the events one page asks for (the agent answers at most 2,000), and the
# newest that many kept of a longer read.
EVENTS_PAGE = 2000
EVENTS_MAX = 100_000
EVENTS_PAGES_MAX = 1000  # 2,000,000 events: more than a journal of 512 MiB holds

if TYPE_CHECKING:
    import httpx

    from gpuctl.core.events import Event
    from gpuctl.core.usage import Tally


class AgentStore:
    """The store through the host agent's ``/records`` endpoints (same semantics)."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float = 5.0,
        host_name: str = "?",
        *,
        client: httpx.Client | None = None,
        read_token: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        """``client``: a command's shared client (``http_clients.http_client``), which the
        command closes; ``read_token``: the host's read-only token, sent when there is no
        ``token`` (a write with it is refused: 403, an AgentAuthError that says so);
        ``connect_timeout_s``: how long reaching the agent may take (default
        ``timeout_s``). ``timeout_s`` leaves a connected agent the time to wait for a
        lock on its host and say so; reaching it needs no lock, so an unreachable host
        (a partition drops the SYN) is told within the host's own timeout."""

        from gpuctl.adapters.http_clients import http_client

        self.base_url = base_url.rstrip("/")
        self.host_name = host_name
        self.timeout_s = timeout_s
        self._token = token or None
        self._read_token = self._token or read_token or None
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self._timeout = self._bounded(timeout_s)
        self._owned = client is None
        self._keeps_promises = True  # until the agent refuses the key (an older one)
        self._keeps_events = True  # likewise, for the journal's events
        # No credentials on the client: each request carries its own (a shared client
        # also talks to health URLs, which must never see the agent's token).
        self._client = client if client is not None else http_client(timeout_s)

    def _bounded(self, timeout_s: float) -> httpx.Timeout:
        """``timeout_s`` for a request, its connect within ``connect_timeout_s``."""
        import httpx

        return httpx.Timeout(timeout_s, connect=min(timeout_s, self.connect_timeout_s))

    @property
    def token_sent(self) -> bool:
        return self._token is not None

    def close(self) -> None:
        if self._owned:
            self._client.close()

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        refused: frozenset[int] = frozenset(),
    ) -> Any:
        """One request; errors as the status client words them (one shared vocabulary).

        A 409 (the lease is not ours) is a StoreError, not an unavailable agent. A status in
        ``refused`` that carries the agent's JSON error is a LauncherError in its words.
        """
        import httpx

        from gpuctl.adapters.agent_client import _json_or_none, parse_response, transport_error

        # A write with only the read-only token configured still sends it: the agent's 403
        # then says exactly that (rather than a 401 "we have no token").
        token = self._read_token if method == "GET" else (self._token or self._read_token)
        read_only = method != "GET" and self._token is None and token is not None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            timeout = self._timeout if timeout_s is None else self._bounded(timeout_s)
            r = self._client.request(
                method, self.base_url + path, json=body, headers=headers, timeout=timeout
            )
        except httpx.HTTPError as e:
            waited = timeout.connect if isinstance(e, httpx.ConnectTimeout) else timeout.read
            raise transport_error(e, self.base_url, waited or self.timeout_s) from None
        if r.status_code in refused:
            data = _json_or_none(r)
            if isinstance(data, dict) and isinstance(data.get("error"), str):
                hint = data.get("hint")
                raise LauncherError(
                    f"the agent on {self.host_name} refused: {data['error']}",
                    hint=hint if isinstance(hint, str) else "",
                )
        if r.status_code in (400, 409, 503):
            # The agent answered, but its store could not do it (not the lease holder, a
            # lock held too long, no state dir): the same StoreError the files give. A
            # 400 is a request the files would refuse too (a bad update): a UsageError.
            data = _json_or_none(r)
            if isinstance(data, dict) and isinstance(data.get("error"), str):
                hint = data.get("hint")
                if r.status_code == 400:
                    raise UsageError(
                        f"the store on {self.host_name} refused it: {data['error']}",
                        hint=hint if isinstance(hint, str) else "",
                    )
                # NoStore: an agent without a state dir; the caller may do without records.
                no_store = data.get("code") == "no_store" or data["error"] == _NO_STORE
                cls = NoStore if no_store else StoreError
                raise cls(
                    f"the store on {self.host_name}: {data['error']}",
                    hint=hint if isinstance(hint, str) else "",
                )
        return parse_response(
            r, self.base_url, self.host_name, token is not None, read_only=read_only
        )

    def _record(self, data: Any) -> Record:
        try:
            return decode_record(data)
        except ValueError as e:
            raise self._broken(f"a broken record: {e}") from None

    def get(self, service: str) -> Record:
        return self._record(self._call("GET", f"/records/{check_name(service)}"))

    def records(self) -> list[Record]:
        return self.listing().records

    def listing(self) -> Listing:
        data = self._call("GET", "/records")
        records = data.get("records") if isinstance(data, dict) else None
        if not isinstance(records, list):
            raise self._broken("a record list without its records")
        return Listing([self._record(r) for r in records], self._set_aside(data))

    def _broken(self, what: str) -> GpuctlError:
        return AgentUnavailable(f"the agent at {self.base_url} sent {what}")

    def set_aside(self) -> list[SetAside]:
        return self._set_aside(self._call("GET", "/records"))

    def _set_aside(self, data: Any) -> list[SetAside]:
        if not isinstance(data, dict):
            raise self._broken("a record list that is not an object")
        try:
            # An agent before this key had no such list to give.
            return decode_set_aside(data.get("set_aside", []))
        except ValueError as e:
            raise self._broken(f"a broken set-aside list: {e}") from None

    def acquire(
        self,
        service: str,
        holder: Holder,
        ttl_s: float,
        promise: Promise | None = None,
        event: Event | None = None,
    ) -> tuple[bool, Record]:
        body: dict[str, Any] = {"holder": holder.to_dict(), "ttl_s": ttl_s}
        path = f"/records/{check_name(service)}/lease"
        try:
            data = self._promising("POST", path, self._with_event(body, event), promise)
        except UsageError as e:
            if event is None or "event" not in e.message or "unknown field" not in e.message:
                raise
            self._keeps_events = False
            data = self._promising("POST", path, body, promise)
        granted = data.get("granted") if isinstance(data, dict) else None
        if not isinstance(granted, bool):
            raise self._broken("a lease answer without a boolean 'granted'")
        return granted, self._record(data.get("record"))

    def renew(self, service: str, holder_id: str, ttl_s: float) -> Record:
        return self._record(
            self._call(
                "POST",
                f"/records/{check_name(service)}/lease/renew",
                {"holder": holder_id, "ttl_s": ttl_s},
            )
        )

    def release(
        self,
        service: str,
        holder_id: str,
        update: RecordUpdate | None = None,
        event: Event | None = None,
    ) -> Record:
        body = {
            "holder": holder_id,
            "update": update.fitted().to_wire() if update is not None else {},
        }
        path = f"/records/{check_name(service)}/lease/release"
        return self._record(self._eventful("POST", path, body, event))

    def update(
        self, service: str, holder_id: str, update: RecordUpdate, event: Event | None = None
    ) -> Record:
        body = {"holder": holder_id, "update": update.fitted().to_wire()}
        return self._record(self._eventful("PATCH", f"/records/{check_name(service)}", body, event))

    def note(self, *events: Event) -> None:
        """``POST /events``; never raises (the journal is a witness, not a gate)."""
        if not events or not self._keeps_events:
            return
        try:
            self._call("POST", "/events", {"events": [e.to_dict() for e in events]})
        except GpuctlError as e:
            from gpuctl.adapters.store.journal import dropped

            dropped(f"the agent on {self.host_name}: {e.message}")

    def events(
        self, since: float, *, service: str | None = None, after_id: int = 0
    ) -> list[tuple[int, Event]]:
        """The agent's journal (``GET /events``), oldest first, read a page at a time
        (an agent holds one page per answer); the newest ``EVENTS_MAX`` at most. An
        agent that does not page answers one window, its newest events."""
        from collections import deque
        from urllib.parse import urlencode

        from gpuctl.core.events import event_from_dict

        out: deque[tuple[int, Event]] = deque(maxlen=EVENTS_MAX)
        after: int | None = after_id
        for _ in range(EVENTS_PAGES_MAX):
            if after is None:
                break
            q = {"since": f"{since:.6f}", "after": str(after), "limit": str(EVENTS_PAGE)}
            if service is not None:
                q["service"] = service
            data = self._call("GET", f"/events?{urlencode(q)}")
            rows = data.get("events") if isinstance(data, dict) else None
            if not isinstance(rows, list):
                raise self._broken("an event list without its events")
            for row in rows:
                if isinstance(row, dict) and isinstance(row.get("id"), int):
                    body = {k: v for k, v in row.items() if k != "id"}
                    try:
                        out.append((row["id"], event_from_dict(body, stored=True)))
                    except (ValueError, KeyError, TypeError) as e:
                        raise self._broken(f"a broken event: {e}") from None
            nxt = data.get("next")
            # A page goes forward or reading ends: a next at or before where it began, or
            # before the page's own last event (a broken or hostile agent), would read the
            # same pages for ever. A page may be short and still have a next (the agent
            # skips rows that are not events), so a hostile next that creeps on one id at a
            # time is bounded by the number of pages: EVENTS_PAGES_MAX.
            last = out[-1][0] if out else after
            moves = isinstance(nxt, int) and not isinstance(nxt, bool) and nxt > after
            after = nxt if moves and nxt >= last else None
        return list(out)

    def usage(self, since: float) -> dict[tuple[str, str, str], Tally]:
        """The agent's usage rows (``GET /usage``), keyed (UTC day, service, user)."""
        from gpuctl.core.usage import Tally

        data = self._call("GET", f"/usage?since={since:.6f}")
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise self._broken("a usage answer without its rows")
        out: dict[tuple[str, str, str], Tally] = {}
        for row in rows:
            if isinstance(row, dict):
                key = (str(row.get("day")), str(row.get("service")), str(row.get("user")))
                try:
                    out[key] = Tally.from_dict(row)
                except ValueError as e:
                    raise self._broken(f"a broken usage row: {e}") from None
        return out

    def _with_event(self, body: dict[str, Any], event: Event | None) -> dict[str, Any]:
        return {**body, "event": event.to_dict()} if event and self._keeps_events else body

    def _eventful(self, method: str, path: str, body: dict[str, Any], event: Event | None) -> Any:
        """``body`` with the event riding on it. An agent older than the journal refuses
        the key (400 "unknown field"): asked again without it, once per client."""
        if event is None or not self._keeps_events:
            return self._call(method, path, body)
        try:
            return self._call(method, path, self._with_event(body, event))
        except UsageError as e:
            if "event" not in e.message or "unknown field" not in e.message:
                raise
            self._keeps_events = False
            return self._call(method, path, body)

    def touch(self, service: str, ready: bool = False, promise: Promise | None = None) -> Record:
        path = f"/records/{check_name(service)}/touch"
        return self._record(self._promising("POST", path, {"ready": ready}, promise))

    def _promising(
        self, method: str, path: str, body: dict[str, Any], promise: Promise | None
    ) -> Any:
        """``body`` with the promise, to an agent that keeps promises. An agent older than
        promises refuses the key (400 "unknown field"): it is asked again without it, once
        per client, and its records carry no figures (other configs count them as unknown
        memory, never as none)."""
        if promise is None or not self._keeps_promises:
            return self._call(method, path, body)
        try:
            return self._call(method, path, {**body, "promise": promise.to_dict()})
        except UsageError as e:
            if "promise" not in e.message or "unknown field" not in e.message:
                raise
            self._keeps_promises = False
            return self._call(method, path, body)

    def inflight_begin(self, service: str, holder: Holder, ttl_s: float) -> tuple[bool, Record]:
        data = self._call(
            "POST",
            f"/records/{check_name(service)}/inflight",
            {"holder": holder.to_dict(), "ttl_s": ttl_s},
        )
        return bool(data.get("granted")), self._record(data.get("record"))

    def inflight_renew(self, service: str, holder: Holder, ttl_s: float) -> Record:
        return self._record(
            self._call(
                "POST",
                f"/records/{check_name(service)}/inflight/renew",
                {"holder": holder.to_dict(), "ttl_s": ttl_s},
            )
        )

    def inflight_end(self, service: str, holder_id: str, linger_s: float = 0.0) -> Record:
        body: dict[str, Any] = {"holder": holder_id}
        if linger_s:  # an agent of a release before lingering entries refuses it (400)
            body["linger_s"] = linger_s
        return self._record(
            self._call("POST", f"/records/{check_name(service)}/inflight/end", body)
        )

    def stop_job(
        self, service: str, holder_id: str, pid: int, pid_start: float, grace_s: float
    ) -> bool:
        """The agent stops a ``gpuctl run --preemptible`` job whose CMD runs on its machine
        (``POST /records/{service}/stop``): SIGTERM, ``grace_s``, SIGKILL. It does so only
        for a live run record of ``service`` that names ``pid`` with ``pid_start``, is
        preemptible, and whose lease ``holder_id`` holds. Returns whether it had to be
        killed. The request waits for the stop: the grace period, and a margin.

        Raises:
            LauncherError: the agent refused (no such live preemptible job, another pid,
                not our lease, a job it may not signal), or it has no such endpoint.
            StoreError, AgentUnavailable: as every store call.
        """
        data = self._call(
            "POST",
            f"/records/{check_name(service)}/stop",
            {"holder": holder_id, "pid": pid, "pid_start": pid_start, "grace_s": grace_s},
            timeout_s=grace_s + max(self.timeout_s, 5.0),
            refused=frozenset({403, 404, 409}),
        )
        killed = data.get("killed") if isinstance(data, dict) else None
        if not isinstance(killed, bool):
            raise self._broken("a job stop answer without a boolean 'killed'")
        return killed

    def voided(self) -> list[Voided]:
        data = self._call("GET", "/records/_voided")
        try:
            return decode_voided(data.get("voided") if isinstance(data, dict) else None)
        except RecordError as e:
            raise self._broken(f"a broken list of voided leases ({e})") from None

    def inflight(self) -> dict[str, int]:
        data = self._call("GET", "/records/_inflight")
        counts = data.get("inflight") if isinstance(data, dict) else None
        if not isinstance(counts, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in counts.items()
        ):
            raise AgentUnavailable(f"the agent at {self.base_url} sent broken in-flight counts")
        return dict(counts)

    def lingering(self) -> dict[str, float]:
        data = self._call("GET", "/records/_inflight")
        # An agent of a release before lingering entries has none to tell.
        left = data.get("lingering", {}) if isinstance(data, dict) else None
        if not isinstance(left, dict) or not all(
            isinstance(k, str)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and 0 <= v <= INFLIGHT_TTL_MAX_S
            for k, v in left.items()
        ):
            raise AgentUnavailable(
                f"the agent at {self.base_url} sent broken lingering in-flight entries"
            )
        return {k: float(v) for k, v in left.items()}

    def queue_join(
        self, holder: Holder, ttl_s: float, *, name: str, priority: int, memory_mib: int
    ) -> tuple[Waiter, list[Waiter]]:
        data = self._call(
            "POST",
            "/records/_queue",
            {
                "holder": holder.to_dict(),
                "ttl_s": ttl_s,
                "name": name,
                "priority": priority,
                "memory_mib": memory_mib,
            },
        )
        if not isinstance(data, dict):
            raise self._broken("a queue answer that is not an object")
        try:
            return decode_waiter(data.get("waiter"), "$.waiter"), decode_waiters(data.get("queue"))
        except ValueError as e:
            raise self._broken(f"a broken queue answer: {e}") from None

    def queue_leave(self, holder_id: str) -> bool:
        data = self._call("POST", "/records/_queue/leave", {"holder": holder_id})
        left = data.get("left") if isinstance(data, dict) else None
        if not isinstance(left, bool):
            raise self._broken("a queue answer without a boolean 'left'")
        return left

    def waiters(self) -> list[Waiter]:
        data = self._call("GET", "/records/_queue")
        try:
            return decode_waiters(data.get("queue") if isinstance(data, dict) else None)
        except ValueError as e:
            raise self._broken(f"a broken queue: {e}") from None
