"""Run the agent: parse the listen address, bind, build the probe, serve with uvicorn.

We bind the socket ourselves and hand it to uvicorn: uvicorn answers a bind failure
with ``sys.exit``, and a user who starts a second agent on the same port should read
"address already in use" with a hint, not a traceback or a bare exit status.
"""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec

from gpuctl.adapters.probes.base import Probe
from gpuctl.core.conn_limits import ConnectionLimits
from gpuctl.core.health_reach import DEFAULT_HEALTH_PORTS, PortRanges, parse_ports
from gpuctl.core.redact import redact_lines
from gpuctl.errors import GpuctlError, UsageError

_OFF_LOOPBACK_HINT = "set GPUCTL_AGENT_TOKEN or pass --token-file"


class ListenAddress(msgspec.Struct, frozen=True):
    """A parsed ``HOST:PORT`` and what it resolves to."""

    text: str
    host: str
    port: int
    family: socket.AddressFamily
    sockaddr: tuple[Any, ...]
    loopback: bool

    def url(self, port: int | None = None) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port if port is None else port}"


def parse_listen(listen: str, port: int = 9400) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[IPV6]:PORT``. Raises UsageError on anything else.

    ``port``: the command's own default port, for the examples in the errors (the
    proxy's is 9401: an example naming the agent's would point its user at the agent).
    """
    text = listen.strip()
    example = f"expected HOST:PORT, like 127.0.0.1:{port} or [::1]:{port}"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise UsageError(f"bad --listen {listen!r}: {example}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            # `--listen localhost`: a host without its port.
            hint = f"did you mean {text}:{port}?" if text and not text.isdigit() else ""
            raise UsageError(f"bad --listen {listen!r}: {example}", hint=hint)
        if ":" in host:
            raise UsageError(
                f"bad --listen {listen!r}: write an IPv6 address in brackets, like [::1]:{port}"
            )
    if not host:
        raise UsageError(
            f"bad --listen {listen!r}: {example}", hint="use 0.0.0.0 for every interface"
        )
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"bad --listen {listen!r}: the port should be a number from 0 to 65535")
    return host, int(port_text)


def resolve_listen(listen: str, default_port: int = 9400) -> ListenAddress:
    """Parse and resolve ``listen``; ``loopback`` is judged on the resolved address.
    ``default_port``: the command's own, for the examples in the errors."""
    host, port = parse_listen(listen, default_port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise UsageError(
            f"cannot listen on {listen}: {host!r} does not resolve ({err.strerror})",
            hint="use an IP address of this machine, like 127.0.0.1 or 0.0.0.0",
        ) from None
    family, _, _, _, sockaddr = infos[0]
    ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
    return ListenAddress(
        text=listen,
        host=host,
        port=port,
        family=family,
        sockaddr=tuple(sockaddr),
        loopback=ip.is_loopback,
    )


def bind_socket(addr: ListenAddress, who: str = "gpuctl agent") -> socket.socket:
    """A bound (not yet listening) TCP socket, or a UsageError that says why not.
    ``who``: the command binding it, named in the hint as the likely holder."""
    sock = socket.socket(addr.family, socket.SOCK_STREAM)
    try:
        # Lets a restarted agent rebind while old connections sit in TIME_WAIT. On Linux it
        # does not let two live listeners share a port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr.sockaddr)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(
                f"cannot listen on {addr.text}: address already in use",
                hint=f"another process (another `{who}`?) holds that port; "
                "stop it or pick another port with --listen",
            ) from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise UsageError(
                f"cannot listen on {addr.text}: that is not an address of this machine",
                hint="use 127.0.0.1, 0.0.0.0, or one of this machine's addresses",
            ) from None
        if err.errno == errno.EACCES:
            raise UsageError(
                f"cannot listen on {addr.text}: permission denied",
                hint="ports below 1024 need privileges; use a port like 9400",
            ) from None
        raise UsageError(f"cannot listen on {addr.text}: {err.strerror or err}") from None
    sock.set_inheritable(False)
    return sock


