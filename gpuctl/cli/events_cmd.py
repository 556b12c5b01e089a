"""``gpuctl events`` and ``gpuctl usage``: the host's journal (docs/reference/events.md)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

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
from gpuctl.errors import ExitCode, GpuctlError, UsageError

if TYPE_CHECKING:
    from gpuctl.render.events_view import HostError

FOLLOW_POLL_S = 1.0


def register(app: typer.Typer) -> None:
    app.command("events", short_help="What happened on the host, and why (the journal).")(events)
    app.command("usage", short_help="What each service held and cost (from the journal).")(usage)


def _since(text: str, option: str = "--since") -> float:
    from gpuctl.core.events import parse_since

    try:
        return parse_since(text, time.time())
    except ValueError:
        fail(UsageError(f"{option}: {text!r} is not a span (2h, 7d, 1h30m) nor a Unix time"))


AllOpt = Annotated[bool, typer.Option("--all", "-a", help="Every configured host (the default).")]


def events(
    host: HostsOpt = None,
    all_hosts: AllOpt = False,
    since: Annotated[
        str,
        typer.Option("--since", help="How far back: 30m, 2h, 7d, or a Unix time.", metavar="SPAN"),
    ] = "2h",
    service: Annotated[
        str | None,
        typer.Option("--service", "-s", help="Only this service (or run job).", metavar="SERVICE"),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing events as they are written.")
    ] = False,
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """What gpuctl did on the host, and why: one line per event, newest last.

    Each start, stop (with its cause: manual, idle, preempted, yield, sleep), refusal,
    wake, resume, repair and queue move, with who did it (user and entry point). The
    journal is what gpuctl wrote, not proof: anyone with the write token or in the
    state folder's group can add to it.

    Exit 0; 4 when a host's journal could not be read.
    """
    with errors_to_exit():
        if host and all_hosts:
            fail(UsageError("--host and --all cannot go together", hint="use one of them"))
        from gpuctl.adapters.store import store_for
        from gpuctl.core.pool import pool_of
        from gpuctl.flows.story import host_events
        from gpuctl.render.events_view import EventsOut, HostError, event_line, event_row

        start = _since(since)
        conf = open_config(config)
        names = list(host) if host else list(conf.hosts)
        for name in names:
            conf.host(name)  # an unknown name: the config's own error
        many = len(names) > 1
        dated = time.time() - start > 86400 + 60  # a day back and more: dates too
        stores = {name: store_for(conf.host(name)) for name in names}
        rows, errors, last = [], [], dict.fromkeys(names, 0)
        hints: dict[str, str] = {}
        try:
            for name, store in stores.items():
                try:
                    got = host_events(store, start, service=service)
                except GpuctlError as err:
                    errors.append(HostError(name, err.message))
                    hints[name] = err.hint
                    continue
                for rid, ev in got:
                    rows.append((ev.at, name, rid, ev))
                    last[name] = max(last[name], rid)
            rows.sort(key=lambda r: (r[0], r[1], r[2]))
            if json_out:
                pools = conf.pools()
                listed = [event_row(n, i, ev, pool_of(pools, ev.service)) for _, n, i, ev in rows]
                out = EventsOut(1, start, listed, errors)
                _print_json(out)
            else:
                for _, name, _, ev in rows:
                    print(event_line(name if many else None, ev, dated=dated))
                _say_errors(errors, hints)
            sys.stdout.flush()
            if follow:
                pools = conf.pools()
                _follow(stores, last, start, service, pools, many=many, json_out=json_out)
        finally:
            for store in stores.values():
                store.close()
        raise typer.Exit(int(ExitCode.UNKNOWN) if errors else 0)


def _follow(
    stores: Mapping[str, Any],
    last: dict[str, int],
    start: float,
    service: str | None,
    pools: Mapping[str, tuple[str, ...]],
    *,
    many: bool,
    json_out: bool,
) -> None:
    """Poll every host for events past the last one shown, until Ctrl-C."""
    import json

    from gpuctl.core.pool import pool_of
    from gpuctl.flows.story import host_events
    from gpuctl.render.events_view import event_line, event_row, to_json

    try:
        while True:
            time.sleep(FOLLOW_POLL_S)
            for name, store in stores.items():
                try:
                    got = host_events(store, start, service=service, after_id=last[name])
                except GpuctlError:
                    continue
                for rid, e in got:
                    last[name] = max(last[name], rid)
                    if json_out:  # one object per line (JSON Lines) while following
                        print(
                            json.dumps(to_json(event_row(name, rid, e, pool_of(pools, e.service))))
                        )
                    else:
                        print(event_line(name if many else None, e, dated=False))
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _print_json(out: Any) -> None:
    from gpuctl.core.redact import mask_url_passwords
    from gpuctl.render.events_view import json_text, to_json

    text = json_text(out)
    if text is None:
        print_json(to_json(out))
    else:  # as print_json: no configured URL's password in the output
        sys.stdout.write(mask_url_passwords(text) + "\n")


def usage(
    host: HostsOpt = None,
    all_hosts: AllOpt = False,
    since: Annotated[
        str,
        typer.Option("--since", help="How far back: 7d, 30d, 12h, or a Unix time.", metavar="SPAN"),
    ] = "7d",
    by: Annotated[
        str, typer.Option("--by", help="One row per service, user or day.", metavar="KEY")
    ] = "service",
    json_out: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """What each service held and cost, from the journal.

    GPU memory held in GiB-hours (budget × time not stopped, and memory seen × time
    where the probe measured it; unknown, never 0, without a budget), cold starts
    (how many, median, total), time idle before a reclaim or yield stopped it,
    preemptions suffered and caused, jobs run and requests held by proxy cold starts.
    Closed days count whole (UTC), from the journal's daily rows.

    Exit 0; 4 when a host's journal could not be read.
    """
    with errors_to_exit():
        if host and all_hosts:
            fail(UsageError("--host and --all cannot go together", hint="use one of them"))
        if by not in ("service", "user", "day"):
            fail(UsageError(f"--by: {by!r} is not one of service, user, day"))
        from gpuctl.adapters.store import store_for
        from gpuctl.core.pool import pool_of
        from gpuctl.core.usage import Tally, group
        from gpuctl.flows.story import host_usage
        from gpuctl.render.events_view import HostError, UsageOut, usage_lines, usage_row

        start = _since(since)
        conf = open_config(config)
        names = list(host) if host else list(conf.hosts)
        all_rows: dict[tuple[str, str, str], Tally] = {}
        errors = []
        hints: dict[str, str] = {}
        for name in names:
            store = store_for(conf.host(name))
            try:
                for key, t in host_usage(store, start).items():
                    all_rows.setdefault(key, Tally()).add(t)
            except GpuctlError as e:
                errors.append(HostError(name, e.message))
                hints[name] = e.hint
            finally:
                store.close()
        pools = conf.pools() if by == "service" else {}
        rows = [usage_row(k, t, pool_of(pools, k)) for k, t in group(all_rows, by).items()]
        if json_out:
            _print_json(UsageOut(1, start, by, rows, errors))
        else:
            if rows:
                for line in usage_lines(rows, by):
                    print(line)
            else:
                print("nothing in the journal for that time", file=sys.stderr)
            _say_errors(errors, hints)
        sys.stdout.flush()
        raise typer.Exit(int(ExitCode.UNKNOWN) if errors else 0)


def _say_errors(errors: list[HostError], hints: dict[str, str]) -> None:
    """Each host that could not be read, as ``locks`` says it: the error naming the
    host, then its fix. An agent's words: shown, never acted on by the terminal."""
    from gpuctl.core.safe_text import visible

    for bad in errors:
        print(visible(f"gpuctl: error: {bad.host}: {bad.error}"), file=sys.stderr)
        if hints.get(bad.host):
            print(visible(f"  hint: {hints[bad.host]}"), file=sys.stderr)
