"""The chapters of ``gpuctl demo``, in order: each title and what it shows, in a few words.

One list for the demo's headings, its opening overview and ``gpuctl demo --help``, so the
help cannot fall behind the tour again (it named five decisions and not the priority or
proxy chapters). Standard library only: ``--help`` imports it.
"""

from __future__ import annotations

# The fake vLLM's load time: long enough to watch it LOADING, short enough that the tour
# (which loads it three times) stays under half a minute.
LOAD_TIME_S = 3.0

# (title, what the chapter shows)
CHAPTERS: tuple[tuple[str, str], ...] = (
    ("An idle GPU", "every service IDLE"),
    ("Someone else's job", "FITS beside it, or BUSY"),
    ("Three callers, one launch", "LOADING, READY"),
    ("One shared truth", "`gpuctl locks`"),
    ("Priorities: the chat preempts the photo batch", "PREEMPTABLE, resume"),
    ("A chat request to a stopped server", "through `gpuctl proxy`"),
    ("The GPU's story", "`gpuctl events`: what happened, who did it and why"),
    ("Done", "everything cleaned up"),
)


def heading(n: int) -> str:
    """Chapter ``n``'s heading (from 1), as the demo prints it: ``5. Priorities: …``."""
    return f"{n}. {CHAPTERS[n - 1][0]}"


def help_text() -> str:
    """``gpuctl demo --help``: the tour, one chapter a line (``\\b`` keeps click from
    rewrapping the list)."""
    lines = [f"  {n}. {title} ({what})" for n, (title, what) in enumerate(CHAPTERS, 1)]
    return (
        "A guided tour on a simulated GPU made of real processes (no GPU, no config).\n\n"
        "\b\n" + "\n".join(lines)
    )
