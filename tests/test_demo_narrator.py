"""The demo's narrator (``gpuctl.cli.demo_cmd.RichNarrator``) as a unit: how a chapter's
text reaches the terminal. The demo itself runs end to end in ``tests/test_demo.py``."""

from __future__ import annotations

import io

from gpuctl.cli.demo_cmd import RichNarrator
from gpuctl.demo.tour import intro
from gpuctl.render.safe import console


def told(title: str, text: str, width: int = 60) -> list[str]:
    narrator = RichNarrator()
    out = io.StringIO()
    narrator.console = console(file=out, width=width, markup=True, color_system=None)
    narrator.chapter(title, text)
    lines = out.getvalue().splitlines()
    assert lines[0] == "" and title in lines[1], lines
    return [ln.rstrip() for ln in lines[2:]]


def test_a_summary_keeps_one_line_per_action() -> None:
    """Reclaim's lines and the client's answer ran together into one paragraph."""
    lines = told(
        "what reclaim did",
        "stopped vllm on sim: idle 1.2s > 1.0s\n"
        "resumed photos on sim: launched\n"
        "photos done before the preemption: 5; after resuming: 30 of 30, 0 done twice.",
    )
    assert lines[0] == "stopped vllm on sim: idle 1.2s > 1.0s", lines
    assert lines[1] == "resumed photos on sim: launched", lines
    # A line longer than the terminal is still wrapped, its words kept.
    assert lines[2].startswith("photos done before the preemption: 5;"), lines
    assert all(len(ln) <= 60 for ln in lines), lines
    assert " ".join(" ".join(lines[2:]).split()).endswith("30 of 30, 0 done twice."), lines


def test_prose_is_wrapped_to_the_terminal_and_outside_text_is_not_markup() -> None:
    lines = told("1. An idle GPU", intro("http://127.0.0.1:9400"), width=50)
    assert len(lines) > 3 and all(len(ln) <= 50 for ln in lines), lines
    # The prose is one paragraph: no line ends where the source's string did.
    assert " ".join(lines).startswith("A simulated 128 GiB GPU (like a DGX Spark) with its"), lines
    answer = told("what the client saw", ": loading 1s\nthe answer: [bold]hi[/] \x1b[2J")
    assert answer == [": loading 1s", "the answer: [bold]hi[/] \\x1b[2J"], answer
