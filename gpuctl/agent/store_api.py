"""The agent's state-store endpoints: the ``DirectStore`` on this host, over HTTP.

``curl -H 'Authorization: Bearer …' http://dgx:9400/records/vllm``

=======  ==================================  =========================================
GET      /records                            {"records": [record, …]}
GET      /records/{svc}                      record (an expired or void lease reads as none)
POST     /records/{svc}/lease                {"holder": {…}, "ttl_s": N} → {"granted", "record"}
POST     /records/{svc}/lease/renew          {"holder": id, "ttl_s": N} → record (409 if not holder)
POST     /records/{svc}/lease/release        {"holder": id, "update": {…}} → record
PATCH    /records/{svc}                      {"holder": id, "update": {…}} → record (409 if not holder)
POST     /records/{svc}/touch                {"ready": bool} → record
POST     /records/{svc}/inflight             {"holder": {…}, "ttl_s": N} → {"granted", "record"}
POST     /records/{svc}/inflight/renew       {"holder": {…}, "ttl_s": N} → record
POST     /records/{svc}/inflight/end         {"holder": id, "linger_s": N} → record
GET      /records/_inflight                  {"inflight": {svc: holders, …}, "lingering": {svc: s, …}}
GET      /records/_voided                    {"voided": [voided, …]} (forged leases and
                                             entries, kept for a person; gpuctl locks)
GET      /records/_queue                     {"queue": [waiter, …]} (in the order served)
POST     /records/_queue                     {"holder": {…}, "ttl_s", "name", "priority",
                                             "memory_mib"} → {"waiter", "queue"} (join/renew)
POST     /records/_queue/leave               {"holder": id} → {"left": bool}
POST     /records/{job}/stop                 {"holder": id, "pid": N, "pid_start": T,
                                             "grace_s": S} → {"killed": bool}
                                             (a --preemptible run job; job_stop.py)
=======  ==================================  =========================================

The read-only token is shown each record with its secrets masked (``core.record_mask``):
its health URL's password and query tokens, and secrets in its failure's error and log
tail. The write token sees them as written: its holder wrote them, and its client's heal
fetches that health URL.

Every body is validated (``wire.py``) before the store sees it: a bad value is a 400
naming its field, never a 503 from deep inside the store. Store calls take a file lock
and may wait for it, so they run in a worker thread. Every write calls ``on_write``, so
the agent's reading cache never serves a state from before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpuctl.adapters.procinfo import host_identity
from gpuctl.adapters.store.codec import RecordError, check_record, decode_holder, decode_promise
from gpuctl.adapters.store.direct import DirectStore
from gpuctl.agent import job_stop, wire
from gpuctl.agent.http import HttpError
from gpuctl.core.events import Event
from gpuctl.core.names import is_valid_name
from gpuctl.core.promise import Promise
from gpuctl.core.record import Record
from gpuctl.core.record_mask import masked as masked_record
from gpuctl.core.record_shapes import RecordUpdate, apply_update
from gpuctl.core.redact import redact_lines
from gpuctl.core.snapshot import HostIdentity
from gpuctl.errors import GpuctlError, StoreError, UsageError

log = logging.getLogger("gpuctl.agent")

# path shape (after /records/{svc}) -> method -> operation name
_ROUTES: dict[tuple[str, ...], dict[str, str]] = {
    (): {"GET": "get", "PATCH": "update"},
    ("lease",): {"POST": "acquire"},
    ("lease", "renew"): {"POST": "renew"},
    ("lease", "release"): {"POST": "release"},
    ("touch",): {"POST": "touch"},
    ("inflight",): {"POST": "inflight_begin"},
    ("inflight", "renew"): {"POST": "inflight_renew"},
    ("inflight", "end"): {"POST": "inflight_end"},
    ("stop",): {"POST": "stop_job"},
}
_READS = frozenset({"list", "get", "inflight_list", "queue_list", "voided_list"})
# The wait queue (``gpuctl.adapters.store.queue``): not a service, so routed on its own.
_QUEUE_ROUTES: dict[tuple[str, ...], dict[str, str]] = {
    (): {"GET": "queue_list", "POST": "queue_join"},
    ("leave",): {"POST": "queue_leave"},
}


def allowed(methods: dict[str, str] | set[str]) -> str:
    names = set(methods)
    if "GET" in names:
        names.add("HEAD")
    return ", ".join(sorted(names))


def read_all(store: DirectStore) -> tuple[list[Record], list[dict[str, str]]]:
    """Every readable record, and the ones that could not be read (service, error).

    One bad record never takes the list down: ``/records`` and ``/metrics`` go on
    serving the rest. A store that cannot be read at all is a StoreError.
    """
    try:
        return store.records(), []
    except StoreError:
        raise
    except Exception as err:  # one record broke the whole listing: read them one by one
        log.warning(
            "listing the records failed (%s: %s); reading them one by one", type(err).__name__, err
        )
    records: list[Record] = []
    bad: list[dict[str, str]] = []
    try:
        names = sorted(p.stem for p in (store.state_dir / "records").glob("*.json"))
    except OSError as err:
        raise StoreError(f"cannot list {store.state_dir / 'records'}: {err}") from None
    for name in names:
        if not is_valid_name(name) or name.startswith("_"):
            continue
        try:
            records.append(store.get(name))
        except StoreError:
            raise
        except Exception as err:
            log.warning("the record of %r cannot be read: %s: %s", name, type(err).__name__, err)
            why = redact_lines(f"{type(err).__name__}: {err}"[:500])
            bad.append({"service": name, "error": why})
    return records, bad


# Job stops under way at once (job_stop.py); more wait in line for a thread.
STOP_WORKERS = 8


class StoreApi:
    def __init__(
        self,
        state_dir: str | None,
        on_write: Callable[[], None] = lambda: None,
        host: HostIdentity | None = None,
    ) -> None:
        self.store = DirectStore(Path(state_dir)) if state_dir else None
        self.on_write = on_write
        # This machine: a run job is stopped only when its record says it runs here.
        self.host = host if host is not None else host_identity()
        self._stops = ThreadPoolExecutor(STOP_WORKERS, thread_name_prefix="gpuctl-stop")

    def route(self, method: str, path: str) -> tuple[str, str | None]:
        """(operation, service) for a request under /records; HttpError 404/405/400."""
        parts = [p for p in path.split("/") if p][1:]  # drop "records"
        if not parts:
            if method in ("GET", "HEAD"):
                return "list", None
            raise HttpError(
                405,
                f"{method} is not allowed on /records",
                "use GET",
                [(b"allow", b"GET, HEAD")],
            )
        if parts in (["_inflight"], ["_voided"]):
            if method in ("GET", "HEAD"):
                return f"{parts[0][1:]}_list", None
            raise HttpError(
                405,
                f"{method} is not allowed on /records/{parts[0]}",
                "use GET",
                [(b"allow", b"GET, HEAD")],
            )
        service, rest = parts[0], tuple(parts[1:])
        queue = service == "_queue"
        methods = (_QUEUE_ROUTES if queue else _ROUTES).get(rest)
        if methods is None:
            raise HttpError(404, f"no such endpoint: {path[:200]}", "see /openapi.json")
        wire.check_service_name(service)
        op = methods.get("GET" if method == "HEAD" and "GET" in methods else method)
        if op is None:
            allow = allowed(methods)
            where = "/records/_queue" if queue else "/records/{service}"
            raise HttpError(
                405,
                f"{method} is not allowed on {where}{''.join('/' + r for r in rest)}",
                f"use {allow}",
                [(b"allow", allow.encode())],
            )
        return op, None if queue else service

    @staticmethod
    def is_write(op: str) -> bool:
        return op not in _READS

    async def handle(
        self,
        op: str,
        service: str | None,
        body: bytes,
        *,
        masked: bool = False,
        seen: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """Run one routed request; returns (status, JSON body). Bad input raises HttpError.
        ``masked``: the caller holds the read-only token (``core.record_mask``);
        ``seen``: what the agent saw of the caller (peer, token role), added to the
        ``who`` of the event riding on the write."""
        if self.store is None:
            return 503, {
                "error": "this agent has no state directory",
                "hint": "start it with --state-dir",
                "code": "no_store",
            }
        args = self._validate(op, body)
        if isinstance(args.get("event"), Event):
            args["event"] = args["event"].seen_by(**(seen or {}))
        try:
            if op == "stop_job":
                # A stop waits out its grace period (up to MAX_GRACE_S) in its thread: in
                # the shared pool (cpu + 4 threads) six of them held every read for 28 s.
                # Its own pool: stops past STOP_WORKERS wait their turn, reads never do.
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    self._stops, self._dispatch, op, service, args, masked
                )
            return await asyncio.to_thread(self._dispatch, op, service, args, masked)
        except RecordError as e:
            return 400, {"error": f"bad request: {e}", "hint": ""}
        except UsageError as e:
            return 400, {"error": e.message, "hint": e.hint}
        except StoreError as e:
            status = 409 if "no longer ours" in e.message else 503
            return status, {"error": e.message, "hint": e.hint}
        except GpuctlError as e:
            return 503, {"error": e.message, "hint": e.hint}
        except (OverflowError, ValueError, KeyError, TypeError) as e:
            # A record on disk that breaks the rules (a pid out of range): report it, and
            # keep serving the others.
            log.warning("the record of %r cannot be used: %s: %s", service, type(e).__name__, e)
            return 503, {
                "error": f"the record of {service!r} cannot be used: {type(e).__name__}: {e}",
                "hint": "the store sets broken records aside; see `gpuctl locks` on the host",
            }
        finally:
            # Also after a failure: a write may have landed before it failed. The queue is
            # not part of a reading: a waiter's heartbeat must not empty the cache.
            if self.is_write(op) and not op.startswith("queue_"):
                self.on_write()

    def _validate(self, op: str, body: bytes) -> dict[str, Any]:
        data = wire.parse_body(body)
        if op in _READS:
            return {}
        checks = {
            "inflight_begin": wire.inflight_request,
            "inflight_renew": wire.inflight_request,
            "inflight_end": wire.end_request,
            "acquire": wire.lease_request,
            "renew": wire.renew_request,
            "release": wire.release_request,
            "update": wire.holder_update,
            "touch": wire.touch_request,
            "queue_join": wire.queue_join_request,
            "queue_leave": wire.queue_leave_request,
            "stop_job": wire.job_stop_request,
        }
        args = checks[op](data)
        update: RecordUpdate | None = args.get("update")
        if update:
            # The store's own patch language has the last word (a key this agent passes on
            # but the store does not know yet): try it on an empty record first.
            try:
                check_record(apply_update(Record(service="_"), update, 0.0))
            except RecordError as err:
                raise wire.BadRequest(f"update{err.where.removeprefix('$')}", err.why) from None
        return args

    def _dispatch(
        self, op: str, svc: str | None, args: dict[str, Any], masked: bool = False
    ) -> tuple[int, Any]:
        store = self.store
        assert store is not None

        def shown(r: Record) -> dict[str, Any]:
            return (masked_record(r) if masked else r).to_dict()

        if op == "list":
            records, bad = read_all(store)
            out: dict[str, Any] = {
                "records": [shown(r) for r in records],
                "set_aside": [a.to_dict() for a in store.set_aside()],
            }
            if bad:
                out["unreadable"] = bad
            return 200, out
        if op == "inflight_list":
            return 200, {"inflight": store.inflight(), "lingering": store.lingering()}
        if op == "voided_list":
            # Hosts and pids only, no secrets: the read token sees them as written.
            return 200, {"voided": [v.to_dict() for v in store.voided()]}
        if op == "queue_list":
            return 200, {"queue": [w.to_dict() for w in store.waiters()]}
        if op == "queue_join":
            entry, queue = store.queue_join(
                decode_holder(args["holder"]),
                args["ttl_s"],
                name=args["name"],
                priority=args["priority"],
                memory_mib=args["memory_mib"],
            )
            return 200, {"waiter": entry.to_dict(), "queue": [w.to_dict() for w in queue]}
        if op == "queue_leave":
            return 200, {"left": store.queue_leave(args["holder"])}
        assert svc is not None
        if op == "get":
            return 200, shown(store.get(svc))
        event = args.get("event")
        if op == "update":
            return 200, store.update(svc, args["holder"], args["update"], event).to_dict()
        if op == "acquire":
            granted, rec = store.acquire(
                svc, decode_holder(args["holder"]), args["ttl_s"], _promise_arg(args), event
            )
            return 200, {"granted": granted, "record": rec.to_dict()}
        if op == "inflight_begin":
            granted, rec = store.inflight_begin(svc, decode_holder(args["holder"]), args["ttl_s"])
            return 200, {"granted": granted, "record": rec.to_dict()}
        if op == "inflight_renew":
            rec = store.inflight_renew(svc, decode_holder(args["holder"]), args["ttl_s"])
            return 200, rec.to_dict()
        if op == "inflight_end":
            return 200, store.inflight_end(svc, args["holder"], args["linger_s"]).to_dict()
        if op == "renew":
            return 200, store.renew(svc, args["holder"], args["ttl_s"]).to_dict()
        if op == "release":
            update = args["update"] or None
            return 200, store.release(svc, args["holder"], update, event).to_dict()
        if op == "stop_job":
            return 200, job_stop.stop_job(store, svc, args, self.host)
        assert op == "touch"
        return 200, store.touch(
            svc, ready=args.get("ready", False), promise=_promise_arg(args)
        ).to_dict()


def _promise_arg(args: dict[str, Any]) -> Promise | None:
    raw = args.get("promise")
    return decode_promise(raw) if raw is not None else None
