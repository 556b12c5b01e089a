"""``gpuctl status``: the decision per service and the GPU process table, per host."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gpuctl.cli.common import (
    ConfigOpt,
    JsonOpt,
    complete_host,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    print_json,
)
from gpuctl.config.model import ProbeName
from gpuctl.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def status(
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            "-H",
            help="Host name from the config (repeatable). Default: every host.",
            autocompletion=complete_host,
            metavar="HOST",
        ),
    ] = None,
    all_hosts: Annotated[
        bool, typer.Option("--all", "-a", help="Every configured host, at once.")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Redraw in place (on a terminal).")
    ] = False,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            "-i",
            parser=duration_parser("--interval", minimum=0.25),
            help="Time between redraws, e.g. 2s or 500ms (at least 0.25s).",
            metavar="DURATION",
            show_default="2s",
        ),
    ] = 2.0,
    json_out: JsonOpt = False,
    wide: Annotated[bool, typer.Option("--wide", help="Full commands, containers.")] = False,
    probe: Annotated[
        ProbeName,
        typer.Option("--probe", help="Local probe where there is no agent."),
    ] = ProbeName.auto,
    sim_dir: Annotated[
        Path | None,
        typer.Option(
            "--sim-dir",
            help="Simulated GPU directory (with --probe sim).",
            metavar="DIR",
            envvar="GPUCTL_SIM_DIR",
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """What runs on the GPU host right now, and what each service's decision is.

    Exit 0 when every host answered, 4 when any host is UNKNOWN.
    """
    with errors_to_exit():
        from gpuctl.flows.status import LocalProbeOptions, gather

        if host and all_hosts:
            fail(UsageError("--host and --all exclude each other"))
        if watch and json_out:
            fail(
                UsageError(
                    "--watch and --json exclude each other",
                    hint="poll `gpuctl status --json` instead",
                )
            )
        conf = open_config(config)
        local = LocalProbeOptions(probe=probe.value, sim_dir=sim_dir)
        hosts = host or None

        if json_out:
            from gpuctl.render.status_json import status_to_json

            report = gather(conf, hosts, local=local)
            print_json(status_to_json(report))
            raise typer.Exit(report.exit_code)

        from rich.console import Console

        from gpuctl.render.status_view import render_status

        console = Console()
        report = gather(conf, hosts, local=local)
        if not conf.hosts and len(report.hosts) == 1 and not report.hosts[0].ok:
            # No config and no GPU: one line, like nvidia-smi, not an empty panel.
            h = report.hosts[0]
            print(f"gpuctl: {h.error}", file=sys.stderr)
            if h.hint:
                print(f"  hint: {h.hint}", file=sys.stderr)
            raise typer.Exit(report.exit_code)
        if watch and console.is_terminal:
            import time

            from rich.live import Live

            with Live(
                render_status(report, wide, console.width),
                console=console,
                auto_refresh=False,
                screen=False,
            ) as live:
                try:
                    while True:
                        time.sleep(interval)
                        report = gather(conf, hosts, local=local)
                        live.update(render_status(report, wide, console.width), refresh=True)
                except KeyboardInterrupt:
                    pass
        else:
            console.print(render_status(report, wide, console.width))
        raise typer.Exit(report.exit_code)
