"""The line ``gpuctl ensure`` shows on a terminal while it waits: phase, elapsed time or a
bar against the service's usual start, GPU memory, the newest log line."""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text

from gpuctl.core.durations import progress
from gpuctl.core.redact import mask_url_passwords
from gpuctl.core.safe_text import visible
from gpuctl.core.units import format_duration, format_mib
from gpuctl.flows.results import Progress
from gpuctl.render.safe import console


def status_line(service: str, p: Progress, width: int) -> Text:
    """The ensure status line: phase, elapsed or ETA bar, GPU memory, note, newest log
    line, one line cut with "…" to ``width`` (a wrapped line would cut the log line
    mid-word and leave its start on the row above)."""
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


class ProgressLine:
    """A Rich status line on stderr while waiting: phase, elapsed, GPU memory, newest log line."""

    def __init__(self, service: str) -> None:
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
        text = visible(mask_url_passwords(message), keep_newlines=True)
        self.console.print(text, markup=False, highlight=False)

    def stop(self) -> None:
        self.status.stop()
