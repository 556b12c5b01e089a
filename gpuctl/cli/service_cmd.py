"""``gpuctl ensure | stop | touch | locks``: a service's lifecycle and its record."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from gpuctl.cli.common import (
    Command,
    ConfigOpt,
    HostOpt,
    JsonOpt,
    ServiceArg,
    complete_host,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    print_json,
    say,
)
from gpuctl.errors import ConfigError

if TYPE_CHECKING:
    from rich.text import Text

    from gpuctl.flows.results import Progress


def register(app: typer.Typer) -> None:
    app.command(
        "ensure",
        cls=Command,
        short_help="Start SERVICE if that is safe, once, and wait until ready.",
    )(ensure)
    app.command("stop", cls=Command, short_help="Stop SERVICE's server.")(stop)
    app.command("touch", cls=Command, short_help="Mark SERVICE as used now.")(touch)
    app.command("locks", short_help="Every service's record and lease, and the wait queue.")(locks)


def ensure(
    service: ServiceArg,
    host: HostOpt = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            "-t",
            parser=duration_parser("--timeout"),
            help="Give up after this long (default: the service's health_timeout), e.g. 10m.",
            metavar="DURATION",
        ),
    ] = None,
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Start it if that is safe, but do not wait for it.")
    ] = False,
    preempt: Annotated[
        bool,
        typer.Option(
            "--preempt",
            help="If it fits only once lower-priority (or idle) services stop, stop them (as preempt = true).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="With --preempt: stop victims even with requests in flight."),
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Make SERVICE ready: start it only if that is safe, exactly once, and wait through its cold start.

    Exit 0 ready · 1 failed · 3 BUSY (or PREEMPTABLE without --preempt) · 4 UNKNOWN (agent unreachable) · 5 not ready in time.
    Ctrl-C stops waiting; the server keeps loading.
    """
    with errors_to_exit():
        from gpuctl.flows.ensure.rounds import ensure as run
        from gpuctl.render.results import ensure_text, ensure_to_json
        from gpuctl.wiring.build import deps_for

        timeout_s = timeout
        conf = open_config(config)
        svc = conf.service(service)
        if not svc.health and svc.launcher != "ollama":  # an Ollama model: /api/ps
            fail(
                ConfigError(
                    f"services.{service}.health: missing, so gpuctl cannot tell when it is ready",
                    hint=f"set services.{service}.health (e.g. http://HOST:8000/health)",
                )
            )
        line = _StatusLine(service) if not json_out and sys.stderr.isatty() else None
        ticks = _LastTick(line)
        deps = deps_for(conf, service, host, progress=ticks.update)
        deps.preempt, deps.force = preempt, force
        deps.on_repair = say
        if not json_out:
            deps.notice = line.say if line else say
        try:
            result = run(deps, timeout_s=timeout_s, wait=not no_wait)
        except KeyboardInterrupt:
            from gpuctl.flows.results import EnsureResult

            if line:
                line.stop()
            say(ticks.interrupted(service))
            result = EnsureResult.interrupted(service, svc.host, ours=ticks.ours)
            if json_out:
                print_json(ensure_to_json(result))
            raise typer.Exit(result.exit_code) from None
        finally:
            deps.close()
            if line:
                line.stop()
        if json_out:
            print_json(ensure_to_json(result))
        else:
            for text in ensure_text(result):
                say(text)
        raise typer.Exit(result.exit_code)


def status_line(service: str, p: Progress, width: int) -> Text:
    """The ensure status line: phase, elapsed or ETA bar, GPU memory, note, newest log
    line, one line cut with "…" to ``width`` (a wrapped line would cut the log line
    mid-word and leave its start on the row above)."""
    from rich.markup import escape
    from rich.text import Text

    from gpuctl.core.durations import progress
    from gpuctl.core.units import format_duration, format_mib

    fraction, eta = progress(p.elapsed_s, p.expected_s)
    if fraction is None:  # the first start, or a process that is maybe no server: no bar
        parts = [f"[bold]{escape(service)}[/]: {p.phase}", format_duration(p.elapsed_s)]
    else:
        filled = int(fraction * 20)
        bar = "[green]" + "━" * filled + "[/][dim]" + "━" * (20 - filled) + "[/]"
        parts = [f"[bold]{escape(service)}[/]: {p.phase}", bar, eta]
    if p.memory_mib is not None:
        parts.append(f"GPU {format_mib(p.memory_mib)}")
    if p.note:
        parts.append(f"[yellow]{escape(p.note)}[/]")
    if p.log_line:
        parts.append(f"[dim]{escape(' '.join(p.log_line.split()))}[/]")
    text = Text.from_markup(" · ".join(parts))
    text.no_wrap = True
    text.truncate(max(1, width), overflow="ellipsis")
    return text


