"""``gpuctl proxy``: an OpenAI-compatible front that starts servers on demand.

The server stack is imported inside the command, so ``gpuctl --help`` does not pay for it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpuctl.cli.common import ConfigOpt, complete_host, errors_to_exit, open_config
from gpuctl.errors import UsageError

LOG_LEVELS = ("debug", "info", "warning", "error")


def register(app: typer.Typer) -> None:
    app.command("proxy", short_help="Serve the OpenAI API; start each model's server on demand.")(
        proxy
    )


def proxy(
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            help="HOST:PORT to listen on. Default: [proxy] listen, else 127.0.0.1:9401. "
            "Off loopback, client keys are required.",
            metavar="ADDR",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            "-H",
            help="Front only the services that may run on this host (a pooled one placed "
            "there). Default: every host's.",
            autocompletion=complete_host,
            metavar="HOST",
        ),
    ] = None,
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            help="How much to log (on stderr); the access log is info.",
            metavar="<" + "|".join(LOG_LEVELS) + ">",
            autocompletion=lambda incomplete: [x for x in LOG_LEVELS if x.startswith(incomplete)],
        ),
    ] = "info",
    config: ConfigOpt = None,
) -> None:
    """Serve the OpenAI API and route each request to its model's service.

    A request for a model whose server is not running runs the same ensure flow as
    `gpuctl ensure` (one start per service, however many requests wait) and is held
    until it answers, up to the service's queue_timeout. Requests count as in use, so
    `gpuctl reclaim` never stops a server that is answering. Refusals are OpenAI error
    objects: 503 with Retry-After when the GPU is busy or unknown, 404 for an unknown
    model, 429 past max_concurrent, 502 when the server fails.
    """
    with errors_to_exit():
        if log_level.lower() not in LOG_LEVELS:
            raise UsageError(
                f"--log-level: expected debug, info, warning or error, got {log_level!r}"
            )
        conf = open_config(config)
        from gpuctl.proxy.server import serve

        serve(conf, listen=listen, host=host, log_level=log_level.lower())
