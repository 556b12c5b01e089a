"""``gpuctl reclaim``: stop what has sat idle past its timeout (made for cron)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpuctl.cli.common import (
    ConfigOpt,
    HostsOpt,
    JsonOpt,
    errors_to_exit,
    fail,
    open_config,
    print_json,
)
from gpuctl.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("reclaim", short_help="Stop idle servers (for cron); quiet when idle.")(reclaim)


def reclaim(
    host: HostsOpt = None,
    all_hosts: Annotated[
        bool, typer.Option("--all", "-a", help="Every configured host (the default).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", help="Show the plan; change nothing.")
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Stop managed services idle past their idle_timeout, unless in use.

    A service is stopped (or put to sleep, or unloaded: its `stop` setting) only when
    its last use is older than its idle_timeout, no lease is held on it, it is not
    starting, and no request is in flight; one busy past its timeout is touched.
    Prints nothing when there is nothing to do, one line per action otherwise. One
    run at a time per host: a second one leaves at once (exit 0).

    Exit 0 when everything planned was done; 1 when a stop failed; 4 when a host could
    not be read (nothing is stopped there).
    """
    with errors_to_exit():
        if host and all_hosts:
            fail(UsageError("--host and --all cannot go together", hint="use one of them"))
        from gpuctl.core.safe_text import visible
        from gpuctl.flows.heal import repair_lines
        from gpuctl.flows.reclaim import reclaim as run
        from gpuctl.render.reclaim_view import (
            host_errors,
            nothing_due,
            reclaim_lines,
            reclaim_to_json,
        )
        from gpuctl.wiring.reclaim import reclaim_deps

        conf = open_config(config)
        deps = reclaim_deps(conf, host)
        try:
            report = run(deps, dry_run=dry_run)
        finally:
            deps.close()
        # What was healed goes to stderr, with --json too: a repair is news, not a result.
        for host_name, r in report.repaired:
            for line in repair_lines(host_name, [r]):
                print(visible(line), file=sys.stderr)
        if json_out:
            print_json(reclaim_to_json(report))
        else:
            # Lines quote outside text (a holder's command line): controls shown escaped.
            for line in reclaim_lines(report):
                print(visible(line))
            for line in [*nothing_due(report), *host_errors(report)]:
                print(visible(line), file=sys.stderr)
        sys.stdout.flush()
        raise typer.Exit(int(report.exit_code))
