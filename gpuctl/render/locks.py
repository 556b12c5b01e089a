"""``gpuctl locks``: the records and leases, as a table and as JSON (schema 1)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpuctl.core.heal import is_repair, last_repair
from gpuctl.core.jobs import is_job
from gpuctl.core.pool import pool_of, pool_service
from gpuctl.core.promised_specs import holds_memory
from gpuctl.core.record import MAX_ATTEMPTS_KEPT, Record
from gpuctl.core.record_mask import masked
from gpuctl.core.timestamps import iso_utc
from gpuctl.core.units import format_duration, format_mib

if TYPE_CHECKING:
    from rich.console import RenderableType

    from gpuctl.flows.op_results import LocksReport


def _iso(t: float | None) -> str | None:
    if t is None or t <= 0:
        return None
    return iso_utc(t)


def locks_to_json(report: LocksReport) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for host, row, err in report.rows:
        if row is None:
            rows.append({"host": host, "error": err})
            continue
        rec = masked(row)  # what gpuctl prints of a record (core.record_mask)
        lease = rec.lease
        rows.append(
            {
                "host": host,
                "service": rec.service,
                "phase": rec.phase.value,
                "since": _iso(rec.since),
                "last_used": _iso(rec.last_used),
                "idle_s": rec.idle_for(report.now),
                "lease": None
                if lease is None
                else {**lease.to_dict(), "expires_in_s": round(lease.expires - report.now, 1)},
                "handle": rec.handle,
                "failure": rec.failure.to_dict() if rec.failure else None,
                "attempts": list(rec.attempts),
                "starts": sum(1 for a in rec.attempts if not is_repair(a)),
                "repaired": last_repair(rec),
                "starts_capped": _capped(rec.attempts),
                "recovered": rec.recovered,
                # What its last start promised (budget, devices, priority, kind,
                # resume): what every client counts it at; null from an older release.
                "promise": rec.promise.to_dict() if rec.promise else None,
                "pool": pool_of(report.pools, rec.service),
                "error": None,
            }
        )
    aside = [
        {
            "host": host,
            "service": a.service,
            "file": a.file,
            "at": _iso(a.at),
            "size": a.size,
            "why": a.why,
        }
        for host, a in report.set_aside
    ]
    queue = [
        {
            "host": host,
            "position": sum(1 for h, _ in report.queue[:i] if h == host) + 1,
            "name": w.name,
            "priority": w.priority,
            "memory_mib": w.memory_mib,
            "seq": w.seq,
            "since": _iso(w.since),
            "waiting_s": round(max(0.0, report.now - w.since), 1),
            "holder": {
                **w.holder.to_dict(),
                "expires_in_s": round(w.holder.expires - report.now, 1),
            },
        }
        for i, (host, w) in enumerate(report.queue)
    ]
    voided = [
        {
            "host": host,
            "kind": v.kind,
            "service": v.service,
            "file": v.file,
            "holder": {"host": v.host, "pid": v.pid},
            "at": _iso(v.at),
            "why": v.why,
        }
        for host, v in report.voided
    ]
    return {
        "schema": 1,
        "ok": report.ok,
        "records": rows,
        "set_aside": aside,
        "queue": queue,
        "voided": voided,
        "hidden_jobs": report.hidden_jobs,
    }


def locks_errors(report: LocksReport) -> list[str]:
    """The lines for stderr about each host whose records could not be read."""
    lines: list[str] = []
    for host, rec, err in report.rows:
        if rec is None:
            lines.append(f"gpuctl: error: {host}: {err}")
            hint = report.hints.get(host)
            if hint:
                lines.append(f"  hint: {hint}")
    return lines


# The widest one-line header row (its names, two spaces apart, with the narrowest cells
# under them): under this many columns the long names break onto two lines instead.
ONE_LINE_HEADER_WIDTH = 96


def render_locks(report: LocksReport, width: int | None = None) -> RenderableType:
    """The records as a table; ``width``: the terminal's, so the headers take one line
    where they fit (two lines otherwise, and when it is not known)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from gpuctl.core.safe_text import visible
    from gpuctl.render.safe import plain

    t = Table(header_style="bold", box=None, pad_edge=False)
    # Two-line headers keep every column's name and fit 80 columns; a wide terminal
    # gets them on one line (a header split over two lines reads as two rows).
    sep = " " if width is not None and width >= ONE_LINE_HEADER_WIDTH else "\n"
    for col in (
        "HOST",
        "SERVICE",
        "PHASE",
        "HOLDER",
        "SINCE",
        f"LAST{sep}USED",
        f"IDLE{sep}FOR",
        f"LEASE{sep}EXPIRES",
        "STARTS",
    ):
        # A long name (`run --name` takes up to 84 characters) folds onto more lines of
        # its own cell: Rich narrows the columns that may wrap first, so the others keep
        # their width instead of being squeezed to "…" in an 80-column table.
        folds = col in ("SERVICE", "HOLDER")
        t.add_column(col, no_wrap=not folds, overflow="fold" if folds else "ellipsis")
    now = report.now
    notes: list[Text] = []
    for host, row, _err in report.rows:
        if row is None:
            continue  # said on stderr (locks_errors): an error squeezed into a cell is unreadable
        rec = masked(row)
        lease = rec.lease
        holder = f"{lease.entry} pid {lease.pid}@{lease.host}" if lease else "-"
        fail = ""
        if rec.failure:
            f = rec.failure
            fail = f"{f.error[:60]} ({f.count}x"
            fail += (
                f", retry in {format_duration(f.backoff_until - now)})"
                if f.backoff_until > now
                else ")"
            )
        phase_style = {
            "running": "green",
            "starting": "yellow",
            "failed": "red",
            "stopped": "dim",
        }.get(rec.phase.value, "")
        t.add_row(
            plain(host),
            plain(_label(rec.service)),
            Text(rec.phase.value, style=phase_style),
            plain(holder),
            _clock(rec.since),
            _clock(rec.last_used) if rec.last_used else "never",
            format_duration(rec.idle_for(now)),
            format_duration(lease.expires - now) if lease else "-",
            _starts(rec.attempts),
        )
        # Failures and notes go below the table: they are long, and most rows have none.
        if fail:
            notes.append(plain(f"{host}/{rec.service}: last failure: {fail}", style="red"))
        if rec.recovered:
            notes.append(plain(f"{host}/{rec.service}: note: {rec.recovered}", style="yellow"))
        promised = _promise_note(rec, (host, rec.service) in report.configured)
        if promised:
            notes.append(plain(f"{host}/{rec.service}: {promised}", style="dim"))
        fixed = last_repair(rec)
        if fixed is not None:
            when = fixed.get("ended")
            notes.append(
                plain(
                    f"{host}/{rec.service}: repaired"
                    f" {_clock(when if isinstance(when, int | float) else None)}"
                    f" by {fixed.get('by', '?')}: {fixed.get('repaired', '')}",
                    style="yellow",
                )
            )
    noted = " ".join(n.plain for n in notes)
    for host, a in report.set_aside:
        if visible(a.file) not in noted:  # older copies (the newest is noted on its row)
            what = "journal" if a.service == "_journal" else "record"
            notes.append(
                plain(f"{host}/{a.service}: kept unreadable {what} {a.file}", style="yellow")
            )
    if report.hidden_jobs:
        n = report.hidden_jobs
        notes.append(
            plain(
                f"{n} `gpuctl run` job{'s' if n > 1 else ''} that ended over an hour ago "
                "not shown (--finished lists them)",
                style="dim",
            )
        )
    # Every row left out (finished jobs only): the note alone, no empty header.
    parts: list[RenderableType] = [t, *notes] if t.row_count else [*notes]
    if report.queue:
        parts += [Text(""), _queue_table(report)]
    if report.voided:
        parts += [Text(""), _voided_table(report)]
    return Group(*parts) if len(parts) != 1 else parts[0]


