"""Every command's ``--help``, walked from the real app: no promise of a command that does
not exist, one-line summaries that are not cut, usage lines in capitals (``SERVICE``).

The command list comes from the app itself, so when a planned command lands (reclaim,
run, proxy), its mentions become allowed without editing this test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from gpuctl.cli.app import create_app

runner = CliRunner()

# The commands docs/reference/commands.md lists. A planned one that the app does not have
# yet must not be promised.
README_COMMANDS = [
    "status",
    "ensure",
    "stop",
    "touch",
    "locks",
    "reclaim",
    "run",
    "agent",
    "proxy",
    "config",
    "sim",
    "demo",
]
# Words that name a planned command wherever they appear (no other meaning in gpuctl's
# help); the others ("run") only count as `gpuctl run`.
DISTINCTIVE = {"reclaim": r"\breclaim", "proxy": r"\bproxy\b"}


def tree() -> Any:
    return typer.main.get_command(create_app())


def walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not sub.hidden:
            yield from walk(sub, (*path, name))


PATHS = [path for path, _ in walk(tree())]


def help_text(path: tuple[str, ...], columns: int = 80) -> str:
    r = runner.invoke(create_app(), [*path, "--help"], env={"COLUMNS": str(columns)})
    assert r.exit_code == 0, r.output
    return r.output


def real_commands() -> dict[tuple[str, ...], Any]:
    return dict(walk(tree()))


def test_the_walk_covers_every_command() -> None:
    tops = {p[0] for p in PATHS if p}
    assert {"status", "ensure", "stop", "touch", "locks", "agent", "config", "sim", "demo"} <= tops
    assert ("config", "check") in PATHS and ("sim", "hold") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "gpuctl")
def test_help_promises_only_real_commands(path: tuple[str, ...]) -> None:
    text = help_text(path)
    commands = real_commands()
    tops = {p[0] for p in commands if p}
    for name in README_COMMANDS:
        if name in tops:
            continue
        pattern = DISTINCTIVE.get(name, rf"\bgpuctl {name}\b")
        m = re.search(pattern, text, re.IGNORECASE)
        assert m is None, f"`gpuctl {' '.join(path)} --help` mentions {name!r}, not a command yet"
    # Every `gpuctl X Y` it quotes is a real command (and subcommand, for a group).
    for quoted in re.findall(r"`gpuctl ([^`]*)`", text):
        words = [w for w in quoted.split() if re.fullmatch(r"[a-z][a-z-]*", w)]
        if not words or quoted.startswith("-"):
            continue
        assert (words[0],) in commands, f"{path}: `gpuctl {quoted}` names no command"
        if hasattr(commands[(words[0],)], "commands") and len(words) > 1:
            assert (words[0], words[1]) in commands, f"{path}: `gpuctl {quoted}`"


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize(
    "path", [p for p, c in walk(tree()) if hasattr(c, "commands")], ids=lambda p: " ".join(p)
)
def test_summaries_are_whole(path: tuple[str, ...], columns: int) -> None:
    """Each group's command list shows one-line summaries, never cut with "..."."""
    text = help_text(path, columns)
    listing = text.split("Commands:")[1]
    rows = [ln for ln in listing.splitlines() if ln.strip()]
    assert rows
    for row in rows:
        assert not row.rstrip().endswith("..."), row
        assert "…" not in row, row
    group = real_commands()[path]
    for name, sub in group.commands.items():
        short = sub.get_short_help_str(limit=10_000)
        assert "\n" not in short and not short.endswith("..."), (name, short)


@pytest.mark.parametrize("path", [p for p in PATHS if p], ids=lambda p: " ".join(p))
def test_usage_names_arguments_in_capitals(path: tuple[str, ...]) -> None:
    """`Usage: gpuctl ensure [OPTIONS] SERVICE`, not `{service}` or `service`."""
    usage = help_text(path).splitlines()[0]
    assert usage.startswith(f"Usage: gpuctl {' '.join(path)}"), usage
    rest = usage[len(f"Usage: gpuctl {' '.join(path)}") :].split()
    # `gpuctl run [OPTIONS] -- CMD...`: the `--` before an argument is part of its usage.
    rest = [w for i, w in enumerate(rest) if not (w == "--" and i + 1 < len(rest))]
    for word in rest:
        assert re.fullmatch(r"\[?[A-Z][A-Z_]*\]?(\.\.\.)?", word), f"{usage!r}: {word!r}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "gpuctl")
def test_help_shows_no_markup_and_never_points_to_itself(path: tuple[str, ...]) -> None:
    """Docstrings feed the help: no RST ``literal`` marks; and a command's help does not
    send the reader to that same command."""
    text = help_text(path)
    assert "``" not in text, f"`gpuctl {' '.join(path)} --help` shows RST markup"
    if path:
        assert f"`gpuctl {' '.join(path)}`" not in text, f"{path} --help refers to itself"


def test_demo_help_lists_every_chapter_the_demo_plays() -> None:
    """`gpuctl demo --help` named five decisions and neither the priorities chapter nor the
    proxy one; it lists every chapter now, each on its own line within 80 columns."""
    from gpuctl.demo.chapters import CHAPTERS, heading
    from gpuctl.demo.tour import intro

    text = help_text(("demo",))
    for n in range(1, len(CHAPTERS) + 1):
        assert heading(n) in text, (heading(n), text)
    assert "PREEMPTABLE" in text and "`gpuctl proxy`" in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    # The demo's own first words say what is coming, the last two chapters included.
    opening = " ".join(intro("http://127.0.0.1:1").split())
    assert "preempts" in opening and "`gpuctl proxy`" in opening, opening


@pytest.mark.parametrize("command", ["ensure", "stop", "touch"])
def test_host_says_what_it_means_for_a_pool(command: str) -> None:
    """Without --host these look over a pooled service's whole pool; the option says so
    (it read "Host name from the config." alone)."""
    text = " ".join(help_text((command,)).split())
    assert "A pooled service: that host alone (default: every host of its pool" in text, text


# What Typer prints where a command says nothing better: a string `show_default` wrapped
# in parentheses, and a metavar made of the parameter's Python type.
LEFTOVER = re.compile(r"\[default: \(|<(?:int|str|float|bool|path|text|int range|float range)>")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "gpuctl")
@pytest.mark.parametrize("columns", [80, 200])
def test_help_has_no_typer_leftovers(path: tuple[str, ...], columns: int) -> None:
    """`[default: (2s)]`, `<int range>`, `<str>`: a default or a metavar to write out."""
    text = help_text(path, columns)
    assert not LEFTOVER.findall(text), text
