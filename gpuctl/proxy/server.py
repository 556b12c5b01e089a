"""Run the proxy: check the listen address and keys, bind, serve with uvicorn.

The listen address is parsed and bound as the agent does it (``gpuctl.agent.server``):
a busy port is a one-line error with a hint, not uvicorn's bare exit.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from gpuctl.config import Config
from gpuctl.core.units import plural
from gpuctl.errors import GpuctlError, UsageError


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _setup_logging(log_level: str, access_log: bool) -> None:
    logger = logging.getLogger("gpuctl.proxy")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("gpuctl proxy: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(log_level.upper())
    # One access line per request: spare each its caller's frame walk and the thread
    # and process lookups, which no format here shows (the logging HOWTO's
    # "Optimization"). This process is the proxy's own.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # The access log is INFO by design: one line per request unless access_log = false.
    logging.getLogger("gpuctl.proxy.access").setLevel(
        logging.INFO if access_log else logging.WARNING
    )
    gpuctl = logging.getLogger("gpuctl")
    if not gpuctl.handlers:  # in_use's warnings (a store it cannot reach)
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        gpuctl.addHandler(h)


# How uvicorn reports an answer that the app left cut short: the proxy does that only
# once its own lines have said why (the upstream failed mid-answer: a warning, and the
# access line's error=), so this ERROR would only read as a bug.
_CUT = "ASGI callable returned without completing response."


def _said_already(record: logging.LogRecord) -> bool:
    return record.msg != _CUT


def serve(
    conf: Config, *, listen: str | None = None, host: str | None = None, log_level: str = "warning"
) -> None:
    """Serve until SIGTERM / Ctrl-C.

    Raises:
        UsageError: a bad or busy listen address; no keys off loopback; an unknown host.
        ConfigError: the keys cannot be read; two services claim one model.
    """
    from gpuctl.agent.server import bind_socket, resolve_listen
    from gpuctl.proxy.app import ProxyApp, ProxySettings
    from gpuctl.proxy.routes import RouteTable

    p = conf.proxy
    addr = resolve_listen(listen or p.listen, 9401)  # its errors show the proxy's port
    keys = p.api_keys()
    if not keys and not addr.loopback:
        raise UsageError(
            f"refusing to listen on {addr.text} without client keys",
            hint="set api_keys_file or api_keys_env in [proxy], or listen on 127.0.0.1",
        )
    routes = RouteTable(conf, host)
    if not routes.by_name:
        where = f"on host {host!r}" if host else "in the config"
        raise UsageError(
            f"no service {where} has an HTTP server to front",
            hint="give a service health (or url) and models = [...]",
        )
    if routes.https():
        from gpuctl.proxy.upstream import tls_context

        try:
            tls_context()  # a CA bundle that cannot be loaded: said now, not per request
        except OSError as e:
            # The one used: SSL_CERT_FILE wins over SSL_CERT_DIR (httpx's order).
            named = [f"{k}={os.environ[k]}" for k in ("SSL_CERT_FILE", "SSL_CERT_DIR")
                     if os.environ.get(k)][:1]  # fmt: skip
            raise UsageError(
                f"cannot load the CA certificates ({named[0] if named else 'the default ones'}) "
                f"to verify https upstreams with: {e.strerror or e}",
                hint="SSL_CERT_FILE (or SSL_CERT_DIR) must name a PEM bundle (a folder of "
                "them), or be unset for the usual ones",
            ) from None
    settings = ProxySettings(
        api_keys=keys,
        max_body_bytes=p.max_body_mib * 2**20,
        sse_keepalive=p.sse_keepalive,
        sse_interval_s=p.sse_interval_s,
        retry_after_s=p.retry_after_s,
        access_log=p.access_log,
        pass_authorization=not keys,
    )
    sock = bind_socket(addr, who="gpuctl proxy")
    try:
        import uvicorn

        from gpuctl.agent.connections import ConnectionGuard, effective, guarded_protocol
        from gpuctl.proxy.errors import error_body
        from gpuctl.proxy.protocol import ProxyHttpProtocol

        _setup_logging(log_level, p.access_log)
        app = ProxyApp(conf, routes, settings)
        config = uvicorn.Config(
            app,
            # uvicorn's own, but a request it cannot parse gets a JSON error (protocol.py);
            # httptools is a dependency.
            # The agent's bounds on connections (connections.py): 2 descriptors each, the
            # client's and the upstream's.
            http=guarded_protocol(
                ProxyHttpProtocol,
                ConnectionGuard(
                    effective(p.connections, fds_per_connection=2),
                    error_body(
                        "the proxy has too many connections with a request under way; "
                        "try again in a moment",
                        "service_unavailable",
                        "too_many_connections",
                    ),
                ),
            ),
            loop="uvloop" if _importable("uvloop") else "asyncio",
            ws="none",
            lifespan="on",
            workers=1,
            access_log=False,  # ours names the service, the model and the wait
            server_header=False,
            proxy_headers=False,
            # uvicorn's INFO lines (started, startup complete, shutting down…) repeat
            # the proxy's own "listening on" line: they show only with debug.
            log_level="warning" if log_level == "info" else log_level,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=max(1, round(p.connections.idle_timeout_s)),
            backlog=2048,
        )
        # After uvicorn.Config, which sets up uvicorn's loggers.
        logging.getLogger("uvicorn.error").addFilter(_said_already)

        models = plural(len(routes.by_model), "model")
        auth = plural(len(keys), "client key") if keys else "no keys: loopback only"
        banner = (
            f"gpuctl proxy: listening on {addr.url(sock.getsockname()[1])} "
            f"({plural(len(routes.by_name), 'service')}, {models}, {auth})"
        )

        class _Server(uvicorn.Server):
            async def startup(self, sockets: list[Any] | None = None) -> None:
                await super().startup(sockets=sockets)
                # What is loaded by now lives as long as the process: out of the
                # collector's sight, so that a full collection (a pause for every
                # request in flight) scans only what came later. It scanned ~40,000
                # objects, 20 ms at rest here; 64-115 ms seen under load.
                gc.collect()
                gc.freeze()
                if self.started:
                    print(banner, file=sys.stderr, flush=True)

            async def shutdown(self, sockets: list[Any] | None = None) -> None:
                # Held requests are answered first (503 / an error event) so that the
                # grace below is spent on answers under way, not on waiting starts.
                app.drain()
                await super().shutdown(sockets=sockets)

        server = _Server(config)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            server.should_exit = True  # as the agent: exit 0 after a graceful shutdown

        in_main = threading.current_thread() is threading.main_thread()
        previous: Any = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
        try:
            server.run(sockets=[sock])
        except SystemExit as err:
            raise GpuctlError(
                f"the proxy failed to start on {addr.text} (exit status {err.code})",
                hint="see the messages above; run with --log-level debug for more",
            ) from None
        finally:
            if in_main and previous is not None:
                signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()
