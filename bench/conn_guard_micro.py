"""What the connection guard (``gpuctl.agent.connections``) adds to a request, in
process: uvicorn's httptools protocol with the guard and without it, fed the same
keep-alive requests (32 connections, a two-byte ASGI answer) through a transport that
writes nowhere. No sockets, no wrk, no other process: the difference left is the
guard's own work a request, in microseconds of CPU, which on a shared machine
``conn_guard_wrk.py``'s throughput cannot resolve below a few per cent.

Usage::

    python bench/conn_guard_micro.py [--rounds 11] [--requests 2000]

Run it from another checkout (``PYTHONPATH=. python /path/to/conn_guard_micro.py``) to
measure that checkout's guard. Prints the medians over rounds, A/B in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gpuctl.agent.connections import ConnectionGuard, guarded_protocol
from gpuctl.core.conn_limits import ConnectionLimits

REQUEST = b"GET /status HTTP/1.1\r\nhost: x\r\nauthorization: Bearer abc\r\n\r\n"
CONNECTIONS = 32


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"{}"})


class _Transport(asyncio.Transport):
    """Loopback's addresses; writes go nowhere."""

    _extra = {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def per_request_us(cls: type[Any], requests: int) -> float:
    """CPU microseconds a request, ``requests`` on each of 32 connections of ``cls``."""
    config = uvicorn.Config(app, http=cls, lifespan="off", access_log=False)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    protos = [
        cls(config=config, server_state=state, app_state={}, _loop=loop) for _ in range(CONNECTIONS)
    ]
    for p in protos:
        p.connection_made(_Transport())
    t0 = time.process_time()
    for _ in range(requests):
        for p in protos:
            p.data_received(REQUEST)
        await asyncio.sleep(0)  # the requests' tasks answer
        await asyncio.sleep(0)
    spent = time.process_time() - t0
    assert state.total_requests == CONNECTIONS * requests, state.total_requests
    for p in protos:
        p.connection_lost(None)
    return spent / (CONNECTIONS * requests) * 1e6


async def measure(rounds: int, requests: int) -> None:
    guarded = guarded_protocol(HttpToolsProtocol, ConnectionGuard(ConnectionLimits(), b"{}"))
    sides: tuple[tuple[str, type[Any]], ...] = (("guard", guarded), ("no guard", HttpToolsProtocol))
    us: dict[str, list[float]] = {name: [] for name, _ in sides}
    for r in range(rounds):
        for name, cls in sides if r % 2 == 0 else sides[::-1]:
            us[name].append(await per_request_us(cls, requests))
    med = {k: statistics.median(v) for k, v in us.items()}
    print(
        f"{rounds} rounds x {CONNECTIONS} connections x {requests} requests: "
        f"guard {med['guard']:.3f} us a request, no guard {med['no guard']:.3f} us; "
        f"the guard adds {med['guard'] - med['no guard']:.3f} us "
        f"({med['guard'] / med['no guard']:.3f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(measure(args.rounds, args.requests))
    else:
        uvloop.run(measure(args.rounds, args.requests))


if __name__ == "__main__":
    main()
