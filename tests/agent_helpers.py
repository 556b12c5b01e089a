"""Helpers to run servers on loopback in a thread: the real agent app, and misbehaving ones.

``serve_in_thread`` follows httpx's own tests (``tests/conftest.py::serve_in_thread``):
a real uvicorn server on a free loopback port, so tests speak real HTTP to it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gpuctl.core.snapshot import GpuProcess, ProbeReading


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", timeout_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread; yield its base URL; shut it down after.

    The socket is bound here (port 0), so the URL is known before the server starts and
    no two tests race for a port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ws="none",
        lifespan="on",
        access_log=False,
        log_level="warning",
        http="httptools",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        yield f"http://{shown}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


@contextmanager
def raw_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on loopback that hands each connection to ``handle`` in its own thread.

    For servers that misbehave in ways no HTTP framework would: hang, speak garbage,
    answer HTML. ``handle`` owns the connection and may block until the server stops.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    stop = threading.Event()
    conns: list[socket.socket] = []

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=_guarded, args=(handle, conn), daemon=True).start()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in conns:
            conn.close()


def _guarded(handle: Callable[[socket.socket], None], conn: socket.socket) -> None:
    # OSError: the client went away first, which is fine for a misbehaving server.
    with contextlib.suppress(OSError):
        handle(conn)


def read_request(conn: socket.socket) -> bytes:
    """Read one request's head (up to the blank line)."""
    data = b""
    conn.settimeout(5)
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def canned(status: str, body: bytes, content_type: str) -> Callable[[socket.socket], None]:
    """A handler that answers every request with one fixed HTTP response and closes."""

    def handle(conn: socket.socket) -> None:
        read_request(conn)
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head + body)
        conn.close()

    return handle


class FakeProbe:
    """An in-memory probe: returns ``reading`` (or raises ``error``), counts calls.

    ``delay_s`` makes each read slow, like NVML on a busy host or an ``nvidia-smi``
    subprocess, so tests can see concurrent requests share one scan.
    """

    name = "fake"

    def __init__(
        self,
        reading: ProbeReading | None = None,
        *,
        error: Exception | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.reading = reading if reading is not None else reading_of()
        self.error = error
        self.delay_s = delay_s
        self.calls = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.closed = False
        self._lock = threading.Lock()

    def read(self) -> ProbeReading:
        with self._lock:
            self.calls += 1
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.error is not None:
                raise self.error
            return self.reading
        finally:
            with self._lock:
                self.concurrent -= 1

    def close(self) -> None:
        self.closed = True


def reading_of(
    *processes: GpuProcess,
    used: int | None = None,
    total: int | None = 131072,
    unified: bool = True,
) -> ProbeReading:
    return ProbeReading(
        probe="fake",
        processes=tuple(processes),
        memory_used_mib=used,
        memory_total_mib=total,
        unified_memory=unified,
    )