def _queue_table(report: LocksReport) -> RenderableType:
    """The wait queue, in the order it will be served (``gpuctl.core.queue``)."""
    from rich.table import Table

    from gpuctl.render.safe import plain

    t = Table(header_style="bold", box=None, pad_edge=False, title="waiting (run --wait)")
    for col in ("HOST", "#", "NAME", "PRIO", "MEMORY", "WAITING\nSINCE", "HOLDER"):
        t.add_column(col, no_wrap=True)
    pos: dict[str, int] = {}
    for host, w in report.queue:
        pos[host] = pos.get(host, 0) + 1
        h = w.holder
        t.add_row(
            plain(host),
            str(pos[host]),
            plain(w.name),
            str(w.priority),
            format_mib(w.memory_mib),
            f"{_clock(w.since)} ({format_duration(report.now - w.since)})",
            plain(f"{h.entry} pid {h.pid}@{h.host}"),
        )
    return t


def _voided_table(report: LocksReport) -> RenderableType:
    """The leases and entries found forged: they count for nothing, and are kept (who
    planted them is worth a look) until someone removes the file."""
    from rich.table import Table

    from gpuctl.render.safe import plain

    t = Table(header_style="bold", box=None, pad_edge=False, title="voided (count for nothing)")
    for col in ("HOST", "KIND", "SERVICE", "HOLDER", "WHY", "FILE"):
        fold = col in ("WHY", "FILE")
        t.add_column(col, no_wrap=not fold, overflow="fold" if fold else "ellipsis")
    for host, v in report.voided:
        holder = f"pid {v.pid}@{v.host}" if v.pid else "-"
        t.add_row(plain(host), v.kind, plain(v.service), plain(holder), plain(v.why), plain(v.file))
    return t


