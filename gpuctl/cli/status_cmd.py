"""``gpuctl status``: the decision per service and the GPU process table, per host."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpuctl.cli.common import (
    ConfigOpt,
    HostsOpt,
    JsonOpt,
    complete_service,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    print_json,
    say,
)
from gpuctl.config.values import ProbeName
from gpuctl.errors import ProbeError, UsageError

if TYPE_CHECKING:
    from gpuctl.config import Config
    from gpuctl.flows.deps import StatusDeps
    from gpuctl.flows.results import StatusReport


def _named_on_the_command_line(sim_dir: Path) -> bool:
    """``--sim-dir`` itself, not ``$GPUCTL_SIM_DIR`` (the option's fallback)."""
    return os.environ.get("GPUCTL_SIM_DIR") != str(sim_dir)


def register(app: typer.Typer) -> None:
    app.command("status", short_help="Who holds the GPU, and each service's decision.")(status)


def status(
    host: HostsOpt = None,
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
            help="Time between redraws, e.g. 2s or 500ms (at least 0.25s).  [default: 2s]",
            metavar="DURATION",
            show_default=False,
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
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            help="Show only this service and its processes (repeatable).",
            autocompletion=complete_service,
            metavar="SERVICE",
        ),
    ] = None,
    user: Annotated[
        list[str] | None,
        typer.Option(
            "--user", "-u", help="Show only this user's processes (repeatable).", metavar="USER"
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """What runs on the GPU host right now, and what each service's decision is.

    Exit 0 when every host answered, 4 when any host is UNKNOWN.
    """
    with errors_to_exit():
        from gpuctl.flows.deps import LocalProbeOptions
        from gpuctl.wiring.build import status_deps

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
        for name in only or ():
            conf.service(name)  # an unknown service is a usage error, with a suggestion
        if sim_dir is not None and not sim_dir.is_dir() and _named_on_the_command_line(sim_dir):
            # The default folder (or $GPUCTL_SIM_DIR) may not exist yet: an idle simulated
            # GPU. A folder named here that is not there is a typo: saying "idle" would be
            # saying free without knowing.
            fail(
                ProbeError(
                    f"--sim-dir {sim_dir}: no such directory",
                    hint=f"check the path; for an empty simulated GPU there: mkdir -p {sim_dir}",
                )
            )
        local = LocalProbeOptions(probe=probe.value, sim_dir=sim_dir)
        # A record healed here (a host without an agent) is said on stderr.
        deps = status_deps(conf, host or None, local=local, notice=say)
        try:
            _status(deps, conf, json_out, watch, interval, wide, only or [], user or [])
        finally:
            deps.close()


def _status(
    deps: StatusDeps,
    conf: Config,
    json_out: bool,
    watch: bool,
    interval: float,
    wide: bool,
    only: list[str],
    users: list[str],
) -> None:
    from gpuctl.flows.status import filtered, status
    from gpuctl.flows.status import watch as watch_status

    if json_out:
        from gpuctl.render.status_json import status_to_json

        report = filtered(status(deps), only=only, users=users)
        print_json(status_to_json(report))
        raise typer.Exit(report.exit_code)

    from gpuctl.render.safe import console as safe_console
    from gpuctl.render.status_view import MemoryHistory, glyphs, render_status

    console = safe_console()
    g = glyphs(console.encoding)
    report = filtered(status(deps), only=only, users=users)
    if not conf.hosts and len(report.hosts) == 1 and not report.hosts[0].ok:
        # No config and no GPU: one line, like nvidia-smi, not an empty panel.
        h = report.hosts[0]
        say(f"gpuctl: {h.error}")
        if h.hint:
            say(f"  hint: {h.hint}")
        raise typer.Exit(report.exit_code)
    if not (watch and console.is_terminal):
        console.print(render_status(report, wide, console.width, g=g))
        raise typer.Exit(report.exit_code)

    from rich.constrain import Constrain
    from rich.live import Live

    history = MemoryHistory(every_s=interval).add(report)
    # Two columns short of the terminal: Ctrl-C's "^C", echoed by the terminal after the
    # panel's last line, would otherwise wrap onto a new line, and the final redraw,
    # moving up from one line too low, left the header on screen twice.
    width = max(20, console.width - 2)
    with Live(
        Constrain(
            render_status(report, wide, width, g=g, history=history, interval_s=interval), width
        ),
        console=console,
        auto_refresh=False,
        screen=False,
    ) as live:

        def show(r: StatusReport) -> None:
            r = filtered(r, only=only, users=users)
            view = Constrain(
                render_status(r, wide, width, g=g, history=history.add(r), interval_s=interval),
                width,
            )
            live.update(view, refresh=True)

        report = watch_status(deps, interval, show, first=report)
    raise typer.Exit(report.exit_code)
