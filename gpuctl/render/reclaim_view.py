"""``gpuctl reclaim``: one line per action for cron, or one JSON object.

Text: nothing at all when there is nothing to do (cron mails only what matters); one
line on stdout per action, and per service that was past its timeout but kept; a host
that could not be read on stderr (the CLI prints it). ``--dry-run`` says "would", and
"nothing to reclaim on HOST (N services checked)" on stderr where nothing is due.

``gpuctl reclaim --json`` (schema 1)::

    {"schema": 1, "dry_run": false, "exit_code": 0,
     "hosts": [{"name": "dgx", "ok": true, "error": null, "hint": null,
                "skipped": null}],            # or "another reclaim runs there (…)"
     "candidates": [{"host": "dgx", "service": "vllm", "action": "stop",
                     "reason": "idle 41m > 30m", "idle_s": 2460.0, "done": true,
                     "error": null, "hint": null,
                     "pool": null}],            # a pooled service: its hosts
     "rotated_logs": ["vllm.log"],              # logs on this machine rotated by size
     "resumed": [{"host": "dgx", "service": "photos", "outcome": "started",
                  "reason": "…", "started": true, "dry_run": false}]}

``action`` is stop, sleep, unload, touch or keep; every configured service of every
host that was read is a candidate, those with nothing to do as ``keep``.
"""

from __future__ import annotations

from typing import Any

from gpuctl.core.idle import Action
from gpuctl.core.pool import pool_of
from gpuctl.flows.reclaim import Planned, ReclaimReport, report_lines

SCHEMA = 1

_DONE = {
    Action.STOP: "stopped",
    Action.SLEEP: "put to sleep",
    Action.UNLOAD: "unloaded",
    Action.TOUCH: "touched",
    Action.KEEP: "kept",
}
_WOULD = {
    Action.STOP: "would stop",
    Action.SLEEP: "would put to sleep",
    Action.UNLOAD: "would unload",
    Action.TOUCH: "would touch",
    Action.KEEP: "would keep",
}
_FAILED = {
    Action.STOP: "failed to stop",
    Action.SLEEP: "failed to put to sleep",
    Action.UNLOAD: "failed to unload",
    Action.TOUCH: "failed to touch",
    Action.KEEP: "kept",
}


def reclaim_lines(report: ReclaimReport) -> list[str]:
    """The lines for stdout: one per action (empty when there is nothing to do). A
    preempted service that still does not fit is no action (cron stays quiet)."""
    lines = [_line(p, report.dry_run) for p in report_lines(report)]
    for host, r in report.resumed:
        if r.would:
            lines.append(f"would resume {r.service} on {host} if it fits")
        elif r.error is not None:
            lines.append(f"failed to resume {r.service} on {host}: {r.error}")
        elif r.result is not None and (r.started or r.failed):
            verb = "resumed" if r.started else "failed to resume"
            lines.append(f"{verb} {r.service} on {host}: {r.result.reason}")
    return lines


def _line(p: Planned, dry_run: bool) -> str:
    c = p.candidate
    if p.error:
        verb = _FAILED[c.action]
        hint = f" (hint: {p.hint})" if p.hint else ""
        return f"{verb} {c.service} on {p.host}: {p.error}{hint}"
    verb = (_WOULD if dry_run else _DONE)[c.action]
    return f"{verb} {c.service} on {p.host}: {c.reason}"


def nothing_due(report: ReclaimReport) -> list[str]:
    """``--dry-run`` only (cron's run stays silent): for stderr, one line per host read
    where nothing would be done, so a person trying it sees it looked."""
    if not report.dry_run:
        return []
    acted = {p.host for p in report_lines(report)} | {h for h, _ in report.resumed}
    out = []
    for h in report.hosts:
        if h.error or h.busy or h.name in acted:
            continue
        n = sum(1 for p in report.planned if p.host == h.name)
        checked = f"{n} service checked" if n == 1 else f"{n} services checked"
        out.append(f"nothing to reclaim on {h.name} ({checked})")
    return out


def host_errors(report: ReclaimReport) -> list[str]:
    """For stderr: per host that could not be read, its line and its ``hint:`` line.

    Separate lines, never one with a newline inside: the CLI escapes every control in a
    line (it quotes outside text), which would print the newline as ``\\x0a``.
    """
    out = []
    for h in report.hosts:
        if h.error:
            out.append(f"gpuctl: host {h.name} not reclaimed: {h.error}")
            if h.hint:
                out.append(f"  hint: {h.hint}")
    return out


def reclaim_to_json(report: ReclaimReport) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "dry_run": report.dry_run,
        "exit_code": int(report.exit_code),
        "hosts": [
            {
                "name": h.name,
                "ok": h.error is None,
                "error": h.error,
                "hint": h.hint or None,  # null for no hint, as in status --json
                "skipped": h.busy,
            }
            for h in report.hosts
        ],
        "candidates": [
            {
                "host": p.host,
                "service": p.candidate.service,
                "action": p.candidate.action.value,
                "reason": p.candidate.reason,
                "idle_s": round(p.candidate.idle_s, 1) if p.candidate.idle_s is not None else None,
                "done": p.done,
                "error": p.error,
                "hint": p.hint or None,
                "pool": pool_of(report.pools, p.candidate.service),
            }
            for p in report.planned
        ],
        "rotated_logs": report.rotated_logs,
        "resumed": [
            {
                "host": host,
                "service": r.service,
                "outcome": r.result.outcome.value if r.result else None,
                "reason": r.result.reason if r.result else (r.error or ""),
                "started": r.started,
                "dry_run": r.would,
            }
            for host, r in report.resumed
        ],
    }