class _LastTick:
    """The wait's newest tick, handed on to the status line (when there is one): what
    Ctrl-C says depends on what was being waited on."""

    def __init__(self, line: _StatusLine | None) -> None:
        self.line = line
        self.last: Progress | None = None

    def update(self, p: Progress) -> None:
        self.last = p
        if self.line is not None:
            self.line.update(p)

    @property
    def ours(self) -> bool:
        """False when the wait was on a process tied to the service only by a keyword."""
        return self.last is None or self.last.ours

    def interrupted(self, service: str) -> str:
        if not self.ours:
            # A process tied to the service only by a keyword: maybe no server at all.
            return (
                f"gpuctl: stopped waiting; nothing gpuctl started is loading {service} "
                "(it waited on a process that names it: gpuctl status shows it)"
            )
        return f"gpuctl: stopped waiting; {service} keeps loading (gpuctl status shows it)"


class _StatusLine:
    """A Rich status line on stderr while waiting: phase, elapsed, GPU memory, newest log line."""

    def __init__(self, service: str) -> None:
        from gpuctl.render.safe import console

        self.service = service
        # Markup on: the line's styles are ours; the note and log line go in escaped.
        self.console = console(stderr=True, markup=True)
        self.status = self.console.status(f"{service}: checking…")
        self.status.start()

    def update(self, p: Progress) -> None:
        # The spinner and a space take two columns; the rest is cut to the terminal.
        self.status.update(status_line(self.service, p, self.console.width - 2))

    def say(self, message: str) -> None:
        """A message above the line (printed as ``say`` would; the line stays below)."""
        from gpuctl.core.redact import mask_url_passwords
        from gpuctl.core.safe_text import visible

        text = visible(mask_url_passwords(message), keep_newlines=True)
        self.console.print(text, markup=False, highlight=False)

    def stop(self) -> None:
        self.status.stop()


def stop(
    service: ServiceArg, host: HostOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None
) -> None:
    """Stop SERVICE's server (found by its record, else by its match keywords)."""
    with errors_to_exit():
        from gpuctl.flows import service_ops
        from gpuctl.render.results import stop_text, stop_to_json
        from gpuctl.wiring.build import deps_for

        conf = open_config(config)
        deps = deps_for(conf, service, host, entry="stop")
        try:
            result = service_ops.stop(deps)
        finally:
            deps.close()
        if json_out:
            print_json(stop_to_json(result))
        else:
            for text in stop_text(result):
                say(text)
        raise typer.Exit(result.exit_code)


def touch(service: ServiceArg, host: HostOpt = None, config: ConfigOpt = None) -> None:
    """Mark SERVICE as used now (reclaim measures idle time from the last use)."""
    with errors_to_exit():
        from gpuctl.flows import service_ops
        from gpuctl.render.results import touch_text
        from gpuctl.wiring.build import deps_for

        conf = open_config(config)
        deps = deps_for(conf, service, host, entry="touch")
        try:
            result = service_ops.touch(deps)
        finally:
            deps.close()
        for text in touch_text(result):
            say(text)


def locks(
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            "-H",
            help="Host (repeatable). Default: every host.",
            autocompletion=complete_host,
            metavar="HOST",
        ),
    ] = None,
    finished: Annotated[
        bool,
        typer.Option(
            "--finished",
            help="Also list `gpuctl run` jobs that ended more than an hour ago "
            "(counted, not listed, without it).",
        ),
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Records and leases: phase, holder, since, last used, idle for, lease expires, last failure; and the wait queue (run --wait) in the order it is served."""
    with errors_to_exit():
        from gpuctl.flows import service_ops
        from gpuctl.render.locks import locks_to_json
        from gpuctl.wiring.build import locks_deps

        conf = open_config(config)
        deps = locks_deps(conf, host)
        try:
            report = service_ops.locks(deps, finished=finished)
        finally:
            deps.close()
        from gpuctl.core.safe_text import visible

        for _host, line in report.repaired:  # news, on stderr (with --json too)
            say(visible(line))
        if json_out:
            print_json(locks_to_json(report))
        else:
            from gpuctl.render.locks import locks_errors, render_locks
            from gpuctl.render.safe import console

            if (
                any(rec is not None for _, rec, _ in report.rows)
                or report.set_aside
                or report.queue
                or report.hidden_jobs
            ):
                out = console()
                out.print(render_locks(report, width=out.width))
            for line in locks_errors(report):
                say(line)
        raise typer.Exit(report.exit_code)
