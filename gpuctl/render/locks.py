"""``gpuctl locks``: the records and leases, as a table and as JSON (schema 1)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gpuctl.core.units import format_duration

if TYPE_CHECKING:
    from rich.table import Table

    from gpuctl.flows.service_ops import LocksReport


def _iso(t: float | None) -> str | None:
    if t is None or t <= 0:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def locks_to_json(report: LocksReport) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for host, rec, err in report.rows:
        if rec is None:
            rows.append({"host": host, "error": err})
            continue
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
                "recovered": rec.recovered,
                "error": None,
            }
        )
    return {"schema": 1, "ok": report.ok, "records": rows}


def render_locks(report: LocksReport) -> Table:
    from rich.table import Table
    from rich.text import Text

    t = Table(header_style="bold", box=None, pad_edge=False)
    for col in (
        "HOST",
        "SERVICE",
        "PHASE",
        "HOLDER",
        "SINCE",
        "LAST USED",
        "IDLE FOR",
        "LEASE EXPIRES",
        "LAST FAILURE",
    ):
        t.add_column(col)
    now = report.now
    for host, rec, err in report.rows:
        if rec is None:
            t.add_row(
                host, "", Text("UNKNOWN", style="bold magenta"), Text(err or "", style="magenta")
            )
            continue
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
            host,
            rec.service,
            Text(rec.phase.value, style=phase_style),
            holder,
            format_duration(now - rec.since) + " ago" if rec.since else "-",
            format_duration(now - rec.last_used) + " ago" if rec.last_used else "never",
            format_duration(rec.idle_for(now)),
            format_duration(lease.expires - now) if lease else "-",
            Text(fail, style="red") if fail else "",
        )
        if rec.recovered:
            t.add_row("", "", Text(f"note: {rec.recovered}", style="yellow"))
    return t
