"""``gpuctl demo``: a guided tour on a simulated GPU. Needs no GPU and no config."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuctl.cli.common import duration_parser, errors_to_exit
from gpuctl.demo.chapters import LOAD_TIME_S, help_text
from gpuctl.errors import ExitCode, GpuctlError

if TYPE_CHECKING:
    from gpuctl.flows.status import StatusReport


def register(app: typer.Typer) -> None:
    app.command("demo", short_help="A guided tour on a simulated GPU.", help=help_text())(demo)


def demo(
    load_time: Annotated[
        float,
        typer.Option(
            "--load-time",
            parser=duration_parser("--load-time", minimum=1.0),
            help=f"How long the fake vLLM takes to load, e.g. 3s (at least 1s).  "
            f"[default: {LOAD_TIME_S:g}s]",
            metavar="DURATION",
            show_default=False,
        ),
    ] = LOAD_TIME_S,
) -> None:
    """A guided tour on a simulated GPU (its help lists the chapters: gpuctl.demo.chapters).

    Exits 1 when a chapter did not see what it promised (under heavy load, say): the
    tour says which, and never calls itself done.
    """
    with errors_to_exit():
        from gpuctl.demo.priority import decision_of
        from gpuctl.demo.tour import run_demo

        narrator = RichNarrator()
        result = run_demo(narrator, load_time_s=load_time)
        if result.missed:
            from rich.text import Text

            narrator.console.print()
            narrator.console.print(
                Text(
                    f"The demo did not show everything it promised ({len(result.missed)} "
                    "missed, marked ✗ above):",
                    style="bold red",
                )
            )
            for text in result.missed:
                narrator.console.print(Text(f"  ✗ {text}"))
            raise typer.Exit(ExitCode.FAILED)
        ok = decision_of(result.report, "vllm")
        narrator.console.print(
            f"\n[bold green]Demo done[/] (vllm ended {ok}). "
            "Next: `gpuctl config init` for your own host.",
            highlight=False,
        )


class RichNarrator:
    """Tells the demo with Rich: redrawn in place on a terminal, printed once per state
    otherwise (a pipe, a log file, CI)."""

    def __init__(self) -> None:
        from gpuctl.render.safe import console

        self.console = console(markup=True)  # the narration's styles are ours
        # The decisions last printed. Off a terminal nothing is redrawn, so a panel is
        # printed only when they change: a chapter whose watch begins in the state the
        # previous one ended in, or a LOADING watch followed by a READY one, would
        # otherwise print the same state twice (168-197 lines piped against ~95).
        self._shown: tuple[tuple[str, str], ...] | None = None

    def chapter(self, title: str, text: str) -> None:
        from rich.rule import Rule
        from rich.text import Text

        from gpuctl.core.safe_text import visible

        self.console.print()
        self.console.print(Rule(f"[bold]{title}", align="left"))
        # Each line of the flow's text is one line (a summary says one action a line);
        # Rich wraps each to the terminal's width. A Text, never markup: the summaries
        # quote outside text (reclaim's lines, the model's answer).
        self.console.print(Text(visible(text, keep_newlines=True)))

    def show(self, report: StatusReport) -> None:
        from gpuctl.render.status_view import render_status

        self.console.print(render_status(report, width=self.console.width))
        self._shown = _state(report)

    def results(self, rows: list[dict[str, Any]]) -> None:
        from rich.table import Table

        t = Table(header_style="bold", box=None, pad_edge=False)
        for col in ("CALLER", "EXIT", "FIRST SAW", "LAUNCHED", "WAITED", "OUTCOME"):
            t.add_column(col)
        for r in rows:
            t.add_row(
                str(r["caller"]),
                str(r["exit"]),
                str(r.get("decision", "?")),
                "[bold green]yes[/]" if r.get("launched") else "no",
                f"{r.get('waited_s', 0):.1f}s",
                str(r.get("reason", "")),
            )
        self.console.print(t)
        launches = sum(1 for r in rows if r.get("launched"))
        self.console.print(f"[bold]{launches} launch[/] for {len(rows)} callers.")

    def missed(self, text: str) -> None:
        from rich.text import Text

        from gpuctl.core.safe_text import visible

        self.console.print(Text(f"✗ did not happen: {visible(text)}", style="bold red"))

    def locks(self, config_path: str) -> None:
        from gpuctl.config import load_config
        from gpuctl.flows import service_ops
        from gpuctl.render.locks import render_locks
        from gpuctl.wiring.build import locks_deps

        deps = locks_deps(load_config(Path(config_path)))
        try:
            self.console.print(render_locks(service_ops.locks(deps), width=self.console.width))
        finally:
            deps.close()

    def events(self, config_path: str, since: float) -> int:
        """The journal of the demo's own run, as `gpuctl events` prints it; how many."""
        from gpuctl.adapters.store import store_for
        from gpuctl.config import load_config
        from gpuctl.flows.story import host_events
        from gpuctl.render.events_view import event_line

        config = load_config(Path(config_path))
        shown = 0
        for name in config.hosts:
            store = store_for(config.host(name))
            try:
                for _, e in host_events(store, since):
                    self.console.print(event_line(None, e, dated=False), markup=False)
                    shown += 1
            except GpuctlError as err:
                self.console.print(f"the journal could not be read: {err.message}", markup=False)
            finally:
                store.close()
        return shown

    def watch(
        self,
        poll: Callable[[], StatusReport],
        until: Callable[[StatusReport], bool],
        timeout_s: float,
    ) -> StatusReport:
        """Redraw status in place until ``until`` holds; off a terminal, print each change."""
        from rich.live import Live

        from gpuctl.render.status_view import render_status

        deadline = time.monotonic() + timeout_s
        report = poll()
        if self.console.is_terminal:
            with Live(
                render_status(report, width=self.console.width),
                console=self.console,
                auto_refresh=False,
            ) as live:
                while not until(report) and time.monotonic() < deadline:
                    time.sleep(0.25)
                    report = poll()
                    live.update(render_status(report, width=self.console.width), refresh=True)
            self._shown = _state(report)
            return report
        while True:
            if _state(report) != self._shown:
                self.show(report)
            if until(report) or time.monotonic() >= deadline:
                return report
            time.sleep(0.25)
            report = poll()


def _state(report: StatusReport) -> tuple[tuple[str, str], ...]:
    """What a panel shows that matters to the story: each service's decision."""
    return tuple((v.service, str(v.decision)) for h in report.hosts for v in h.verdicts)
