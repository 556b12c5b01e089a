"""The human view of ``gpuctl status``: built by pure functions from a report.

``render_status`` returns one Rich renderable, so ``--watch`` can hand the same
function to ``Live`` and a plain run prints it once. Where the terminal cannot show
Unicode (``PYTHONIOENCODING=ascii``, a C locale) it draws with ASCII (``glyphs``).

The memory bar draws what the decisions count: what the GPU holds, what is promised to
services that are loading or starting (each at its budget), and what is left::

    GPU memory █████▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓░░░░░░░ 20.0 GiB / 128.0 GiB  util 37%
    █ held 20.0 GiB  ▓ promised 80.0 GiB  ░ free 28.0 GiB
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpuctl.core.decision import Decision
from gpuctl.core.idle import short_duration
from gpuctl.core.safe_text import visible
from gpuctl.core.timestamps import normalise_iso
from gpuctl.core.units import format_duration, format_mib
from gpuctl.flows.results import HostReport, MemoryUse, StatusReport
from gpuctl.render.others import other_reason
from gpuctl.render.safe import plain

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


class Glyphs(msgspec.Struct, frozen=True):
    held: str
    promised: str
    free: str
    cut: str  # the end of a cut command
    dot: str  # between footer parts
    spark: str  # the sparkline's levels, lowest first
    degree: str


UNICODE = Glyphs("█", "▓", "░", "…", "·", "▁▂▃▄▅▆▇█", "°")
ASCII = Glyphs("#", "+", ".", "~", "-", "_.-=*#", "")


def glyphs(encoding: str | None) -> Glyphs:
    """Unicode where the output encoding can carry it, else ASCII."""
    try:
        "█▓░…·▁°".encode(encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ASCII
    return UNICODE


def short_command(command: str) -> str:
    """``python3 -m vllm.entrypoints… --model X``: the program by its base name, then its
    arguments (a long venv path would push the model and the job's name out of view)."""
    words = command.split()
    if not words:
        return ""
    return " ".join([words[0].rsplit("/", 1)[-1], *words[1:]])


def memory_bar(
    m: MemoryUse, g: Glyphs = UNICODE, label: str = "GPU memory", wide: bool = False
) -> Text:
    """A stacked bar (held, promised, free) and its legend on the next line; ``wide``
    adds the GPU's name, temperature and power."""
    t = Text(f"{label} ", style="bold")
    total, held = m.total_mib, m.held_mib
    if m.error:
        t.append(plain(f"unknown ({m.error})", style="magenta"))
        return t
    if held is None or not total:
        t.append(f"{format_mib(held)} held / {format_mib(total)}", style="dim")
    else:
        used = held + m.promised_mib
        frac = min(1.0, used / total)
        n_held = round(min(1.0, held / total) * _BAR_WIDTH)
        n_promised = max(0, round(frac * _BAR_WIDTH) - n_held)
        style = "green" if frac < 0.6 else "yellow" if frac < 0.85 else "red"
        t.append(g.held * n_held, style=style)
        t.append(g.promised * n_promised, style="yellow")
        t.append(g.free * (_BAR_WIDTH - n_held - n_promised), style="dim")
        t.append(f" {format_mib(held)} / {format_mib(total)}")
    t.append(f"  util {_pct(m.utilization_pct)}")
    if m.unified:
        t.append("  (unified memory)", style="italic dim")
    if wide:
        # A line of its own, labelled: appended to the bar it wrapped at 80 columns, and
        # a bare "?  ?" said nothing.
        temp = "?" if m.temperature_c is None else f"{m.temperature_c}{g.degree}C"
        power = "?" if m.power_w is None else f"{m.power_w:.0f} W"
        t.append("\n")
        if m.name:
            t.append(plain(f"{m.name}  ", style="dim"))
        t.append(f"temperature {temp}  power {power}")
    if held is not None and total:
        # The legend goes on its own line, unindented, so it fits 80 columns.
        free = max(0, total - held - m.promised_mib)
        t.append(f"\n{g.held} held {format_mib(held)}  ")
        if m.unknown_promises:
            # A record that does not say what it promised: nothing here can be called free.
            who = ", ".join(m.unknown_promises[:2])
            t.append(f"{g.promised} promised ? ({who}: unknown)", style="bold magenta")
            t.append(f"  {g.free} free ?", style="dim")
            return t
        t.append(f"{g.promised} promised {format_mib(m.promised_mib)}", style="yellow")
        t.append(f"  {g.free} free {format_mib(free)}", style="dim")
    return t


def _duration(seconds: float) -> str:
    """``300ms``, ``2s``, ``2m00s``: short intervals keep their milliseconds."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return format_duration(seconds)


def _pct(p: int | None) -> str:
    return "?" if p is None else f"{p}%"  # unknown is never 0


class MemoryHistory:
    """Each host's used share of GPU memory over the last minutes, for ``--watch``'s
    sparkline labelled "used": what the device reports held, never what is only promised
    to a loading service (the bar above shows that apart). Fed one report at a time;
    keeps ``points`` of them."""

    def __init__(self, points: int = 60, every_s: float | None = None) -> None:
        self.points = points
        self.every_s = every_s
        self.series: dict[str, deque[float | None]] = {}

    def span(self, host: str) -> str:
        """What the sparkline covers, in words: ``last 2m`` (or ``5 readings``)."""
        n = len(self.series.get(host, ()))
        if self.every_s and n > 1:
            return f"last {_duration((n - 1) * self.every_s)}"
        return f"{n} reading{'s' if n != 1 else ''}"

    def add(self, report: StatusReport) -> MemoryHistory:
        for h in report.hosts:
            s = self.series.setdefault(h.name, deque(maxlen=self.points))
            s.append(_used_share(h))
        return self

    def sparkline(self, host: str, g: Glyphs = UNICODE) -> str:
        """One glyph per report (' ' where it was unknown), lowest level for empty."""
        out = []
        for v in self.series.get(host, ()):
            if v is None:
                out.append(" ")
            else:
                out.append(g.spark[min(len(g.spark) - 1, int(v * len(g.spark)))])
        return "".join(out)


def _used_share(h: HostReport) -> float | None:
    known = [m for m in h.memory if m.total_mib and m.held_mib is not None and not m.error]
    if not known or len(known) != len(h.memory):
        return None
    total = sum(m.total_mib or 0 for m in known)
    used = sum(m.held_mib or 0 for m in known)
    return min(1.0, used / total)


def _cmd(cmd: str | None, wide: bool, room: int, g: Glyphs, differs_at: int | None = None) -> Text:
    if cmd is None:
        return Text("<not visible: other PID namespace or no permission>", style="dim italic")
    # Escaped before it is measured and cut: an escape sequence in argv is shown, never
    # sent to the terminal (gpuctl.core.safe_text).
    cmd = visible(" ".join(cmd.split()))  # a `python -c` script's newlines would break the row
    if wide:
        return Text(cmd)
    return Text(_cut(short_command(cmd), room, g, differs_at))


def _cut(cmd: str, room: int, g: Glyphs, differs_at: int | None = None) -> str:
    """``cmd`` cut to ``room`` (ourselves: left to Rich, a long no-wrap cell squeezes the
    short columns out of the table instead). ``differs_at``: where it first differs from
    another row's command that would be cut the same; the program is kept, then the
    words from there (``python3 …--name b --memory…``), so the two rows differ."""
    if len(cmd) <= room:
        return cmd
    if differs_at is not None and differs_at >= room - len(g.cut):
        program = cmd.split(" ", 1)[0]
        start = cmd.rfind(" ", 0, differs_at) + 1  # from the word that differs
        tail = cmd[start:]
        cmd = f"{program} {g.cut}{tail}"
        if len(cmd) <= room:
            return cmd
    return cmd[: room - len(g.cut)] + g.cut


def _distinct_cuts(commands: list[str | None], room: int, g: Glyphs) -> dict[int, int]:
    """For rows whose commands differ but would be cut to the same text: the index of
    each such row, and where its command first differs from the others'."""
    shown: dict[str, list[int]] = {}
    texts = [short_command(visible(" ".join(c.split()))) if c else None for c in commands]
    for i, text in enumerate(texts):
        if text is not None and len(text) > room:
            shown.setdefault(_cut(text, room, g), []).append(i)
    out: dict[int, int] = {}
    for rows in shown.values():
        distinct = {texts[i] for i in rows}
        if len(distinct) < 2:
            continue  # the same command twice: nothing to tell apart
        for i in rows:
            text = texts[i]
            assert text is not None
            out[i] = max(
                next((k for k, (a, b) in enumerate(zip(text, o, strict=False)) if a != b), 0)
                for o in distinct
                if o is not None and o != text
            )
    return out


def _command_room(h: HostReport, width: int, *, many: bool, sm: bool, wide: bool) -> int:
    """What is left of ``width`` for the COMMAND column once the panel's border and the
    other columns (each as wide as its widest cell, two spaces between) are drawn."""
    snap = h.snapshot
    assert snap is not None
    pids = [p.pid for p in snap.processes] + [s.pid for s in snap.starting or ()]
    users = [p.user for p in snap.processes] + [s.user for s in snap.starting or ()]
    widths = [
        max(5, *(len(str(pid)) for pid in pids)),  # PID
        min(12, max(4, *(len(visible(u or "?")) for u in users))),  # USER
        max(9, *(len(format_mib(p.memory_mib)) for p in snap.processes), 8),  # GPU MEM
        max(7, *(len(visible(s.name)) for s in h.services), 0),  # SERVICE
    ]
    if many:
        widths.append(3)
    if sm:
        widths.append(4)
    if wide:
        widths.append(12)
    return max(20, width - 4 - sum(widths) - 2 * len(widths))


def process_table(
    h: HostReport,
    wide: bool,
    width: int = 100,
    g: Glyphs = UNICODE,
    empty: str = "no processes on the GPU",
) -> Table | Text:
    snap = h.snapshot
    assert snap is not None
    if not snap.processes and not snap.starting:
        return Text(f"  {empty}", style="dim")
    t = Table(box=None, pad_edge=False, header_style="bold", show_edge=False, expand=False)
    # The short columns never shrink: the command takes what is left, and is cut.
    t.add_column("PID", justify="right", no_wrap=True, min_width=5)
    t.add_column("USER", no_wrap=True, min_width=4, max_width=12)
    many = len(snap.device_list()) > 1
    sm = any(p.sm_util_pct is not None for p in snap.processes)
    if many:
        t.add_column("GPU", justify="right", no_wrap=True)
    t.add_column("GPU MEM", justify="right", no_wrap=True, min_width=9)
    if sm:
        t.add_column("SM", justify="right", no_wrap=True)
    t.add_column("SERVICE", no_wrap=True, min_width=7)
    if wide:
        t.add_column("CONTAINER", no_wrap=True)
    t.add_column("COMMAND", overflow="fold" if wide else "ellipsis", no_wrap=not wide)
    room = _command_room(h, width, many=many, sm=sm, wide=wide)
    starting_pids = {s.pid for s in snap.starting or ()}
    listed = [p for p in snap.processes if p.on_gpu or p.pid not in starting_pids]
    # Two rows whose commands would be cut to the same text (two sim servers at 80
    # columns) show where they differ instead.
    differs = (
        {}
        if wide
        else _distinct_cuts(
            [p.command for p in listed] + [s.command for s in snap.starting or ()], room, g
        )
    )
    for i, p in enumerate(listed):
        owner = h.owner(p.pid, p.command)
        row: list[RenderableType] = [str(p.pid), plain(p.user or "?")]
        if many:
            row.append(str(p.gpu))
        # The agent lists a server of ours that has no GPU context yet for older clients:
        # it holds nothing, so it reads as starting, as in the JSON's `starting`.
        row.append(format_mib(p.memory_mib) if p.on_gpu else Text("starting", style="yellow"))
        if sm:
            row.append(_pct(p.sm_util_pct))
        row.append(plain(owner.name if owner else ""))
        if wide:
            row.append(plain((p.container or "")[:12]))
        row.append(_cmd(p.command, wide, room, g, differs.get(i)))
        t.add_row(*row)
    for j, s in enumerate(snap.starting or (), len(listed)):
        owner = h.owner(s.pid, s.command)
        row = [str(s.pid), plain(s.user or "?")]
        if many:
            row.append("")
        row.append(Text("starting", style="yellow"))
        if sm:
            row.append("")
        row.append(plain(owner.name if owner else ""))
        if wide:
            row.append("")
        row.append(_cmd(s.command, wide, room, g, differs.get(j)))
        t.add_row(*row)
    return t


def service_table(h: HostReport, g: Glyphs = UNICODE) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    t.add_column("SERVICE", no_wrap=True)
    t.add_column("DECISION", no_wrap=True)
    t.add_column("MEMORY", justify="right", no_wrap=True)
    t.add_column("REASON", overflow="fold", ratio=1)
    for svc, v, hh in zip(h.services, h.verdicts, h.health, strict=True):
        mem = format_mib(v.own_memory_mib) if v.own else "-"
        if not v.own and hh.memory_mib is not None:
            mem = format_mib(hh.memory_mib)  # an Ollama model: what /api/ps says it holds
        if svc.memory_mib:
            mem += f" / {format_mib(svc.memory_mib)}"
        reason = f"{v.reason} (hint: {v.hint})" if v.hint else v.reason
        idle = h.yielding.get(svc.name)
        if idle is not None:
            # Its priority does not protect it now: say so where its row is read.
            reason += f"; idle {short_duration(idle)}: yields to any start that preempts"
        if g.cut != "…":  # the reasons' own cut marker, drawn as the table's
            reason = reason.replace("…", g.cut)
        # Text, not markup: a command line's "[...]" is data, never a style.
        t.add_row(
            plain(svc.name),
            Text(v.decision.value, style=DECISION_STYLE[v.decision]),
            mem,
            plain(reason),
        )
    for o in h.others:
        budget = o.promise.memory_mib if o.promise else None
        mem = format_mib(o.memory_mib) if o.pids else "-"
        mem += f" / {format_mib(budget)}" if budget else (" / ?" if o.promise is None else "")
        t.add_row(
            plain(o.name),
            Text(o.phase, style="dim" if o.promise else "bold magenta"),
            mem,
            plain(other_reason(o)),
        )
    return t


def pool_table(report: StatusReport, g: Glyphs = UNICODE) -> Panel | None:
    """The pooled services, each on one line across its hosts (``dgx1 READY, dgx2
    IDLE``): where its copy runs, and how it stands elsewhere. None without a pool."""
    rows: dict[str, list[tuple[str, Decision]]] = {}
    pools: dict[str, tuple[str, ...]] = {}
    for h in report.hosts:
        for svc, v in zip(h.services, h.verdicts, strict=True):
            if svc.pooled:
                pools[svc.name] = svc.hosts
                rows.setdefault(svc.name, []).append((h.name, v.decision))
    if not rows:
        return None
    t = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    t.add_column("POOLED SERVICE", no_wrap=True)
    t.add_column("HOSTS", overflow="fold", ratio=1)
    for name, seen in rows.items():
        order = {host: i for i, host in enumerate(pools[name])}
        cells: list[Text | str] = []
        for host, decision in sorted(seen, key=lambda x: order.get(x[0], len(order))):
            if cells:
                cells.append(f" {g.dot} ")
            cells.append(
                Text.assemble(plain(host), " ", (decision.value, DECISION_STYLE[decision]))
            )
        t.add_row(plain(name), Text.assemble(*cells))
    return Panel(t, title=Text("pools", style="bold"), title_align="left", expand=True)


def host_panel(
    h: HostReport,
    wide: bool,
    width: int = 100,
    g: Glyphs = UNICODE,
    history: MemoryHistory | None = None,
    *,
    filtered: bool = False,
) -> Panel:
    title = Text.assemble(plain(h.name, "bold"), "  ", plain(h.source, "dim"))
    parts: list[RenderableType] = []
    subtitle: Text | None = None
    if h.snapshot is None:
        parts.append(Text.assemble(("UNKNOWN ", "bold magenta"), plain(h.error or "no answer")))
        if h.hint:
            parts.append(plain(f"hint: {h.hint}", style="dim"))
    else:
        snap = h.snapshot
        for m in h.memory:
            label = "GPU memory" if m.gpu is None else f"GPU {m.gpu} memory"
            parts.append(memory_bar(m, g, label, wide))
        for note in snap.notes:  # the agent's words: shown escaped, never as markup
            parts.append(plain(f"note: {note}", style="yellow"))
        if history is not None and h.name in history.series:
            parts.append(
                Text.assemble(
                    ("used      ", "bold"),
                    history.sparkline(h.name, g),
                    (f"  {history.span(h.name)}", "dim"),
                )
            )
        parts.append(Text(""))
        empty = "no process matches the filter" if filtered else "no processes on the GPU"
        parts.append(process_table(h, wide, width, g, empty))
        subtitle = plain(f"probe {snap.probe} {g.dot} {normalise_iso(snap.taken_at)}")
    if h.services or h.others:
        parts.append(Text(""))
        parts.append(service_table(h, g))
    return Panel(
        Group(*parts),
        title=title,
        title_align="left",
        subtitle=subtitle,
        subtitle_align="right",
        border_style="magenta" if h.snapshot is None else "blue",
        expand=True,
    )


def render_status(
    report: StatusReport,
    wide: bool = False,
    width: int = 100,
    *,
    g: Glyphs = UNICODE,
    history: MemoryHistory | None = None,
    interval_s: float | None = None,
) -> RenderableType:
    """The whole view; ``width`` is the console's, so long commands are cut to fit.

    With ``interval_s`` (``--watch``) a header names the interval and how to quit, and
    ``history`` adds each host's sparkline of used memory.
    """
    filtered = bool(report.filters)
    panels: Sequence[RenderableType] = [
        host_panel(h, wide, width, g, history, filtered=filtered) for h in report.hosts
    ]
    pools = pool_table(report, g)
    if pools is not None:
        panels = [*panels, pools]
    heads = []
    if interval_s is not None:
        heads.append(
            f"every {_duration(interval_s)} {g.dot} {report.taken_at} {g.dot} Ctrl-C to quit"
        )
    if filtered:
        heads.append(f"showing {f' {g.dot} '.join(report.filters)} (memory figures: all)")
    return Group(*(plain(h, style="dim") for h in heads), *panels)
