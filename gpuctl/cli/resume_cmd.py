"""``gpuctl resume SERVICE``: bring a preempted service back if it fits, stopping nothing."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuctl.cli.common import (
    Command,
    ConfigOpt,
    HostOpt,
    JsonOpt,
    ServiceArg,
    errors_to_exit,
    open_config,
    print_json,
    say,
)


def register(app: typer.Typer) -> None:
    app.command(
        "resume",
        cls=Command,
        short_help="Start a preempted SERVICE again if it fits (never preempts).",
    )(resume)


def resume(
    service: ServiceArg,
    host: HostOpt = None,
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Start it if it fits, but do not wait for it.")
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Bring SERVICE back after a preemption: start it if it fits beside what runs now, else leave it.

    On a service that was not preempted, resume is `ensure` that never preempts: it
    starts the service if it fits, and says it was not preempted.

    Exit 0 started or ready · 1 failed · 3 BUSY (does not fit yet) · 4 UNKNOWN · 5 not ready in time.
    """
    with errors_to_exit():
        from gpuctl.flows.deps import EnsureRequest
        from gpuctl.flows.ports import Tell
        from gpuctl.flows.resume import resume as run
        from gpuctl.render.results import ensure_text, ensure_to_json
        from gpuctl.wiring.build import deps_for

        conf = open_config(config)
        # A record healed on the way (gpuctl.flows.heal) is said on stderr.
        deps = deps_for(conf, service, host, tell=Tell(on_repair=say))
        try:
            result = run(deps, EnsureRequest(entry="resume", wait=not no_wait))
        finally:
            deps.close()
        if json_out:
            print_json(ensure_to_json(result))
        else:
            for text in ensure_text(result):
                say(text)
        raise typer.Exit(result.exit_code)