def _label(name: str) -> str:
    """A record's name as the table shows it: a pool's record is its start lock."""
    service = pool_service(name)
    return name if service is None else f"{service} (pool's start lock)"


def _promise_note(rec: Record, configured: bool) -> str:
    """What every client counts a service at (its record's promise), where it differs
    from this config's word: a service only another config names, or a record that
    holds memory without saying how much (an older release wrote it)."""
    if is_job(rec.service) or not holds_memory(rec):
        return ""
    p = rec.promise
    if p is None:
        how = "its record (an older gpuctl's) does not say what it promised"
        fix = f"`gpuctl touch {rec.service}` from a config that names it writes it"
        return f"{how}; {fix}" if not configured else f"{how}; the next ensure or touch writes it"
    if configured:
        return ""
    budget = format_mib(p.memory_mib) if p.memory_mib is not None else "no budget"
    return f"not in this config; counted at its promise: {budget}, priority {p.priority}"


def _clock(t: float | None) -> str:
    """A time of day on the viewer's clock (the JSON has the full UTC timestamp)."""
    if not t:
        return "-"

    when = datetime.fromtimestamp(t)
    fmt = "%H:%M:%S" if when.date() == datetime.now().date() else "%m-%d %H:%M"
    return when.strftime(fmt)


def _starts(attempts: tuple[dict[str, Any], ...]) -> str:
    """How many starts the record keeps (the JSON has each one's outcome and duration);
    ``10+`` once the kept history is full, since older starts were dropped from it. A
    repair note (``core.heal``) is no start."""
    n = sum(1 for a in attempts if not is_repair(a))
    return f"{n}+" if _capped(attempts) else str(n)


def _capped(attempts: tuple[dict[str, Any], ...]) -> bool:
    """Whether the record's history is full: the record keeps only its last
    ``MAX_ATTEMPTS_KEPT`` starts and no total, so there may have been more."""
    return len(attempts) >= MAX_ATTEMPTS_KEPT