def check_token_policy(addr: ListenAddress, token: str | None) -> None:
    """Refuse to serve the GPU host's state beyond this machine without a token."""
    if not token and not addr.loopback:
        raise UsageError(
            f"refusing to listen on {addr.text} without a token", hint=_OFF_LOOPBACK_HINT
        )


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class RedactingFilter(logging.Filter):
    """Secrets out of the agent's log: a message can quote a command line, a record's
    error or a URL with a password (``gpuctl.core.redact``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        redacted = redact_lines(text)
        if redacted != text:
            record.msg, record.args = redacted, ()
        return True


def log_handler(stream: Any = None) -> logging.Handler:
    """The agent's log handler: one line per message, secrets redacted."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("gpuctl agent: %(levelname)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    return handler


def _setup_logging(log_level: str) -> None:
    logger = logging.getLogger("gpuctl")
    if not logger.handlers:
        logger.addHandler(log_handler())
    logger.setLevel(log_level.upper())


def serve(
    listen: str,
    probe_name: str,
    token: str | None,
    *,
    sim_dir: str | os.PathLike[str] | None = None,
    sim_required: bool = False,
    gpu_memory_mib: int | None = None,
    cache_ttl_s: float = 1.0,
    state_dir: str | os.PathLike[str] | None = None,
    log_level: str = "warning",
    read_token: str | None = None,
    match: tuple[str, ...] = (),
    match_max_age_s: float = 900.0,
    limits: ConnectionLimits | None = None,
    health_ports: PortRanges | None = None,
    journal_days: float = 90.0,
    ui_backend: Any = None,
) -> None:
    """Serve the agent until SIGTERM / Ctrl-C.

    Args:
        listen: ``HOST:PORT`` or ``[IPV6]:PORT``; port 0 picks a free port.
        probe_name: ``auto``, ``nvml``, ``nvidia-smi`` or ``sim``.
        token: the bearer token; None (or empty) is allowed on loopback only.
        sim_dir: the simulated GPU's directory (``sim`` probe).
        sim_required: ``sim_dir`` was named (``--sim-dir``): a missing one is an error at
            start, and one removed later makes ``/status`` 503, never an empty GPU.
        gpu_memory_mib: the GPU's total where the device cannot tell (unified memory).
        cache_ttl_s: how long one probe reading is reused.
        state_dir: the state directory to report in /status.
        log_level: for uvicorn's and gpuctl's loggers.
        read_token: a read-only token (GETs only); needs ``token``.
        match: keywords of servers to report to clients of the original /status.
        match_max_age_s: only such processes younger than this.
        limits: the bounds on connections and their timeouts (``connections.py``).
        journal_days: how many days of events the journal keeps (``adapters.store.journal``).
        health_ports: where on this machine it fetches records' health URLs
            (``--health-ports``); None: ``DEFAULT_HEALTH_PORTS``.
        ui_backend: the web view's config view and flows (``gpuctl.agent.ui.UiBackend``);
            None: the page watches and its actions answer 503.

    Raises:
        UsageError: a bad or busy listen address, or no token off loopback.
        ProbeError: the probe cannot be set up (no GPU, no driver).
    """
    addr = resolve_listen(listen)
    limits = limits if limits is not None else ConnectionLimits()
    if bad := limits.check():
        raise UsageError(f"bad connection limits: {bad[0]}")
    token = token or None
    read_token = read_token or None
    check_token_policy(addr, token)
    if read_token is not None and token is None:
        raise UsageError(
            "a read-only token needs a write token beside it",
            hint="set GPUCTL_AGENT_TOKEN or pass --token-file as well",
        )
    if read_token is not None and read_token == token:
        raise UsageError(
            "the read-only token is the write token",
            hint="give the read-only token a value of its own",
        )
    sock = bind_socket(addr)
    try:
        # Lazy: the NVML probe pulls in pynvml.
        from gpuctl.adapters.probes.factory import make_probe

        probe = make_probe(
            probe_name,
            sim_dir=Path(sim_dir) if sim_dir is not None else None,
            gpu_memory_mib=gpu_memory_mib,
            sim_required=sim_required,
        )
        try:
            _run(
                addr=addr,
                sock=sock,
                probe=probe,
                token=token,
                cache_ttl_s=cache_ttl_s,
                state_dir=state_dir,
                gpu_memory_mib=gpu_memory_mib,
                log_level=log_level,
                read_token=read_token,
                match=match,
                match_max_age_s=match_max_age_s,
                limits=limits,
                health_ports=health_ports
                if health_ports is not None
                else parse_ports(DEFAULT_HEALTH_PORTS),
                journal_days=journal_days,
                ui_backend=ui_backend,
            )
        finally:
            probe.close()
    finally:
        sock.close()


