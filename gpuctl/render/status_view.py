"""The human view of ``gpuctl status``: built by pure functions from a report.

``render_status`` returns one Rich renderable, so ``--watch`` can hand the same
function to ``Live`` and a plain run prints it once.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpuctl.core.decision import Decision, owner_of
from gpuctl.core.units import format_mib
from gpuctl.flows.results import HostReport, StatusReport

DECISION_STYLE = {
    Decision.READY: "bold green",
    Decision.LOADING: "bold yellow",
    Decision.IDLE: "bold cyan",
    Decision.FITS: "bold blue",
    Decision.BUSY: "bold red",
    Decision.UNKNOWN: "bold magenta",
    Decision.FAILED: "bold red",
    Decision.SLEEPING: "bold cyan",
    Decision.PREEMPTABLE: "bold yellow",
}

_BAR_WIDTH = 30


def memory_bar(used: int | None, total: int | None, unified: bool) -> Text:
    """``GPU memory ██████░░░ 86.0 GiB / 128.0 GiB  67% (unified)``."""
    t = Text("GPU memory ", style="bold")
    if used is None or not total:
        t.append(f"{format_mib(used)} / {format_mib(total)}", style="dim")
    else:
        frac = max(0.0, min(1.0, used / total))
        filled = round(frac * _BAR_WIDTH)
        style = "green" if frac < 0.6 else "yellow" if frac < 0.85 else "red"
        t.append("█" * filled, style=style)
        t.append("░" * (_BAR_WIDTH - filled), style="dim")
        t.append(f" {format_mib(used)} / {format_mib(total)}  {frac:4.0%}")
    if unified:
        t.append("  (unified memory)", style="italic dim")
    return t


def _cmd(cmd: str | None, wide: bool, room: int) -> Text:
    if cmd is None:
        return Text("<not visible: other PID namespace or no permission>", style="dim italic")
    cmd = " ".join(cmd.split())  # a `python -c` script's newlines would break the row
    # Cut the command ourselves: left to Rich, a long no-wrap cell squeezes the short
    # columns out of the table instead.
    if not wide and len(cmd) > room:
        cmd = cmd[: room - 1] + "…"
    return Text(cmd)


def process_table(h: HostReport, wide: bool, width: int = 100) -> Table | Text:
    snap = h.snapshot
    assert snap is not None
    if snap.is_idle and not snap.starting:
        return Text("  no processes on the GPU", style="dim")
    t = Table(box=None, pad_edge=False, header_style="bold", show_edge=False, expand=False)
    # The short columns never shrink: the command takes what is left, and is cut.
    t.add_column("PID", justify="right", no_wrap=True, min_width=5)
    t.add_column("USER", no_wrap=True, min_width=4, max_width=12)
    t.add_column("GPU MEM", justify="right", no_wrap=True, min_width=9)
    t.add_column("SERVICE", no_wrap=True, min_width=7)
    if wide:
        t.add_column("CONTAINER", no_wrap=True)
    t.add_column("COMMAND", overflow="fold" if wide else "ellipsis", no_wrap=not wide)
    names = [s.name for s in h.services] or [""]
    room = max(20, width - 4 - 7 - 13 - 11 - max(8, max(len(n) for n in names) + 2))
    for p in snap.processes:
        owner = owner_of(p.command, h.services, p.pid, h.servers)
        row: list[RenderableType] = [
            str(p.pid),
            p.user or "?",
            format_mib(p.memory_mib),
            owner.name if owner else "",
        ]
        if wide:
            row.append((p.container or "")[:12])
        row.append(_cmd(p.command, wide, room))
        t.add_row(*row)
    for s in snap.starting or ():
        owner = owner_of(s.command, h.services, s.pid, h.servers)
        row = [
            str(s.pid),
            s.user or "?",
            Text("starting", style="yellow"),
            owner.name if owner else "",
        ]
        if wide:
            row.append("")
        row.append(_cmd(s.command, wide, room))
        t.add_row(*row)
    return t


def service_table(h: HostReport) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    t.add_column("SERVICE", no_wrap=True)
    t.add_column("DECISION", no_wrap=True)
    t.add_column("MEMORY", justify="right", no_wrap=True)
    t.add_column("REASON", overflow="fold", ratio=1)
    for svc, v in zip(h.services, h.verdicts, strict=True):
        mem = format_mib(v.own_memory_mib) if v.own else "-"
        if svc.memory_mib:
            mem += f" / {format_mib(svc.memory_mib)}"
        t.add_row(svc.name, Text(v.decision.value, style=DECISION_STYLE[v.decision]), mem, v.reason)
    return t


def host_panel(h: HostReport, wide: bool, width: int = 100) -> Panel:
    title = Text.assemble((h.name, "bold"), "  ", (h.source, "dim"))
    parts: list[RenderableType] = []
    if h.snapshot is None:
        parts.append(Text.assemble(("UNKNOWN ", "bold magenta"), h.error or "no answer"))
        if h.hint:
            parts.append(Text(f"hint: {h.hint}", style="dim"))
    else:
        snap = h.snapshot
        parts.append(memory_bar(snap.memory_used_mib, h.total_mib, snap.unified_memory))
        parts.append(Text(""))
        parts.append(process_table(h, wide, width))
        subtitle = f"probe {snap.probe} · {snap.taken_at}"
    if h.services:
        parts.append(Text(""))
        parts.append(service_table(h))
    return Panel(
        Group(*parts),
        title=title,
        title_align="left",
        subtitle=subtitle if h.snapshot is not None else None,
        subtitle_align="right",
        border_style="magenta" if h.snapshot is None else "blue",
        expand=True,
    )


def render_status(report: StatusReport, wide: bool = False, width: int = 100) -> RenderableType:
    """The whole view; ``width`` is the console's, so long commands are cut to fit."""
    return Group(*(host_panel(h, wide, width) for h in report.hosts))
