"""The agent's state-store endpoints: the ``DirectStore`` on this host, over HTTP.

``curl -H 'Authorization: Bearer …' http://dgx:9400/records/vllm``

=======  ==================================  =========================================
GET      /records                            {"records": [record, …]}
GET      /records/{svc}                      record (an expired or void lease reads as none)
POST     /records/{svc}/lease                {"holder": {…}, "ttl_s": N} → {"granted", "record"}
POST     /records/{svc}/lease/renew          {"holder": id, "ttl_s": N} → record (409 if not holder)
POST     /records/{svc}/lease/release        {"holder": id, "update": {…}} → record
PATCH    /records/{svc}                      {"holder": id, "update": {…}} → record (409 if not holder)
POST     /records/{svc}/touch                → record
POST     /records/{svc}/inflight             {"holder": {…}, "ttl_s": N} → {"granted", "record"}
POST     /records/{svc}/inflight/renew       {"holder": {…}, "ttl_s": N} → record
POST     /records/{svc}/inflight/end         {"holder": id} → record
GET      /records/_inflight                  {"inflight": {svc: holders, …}}
=======  ==================================  =========================================

Store calls take a file lock and may wait for it, so they run in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from gpuctl.adapters.store import DirectStore
from gpuctl.adapters.store.codec import RecordError, decode_holder
from gpuctl.errors import GpuctlError, StoreError, UsageError


class StoreApi:
    def __init__(self, state_dir: str | None) -> None:
        self.store = DirectStore(Path(state_dir)) if state_dir else None

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        """Route one request under /records; returns (status, JSON body)."""
        if self.store is None:
            return 503, {
                "error": "this agent has no state directory",
                "hint": "start it with --state-dir",
                "code": "no_store",
            }
        parts = [p for p in path.split("/") if p][1:]  # drop "records"
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            return 400, {"error": "the request body is not JSON"}
        if not isinstance(data, dict):
            return 400, {"error": "the request body must be a JSON object"}
        try:
            return await asyncio.to_thread(self._dispatch, method, parts, data)
        except RecordError as e:
            return 400, {"error": f"bad request: {e}"}
        except UsageError as e:
            return 400, {"error": e.message}
        except StoreError as e:
            status = 409 if "no longer ours" in e.message else 503
            return status, {"error": e.message, "hint": e.hint}
        except GpuctlError as e:
            return 500, {"error": e.message, "hint": e.hint}
        except (KeyError, TypeError, ValueError) as e:
            return 400, {"error": f"bad request: {type(e).__name__}: {e}"}

    def _dispatch(self, method: str, parts: list[str], data: dict[str, Any]) -> tuple[int, Any]:
        store = self.store
        assert store is not None
        if not parts:
            if method == "GET":
                return 200, {
                    "records": [r.to_dict() for r in store.records()],
                    "set_aside": [a.to_dict() for a in store.set_aside()],
                }
            return 405, {"error": f"{method} is not allowed on /records"}
        if parts == ["_inflight"] and method == "GET":
            return 200, {"inflight": store.inflight()}
        svc, rest = parts[0], parts[1:]
        if rest == [] and method == "GET":
            return 200, store.get(svc).to_dict()
        if rest == [] and method == "PATCH":
            return 200, store.update(svc, str(data["holder"]), _update(data)).to_dict()
        if rest == ["lease"] and method == "POST":
            granted, rec = store.acquire(svc, decode_holder(data["holder"]), _ttl(data))
            return 200, {"granted": granted, "record": rec.to_dict()}
        if rest == ["lease", "renew"] and method == "POST":
            return 200, store.renew(svc, str(data["holder"]), _ttl(data)).to_dict()
        if rest == ["lease", "release"] and method == "POST":
            return 200, store.release(svc, str(data["holder"]), _update(data) or None).to_dict()
        if rest == ["inflight"] and method == "POST":
            granted, rec = store.inflight_begin(svc, decode_holder(data["holder"]), _ttl(data))
            return 200, {"granted": granted, "record": rec.to_dict()}
        if rest == ["inflight", "renew"] and method == "POST":
            return 200, store.inflight_renew(
                svc, decode_holder(data["holder"]), _ttl(data)
            ).to_dict()
        if rest == ["inflight", "end"] and method == "POST":
            return 200, store.inflight_end(svc, str(data["holder"])).to_dict()
        if rest == ["touch"] and method == "POST":
            return 200, store.touch(svc, ready=bool(data.get("ready"))).to_dict()
        return 404, {
            "error": f"no such endpoint: /records/{'/'.join(parts)}",
            "hint": "see /openapi.json",
        }


def _update(data: dict[str, Any]) -> dict[str, Any]:
    u = data.get("update") or {}
    if not isinstance(u, dict):
        raise ValueError("update must be an object")
    return u


def _ttl(data: dict[str, Any]) -> float:
    # NaN or infinity would make a lease that never expires (json.loads accepts both).
    ttl = float(data["ttl_s"])
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError("ttl_s must be a positive, finite number of seconds")
    return ttl