def _run(
    *,
    addr: ListenAddress,
    sock: socket.socket,
    probe: Probe,
    token: str | None,
    cache_ttl_s: float,
    state_dir: str | os.PathLike[str] | None,
    gpu_memory_mib: int | None,
    log_level: str,
    read_token: str | None,
    match: tuple[str, ...],
    match_max_age_s: float,
    limits: ConnectionLimits,
    health_ports: PortRanges,
    journal_days: float,
    ui_backend: Any,
) -> None:
    # Lazy: the server stack stays out of every other command's start-up.
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gpuctl.agent.app import AgentSettings, create_app
    from gpuctl.agent.connections import ConnectionGuard, effective, guarded_protocol
    from gpuctl.agent.http import error_body

    _setup_logging(log_level)
    settings = AgentSettings(
        token=token,
        cache_ttl_s=cache_ttl_s,
        state_dir=os.fspath(state_dir) if state_dir is not None else None,
        gpu_memory_mib=gpu_memory_mib,
        read_token=read_token,
        match=match,
        match_max_age_s=match_max_age_s,
        health_ports=health_ports,
        journal_days=journal_days,
        sim_dir=_sim_dir(probe),
    )
    config = uvicorn.Config(
        create_app(settings, probe, ui_backend),
        # httptools is a dependency; the guard hooks its protocol (connections.py).
        http=guarded_protocol(
            HttpToolsProtocol,
            ConnectionGuard(
                effective(limits, fds_per_connection=1),
                error_body(
                    "the agent has too many connections with a request under way",
                    "try again in a moment",
                ),
            ),
        ),
        loop="uvloop" if _importable("uvloop") else "asyncio",
        ws="none",
        lifespan="on",
        workers=1,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        # The guard closes idle connections itself; uvicorn's own timer agrees with it.
        timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
    )
    auth = "token required" if token else "no token: loopback only"
    banner = (
        f"gpuctl agent: listening on {addr.url(sock.getsockname()[1])} (probe {probe.name}, {auth})"
    )

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, file=sys.stderr, flush=True)

    server = _Server(config)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # uvicorn catches SIGTERM, shuts down gracefully, then raises SIGTERM again. With
        # the default handler that kills us before the probe is closed; with this one
        # serve() returns and the process exits 0, as a service manager expects. (Before
        # uvicorn installs its own handler, it asks the server to stop.)
        server.should_exit = True

    in_main = threading.current_thread() is threading.main_thread()
    previous: Any = None
    if in_main:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        server.run(sockets=[sock])
    except SystemExit as err:  # uvicorn's answer to a failed startup
        raise GpuctlError(
            f"the agent failed to start on {addr.text} (exit status {err.code})",
            hint="see the messages above; run with --log-level debug for more",
        ) from None
    finally:
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sim_dir(probe: Probe) -> str | None:
    """The simulated GPU's folder, for the ``sim`` probe (None for a real GPU)."""
    from gpuctl.adapters.probes.sim import SimProbe

    return str(probe.gpu.sim_dir) if isinstance(probe, SimProbe) else None
