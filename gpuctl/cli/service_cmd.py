"""``gpuctl ensure | stop | touch | locks``: a service's lifecycle and its record."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from gpuctl.cli.common import (
    Command,
    ConfigOpt,
    JsonOpt,
    PoolHostOpt,
    ServiceArg,
    complete_host,
    duration_parser,
    errors_to_exit,
    fail,
    open_config,
    print_json,
    say,
)
from gpuctl.errors import ConfigError, GpuctlError

if TYPE_CHECKING:
    from gpuctl.config import Config
    from gpuctl.flows.results import Progress
    from gpuctl.render.progress_line import ProgressLine


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
    host: PoolHostOpt = None,
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
        from gpuctl.flows.deps import EnsureRequest
        from gpuctl.flows.op_results import EnsureResult, StartInterrupted
        from gpuctl.flows.ports import Tell
        from gpuctl.render.progress_line import ProgressLine
        from gpuctl.render.results import ensure_text, ensure_to_json
        from gpuctl.wiring.build import ensure_runner

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
        line = ProgressLine(service) if not json_out and sys.stderr.isatty() else None
        ticks = _LastTick(line)
        tell = Tell(
            progress=ticks.update,
            notice=None if json_out else (line.say if line else say),
            on_repair=say,
        )
        req = EnsureRequest(timeout_s=timeout_s, wait=not no_wait, preempt=preempt, force=force)
        # A pooled service: its pool picks the host (`--host` keeps it to one of them).
        deps, go = ensure_runner(conf, service, host, tell=tell)
        try:
            result = go(req)
        except KeyboardInterrupt as e:
            if line:
                line.stop()
            # Something loads only where a start of ours was under way, or a wait on one.
            ours = isinstance(e, StartInterrupted)
            started = ours or ticks.waited
            say(ticks.interrupted(service, ours=ours, started=started))
            result = EnsureResult.interrupted(
                service, host or svc.host, ours=ours or ticks.ours, started=started
            )
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


class _LastTick:
    """The wait's newest tick, handed on to the status line (when there is one): what
    Ctrl-C says depends on what was being waited on."""

    def __init__(self, line: ProgressLine | None) -> None:
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

    @property
    def waited(self) -> bool:
        """A wait on a start had begun (not only the look's ETA tick)."""
        from gpuctl.flows.results import CHECKING

        return self.last is not None and self.last.phase != CHECKING

    def interrupted(self, service: str, *, ours: bool, started: bool) -> str:
        """``ours``: a start of ours was under way; ``started``: that, or a wait on one."""
        if not started:
            return f"gpuctl: stopped before starting {service}; nothing was started"
        if not ours and not self.ours:
            # A process tied to the service only by a keyword: maybe no server at all.
            return (
                f"gpuctl: stopped waiting; nothing gpuctl started is loading {service} "
                "(it waited on a process that names it: gpuctl status shows it)"
            )
        return f"gpuctl: stopped waiting; {service} keeps loading (gpuctl status shows it)"


def stop(
    service: ServiceArg,
    host: PoolHostOpt = None,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Stop SERVICE's server (found by its record, else by its match keywords)."""
    with errors_to_exit():
        from gpuctl.flows import service_ops
        from gpuctl.render.results import stop_error_to_json, stop_text, stop_to_json
        from gpuctl.wiring.build import deps_for

        conf = open_config(config)
        if host is None and conf.service(service).pooled:
            _stop_pool(conf, service, json_out)
        deps = deps_for(conf, service, host)
        try:
            result = service_ops.stop(deps)
        except GpuctlError as err:
            if json_out:  # its object on stdout too; the error line and exit code follow
                print_json(stop_error_to_json(deps.service.name, deps.host.name, err))
            raise
        finally:
            deps.close()
        if json_out:
            print_json(stop_to_json(result))
        else:
            for text in stop_text(result):
                say(text)
        raise typer.Exit(result.exit_code)


def _stop_pool(conf: Config, service: str, json_out: bool) -> NoReturn:
    """``gpuctl stop`` of a pooled service without ``--host``: a stop on every host of
    its pool (each under that host's lease), said as one result. A host that cannot be
    asked is that host's error, raised once every other host is stopped."""
    from gpuctl.flows import service_ops
    from gpuctl.flows.op_results import StopResult
    from gpuctl.render.results import stop_text, stop_to_json
    from gpuctl.wiring.build import deps_for

    svc = conf.service(service)
    stopped: list[str] = []
    reasons: list[str] = []
    where: list[str] = []
    failed: GpuctlError | None = None
    for h in svc.hosts:
        deps = deps_for(conf, service, h)
        try:
            one = service_ops.stop(deps)
        except GpuctlError as err:
            failed = failed or err
            reasons.append(f"{h}: {err.message}")
            continue
        finally:
            deps.close()
        if one.stopped:
            where.append(h)
        stopped += [f"{s} on {h}" for s in one.stopped]
        reasons.append(f"{h}: {one.reason}")
    result = StopResult(service, ", ".join(where) or svc.host, stopped, "; ".join(reasons))
    if json_out:
        out = stop_to_json(result)
        if failed is not None:
            out["exit_code"] = int(failed.exit_code)
        print_json(out)
    else:
        for text in stop_text(result):
            say(text)
    if failed is not None:
        raise failed
    raise typer.Exit(result.exit_code)


def touch(service: ServiceArg, host: PoolHostOpt = None, config: ConfigOpt = None) -> None:
    """Mark SERVICE as used now (reclaim measures idle time from the last use).

    A pooled service is marked where its copy runs (--host: on that host); exit 1 when
    it runs on no host of its pool.
    """
    with errors_to_exit():
        from gpuctl.flows import service_ops
        from gpuctl.render.results import touch_text
        from gpuctl.wiring.build import deps_for

        conf = open_config(config)
        if host is None and conf.service(service).pooled:
            # Where its copy runs, never its first host alone: a touch there would keep
            # nothing from being reclaimed.
            members = [deps_for(conf, service, h) for h in conf.service(service).hosts]
            try:
                result = service_ops.touch_pool(members)
            finally:
                for one in members:
                    one.close()
        else:
            deps = deps_for(conf, service, host)
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
        from gpuctl.core.safe_text import visible
        from gpuctl.flows import service_ops
        from gpuctl.render.locks import locks_errors, locks_to_json, render_locks
        from gpuctl.render.safe import console
        from gpuctl.wiring.build import locks_deps

        conf = open_config(config)
        deps = locks_deps(conf, host)
        try:
            report = service_ops.locks(deps, finished=finished)
        finally:
            deps.close()
        for _host, line in report.repaired:  # news, on stderr (with --json too)
            say(visible(line))
        if json_out:
            print_json(locks_to_json(report))
        else:
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
