"""The fake vLLM's sleep mode: ``/sleep``, ``/wake_up`` and ``/collective_rpc``.

As vLLM's ``CuMemAllocator`` does it, the memory is in two tagged pools, ``weights`` and
``kv_cache`` (the sim splits it in half):

- level 0 only pauses scheduling: the memory stays;
- level 1 moves the weights to CPU memory and drops the KV cache: the GPU memory is
  given back, and ``/wake_up`` copies the weights back;
- level 2 drops both: ``/wake_up`` re-allocates them, and until
  ``POST /collective_rpc {"method": "reload_weights"}`` the model answers nonsense.

The default mode, ``abort``, ends the requests in flight; ``wait`` lets them finish.
Each answer is (HTTP status, JSON body) for the handler to send.
"""

from __future__ import annotations

import json
import time
from http import HTTPStatus
from typing import Any

from gpuctl.sim.console import info, log
from gpuctl.sim.engine import Engine
from gpuctl.sim.errors import SimOutOfMemory

_POOLS = ("weights", "kv_cache")


def _error(status: HTTPStatus, message: str, kind: str = "") -> tuple[int, dict[str, Any]]:
    """OpenAI's error object, as vLLM sends it."""
    return status, {
        "object": "error",
        "message": message,
        "type": kind or status.phrase.replace(" ", ""),
        "param": None,
        "code": int(status),
    }


def sleep(e: Engine, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
    """``POST /sleep?level=0|1|2&mode=abort|wait``."""
    try:
        level = int(query.get("level", ["1"])[0])
    except ValueError:
        level = -1
    if level not in (0, 1, 2):
        return _error(HTTPStatus.BAD_REQUEST, "'level' must be 0, 1 or 2")
    mode = query.get("mode", ["abort"])[0]
    if mode not in ("abort", "wait"):
        return _error(HTTPStatus.BAD_REQUEST, "'mode' must be abort or wait (keep: not simulated)")
    t0 = time.monotonic()
    with e.sleep_lock:
        if mode == "wait":
            while True:
                with e.lock:
                    if e.running == 0:
                        break
                time.sleep(0.01)
        else:
            e.epoch += 1  # the requests in flight see it and end with finish_reason "abort"
        before = e.claim.memory_mib
        if level >= 1:
            if level == 1 and "weights" not in e.asleep:
                e.host_mib = e.pool_mib("weights")
            if level == 2:
                e.host_mib, e.weights_lost = 0, True
            e.asleep = set(_POOLS)
            e.claim.set(0)
        e.sleeping, e.sleep_level = True, level
        held = e.claim.memory_mib
    info(
        f"It took {time.monotonic() - t0:.6f} seconds to fall asleep (level {level}). "
        f"Sleep mode freed {(before - held) / 1024:.2f} GiB memory, {held / 1024:.2f} GiB "
        f"memory is still in use; {e.host_mib / 1024:.2f} GiB of weights in CPU memory."
    )
    return HTTPStatus.OK, {"status": "sleeping", "level": level}


def wake_up(e: Engine, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
    """``POST /wake_up[?tags=weights&tags=kv_cache]``: claim the pools back."""
    tags = set(query.get("tags", [])) or set(_POOLS)
    if not tags <= set(_POOLS):
        return _error(HTTPStatus.BAD_REQUEST, "'tags' must be weights or kv_cache")
    t0 = time.monotonic()
    with e.sleep_lock:
        if e.sleeping:
            still = e.asleep - tags
            try:
                e.claim.set(sum(e.pool_mib(t) for t in _POOLS if t not in still))
            except SimOutOfMemory as err:
                message = f"torch.OutOfMemoryError: {err.message}"
                log(message, err=True)
                return _error(HTTPStatus.INTERNAL_SERVER_ERROR, message, "OutOfMemoryError")
            if "weights" in e.asleep and "weights" in tags:
                e.host_mib = 0  # copied back (level 1), or re-allocated empty (level 2)
            e.asleep = still
            if not still:
                e.sleeping, e.sleep_level = False, 0
                info(f"It took {time.monotonic() - t0:.6f} seconds to wake up.")
        status = "sleeping" if e.sleeping else "awake"
    return HTTPStatus.OK, {"status": status, "tags": sorted(tags)}


def collective_rpc(e: Engine, body: bytes) -> tuple[int, dict[str, Any]]:
    """``POST /collective_rpc {"method": "reload_weights"}``, after a level-2 sleep."""
    try:
        req = json.loads(body or b"{}")
    except ValueError:
        req = None
    if not isinstance(req, dict) or req.get("method") != "reload_weights":
        return _error(HTTPStatus.BAD_REQUEST, "only {'method': 'reload_weights'} is simulated")
    with e.sleep_lock:
        if "weights" in e.asleep:
            return _error(HTTPStatus.BAD_REQUEST, "wake up the weights first")
        e.weights_lost = False
    info("Reloaded the weights.")
    return HTTPStatus.OK, {"results": [None]}
