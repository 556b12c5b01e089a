"""The one terminal every human view prints to (``console``), and ``plain`` for text
from outside (``gpuctl.core.safe_text``).

The views put outside text in as ``plain(x)``: a ``Text`` (never read as markup, so a
command line's ``[bold red]`` is shown as typed) whose controls are escaped before Rich
measures it (the columns line up). ``console`` is the net under that: markup off, and
every segment it writes has its controls escaped but Rich's own (cursor moves for
``--watch``, line ends), so a view that forgot ``plain`` still cannot move the cursor,
retitle the terminal or write a raw byte.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpuctl.core.safe_text import visible

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderableType
    from rich.segment import Segment
    from rich.text import Text


def plain(text: str | None, style: str = "") -> Text:
    """Outside text as a ``Text``: controls escaped, no markup."""
    from rich.text import Text

    return Text(visible(text or ""), style=style)


def console(**kwargs: Any) -> Console:
    """A Rich console that cannot be made to write a control sequence by the data."""
    from rich.console import Console
    from rich.segment import Segment

    class SafeConsole(Console):
        def render(
            self, renderable: RenderableType, options: ConsoleOptions | None = None
        ) -> Iterable[Segment]:
            for seg in super().render(renderable, options):
                if seg.control or seg.text == "\n":
                    yield seg
                else:
                    # Rich's own line ends inside a segment stay; all else is escaped.
                    yield Segment(visible(seg.text, keep_newlines=True), seg.style, seg.control)

    kwargs.setdefault("markup", False)
    return SafeConsole(**kwargs)
