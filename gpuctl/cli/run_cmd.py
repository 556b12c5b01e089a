"""``gpuctl run -- CMD…``: an ad-hoc GPU job admitted under the host's memory budget."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpuctl.cli.common import (
    Command,
    ConfigOpt,
    HostOpt,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    say,
    size_parser,
)
from gpuctl.core.jobs import PRIORITY_MAX
from gpuctl.errors import UsageError


class RunCommand(Command):
    """Usage ``gpuctl run [OPTIONS] -- CMD...``: Typer writes ``[CMD]``, which hides both
    the ``--`` that keeps CMD's own options from being read as gpuctl's and that CMD may
    have arguments."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return ["-- CMD..." if p.startswith("[CMD]") else p for p in pieces]


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        cls=RunCommand,
        short_help="Run CMD once its GPU memory fits (exit code: CMD's).",
        context_settings={"allow_interspersed_args": False},
    )(run)


def run(
    cmd: Annotated[
        list[str] | None,
        typer.Argument(help="The command and its arguments, after --.", metavar="CMD"),
    ] = None,
    memory: Annotated[
        int | None,
        typer.Option(
            "--memory",
            "-m",
            parser=size_parser("--memory"),
            help="Its GPU memory budget, e.g. 15GiB (required).",
            metavar="SIZE",
        ),
    ] = None,
    priority: Annotated[
        int,
        typer.Option(
            "--priority",
            "-p",
            help="Higher wins (default 50, as services).",
            metavar="N",
            min=-PRIORITY_MAX,
            max=PRIORITY_MAX,
        ),
    ] = 50,
    name: Annotated[
        str | None,
        typer.Option(
            "--name", "-n", help="The job's name (default: CMD's program name).", metavar="NAME"
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="If it does not fit, queue until it does (by priority, then arrival; "
            "`gpuctl locks` shows the queue).",
        ),
    ] = False,
    preempt: Annotated[
        bool,
        typer.Option(
            "--preempt",
            help="If it fits once lower-priority work (or idle servers) stops, stop it (as ensure --preempt).",
        ),
    ] = False,
    preemptible: Annotated[
        bool,
        typer.Option(
            "--preemptible", help="Higher-priority work may stop it (SIGTERM, grace, SIGKILL)."
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            "-t",
            parser=duration_parser("--timeout"),
            help="With --wait (or --preempt): give up waiting after this long (exit 5).",
            metavar="DURATION",
        ),
    ] = None,
    host: HostOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Run CMD (never through a shell) once MEMORY fits on the host's GPU, counted like a service while it runs.

    Exit: CMD's own · 3 BUSY or PREEMPTABLE without --preempt (before CMD starts) · 4 UNKNOWN · 5 timeout · 126/127 CMD cannot be started.
    """
    with errors_to_exit():
        from gpuctl.flows.run.job import RunRequest
        from gpuctl.flows.run.job import run as run_job
        from gpuctl.wiring.run import run_deps

        if not cmd:
            fail(UsageError("no command given", hint="gpuctl run --memory 15GiB -- CMD ARGS…"))
        if memory is None:
            fail(UsageError("--memory is required", hint="e.g. --memory 15GiB"))
        if timeout is not None and not (wait or preempt):
            # It bounds a wait, and without --wait (the queue) or --preempt (the stopped
            # work's memory coming back) there is none to bound: taken silently, it would
            # let a user believe the job is capped in time, which nothing in gpuctl does.
            fail(
                UsageError(
                    "--timeout only bounds a wait: give --wait (or --preempt) with it",
                    hint="gpuctl run --wait --timeout 10m … queues for up to 10 minutes",
                )
            )
        assert cmd is not None and memory is not None
        conf = open_config(config)
        deps = run_deps(conf, host, lambda line: say(f"gpuctl run: {line}"))
        req = RunRequest(
            argv=cmd,
            memory_mib=memory,
            priority=priority,
            name=name,
            wait=wait,
            preemptible=preemptible,
            timeout_s=timeout,
            preempt=preempt,
        )
        try:
            result = run_job(deps, req)
        finally:
            deps.close()
        if not result.started:
            say(f"gpuctl run: {result.name} not started: {result.reason}")
            if result.hint:
                say(f"  hint: {result.hint}")
        elif result.preempted:
            say(f"gpuctl run: {result.reason}")
        for s in result.resumed:
            say(f"gpuctl run: resumed {s}")
        raise typer.Exit(result.exit_code)
