"""Shared option aliases, output helpers and error conversion for every command.

Kept light: this module is imported at CLI start, so it pulls in nothing heavy.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from gpuctl.errors import ExitCode, GpuctlError, UsageError

if TYPE_CHECKING:
    from gpuctl.config import Config


def _config_names(section: str, incomplete: str) -> list[str]:
    """Tab completion of host and service names from the config (never raises)."""
    try:
        from gpuctl.config import load_config

        conf = load_config(None)
        names = conf.hosts if section == "hosts" else conf.services
        return [n for n in sorted(names) if n.startswith(incomplete)]
    except Exception:
        return []


def complete_host(incomplete: str) -> list[str]:
    return _config_names("hosts", incomplete)


def complete_service(incomplete: str) -> list[str]:
    return _config_names("services", incomplete)


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        # No envvar here: gpuctl.config.paths is the one reader of $GPUCTL_CONFIG.
        help="Config file. Default: $GPUCTL_CONFIG, else the user config dir (see `gpuctl config path`).",
        metavar="FILE",
    ),
]
HostOpt = Annotated[
    str | None,
    typer.Option(
        "--host",
        "-H",
        help="Host name from the config.",
        autocompletion=complete_host,
        metavar="HOST",
    ),
]
# ensure, stop and touch: a pooled service's --host keeps the command to that host,
# where without it the command looks over the whole pool.
PoolHostOpt = Annotated[
    str | None,
    typer.Option(
        "--host",
        "-H",
        help="Host name from the config. A pooled service: that host alone (default: "
        "every host of its pool, the copy wherever it runs).",
        autocompletion=complete_host,
        metavar="HOST",
    ),
]
HostsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--host",
        "-H",
        help="Host name from the config (repeatable). Default: every host.",
        autocompletion=complete_host,
        metavar="HOST",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (with a `schema` version) on stdout.")
]
ServiceArg = Annotated[
    str,
    typer.Argument(
        help="Service name from the config.",
        show_default=False,
        autocompletion=complete_service,
        metavar="SERVICE",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


class Command(typer.core.TyperCommand):
    """A command whose usage line names its arguments plainly: ``gpuctl ensure [OPTIONS]
    SERVICE``, not Typer's ``{SERVICE}`` (pass as ``app.command(..., cls=Command)``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


def duration_parser(
    option: str, *, allow_zero: bool = False, minimum: float = 0.0
) -> Callable[[Any], float]:
    """A Typer ``parser=`` for a duration option (``30m``, ``250ms``, bare seconds).

    ``inf``, ``nan``, ``1e400``, negatives, zero (unless ``allow_zero``) and values under
    ``minimum`` end the command with ``gpuctl: error: OPTION: …`` and exit 2, before the
    command runs. Typer also runs the default through it, so a number is accepted too.
    """

    def parse(value: Any) -> float:
        from gpuctl.core.units import parse_duration_s

        try:
            seconds = parse_duration_s(value, allow_zero=allow_zero)
        except ValueError as err:
            fail(UsageError(f"{option}: {err}"))
        if seconds < minimum:
            fail(UsageError(f"{option}: must be at least {minimum:g}s, got {value!r}"))
        return seconds

    return parse


def size_parser(option: str) -> Callable[[Any], int]:
    """A Typer ``parser=`` for a size option (``80GiB``, ``512MiB``; a bare number is refused), in MiB.

    ``inf``, ``nan``, ``1e400``, negatives and zero end the command with
    ``gpuctl: error: OPTION: …`` and exit 2.
    """

    def parse(value: Any) -> int:
        from gpuctl.core.units import parse_size_mib

        try:
            return parse_size_mib(value)
        except ValueError as err:
            fail(UsageError(f"{option}: {err}"))

    return parse


def debug_enabled() -> bool:
    return os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")


def say(message: str) -> None:
    """A status message: stderr, never stdout (stdout is for data)."""
    from gpuctl.core.redact import mask_url_passwords
    from gpuctl.core.safe_text import visible

    # Messages quote outside text (a holder's command line, a record's field): its
    # controls are shown escaped, never sent to the terminal (gpuctl.core.safe_text).
    print(visible(mask_url_passwords(message), keep_newlines=True), file=sys.stderr)


def fail(err: GpuctlError) -> NoReturn:
    """Print one error line (and its hint) on stderr and exit with its code."""
    from gpuctl.core.redact import mask_url_passwords
    from gpuctl.core.safe_text import visible

    msg = f"gpuctl: error: {err.message}"
    if err.hint:
        msg += f"\n  hint: {err.hint}"
    # A configured URL's password stays out; outside text's controls are escaped.
    print(visible(mask_url_passwords(msg), keep_newlines=True), file=sys.stderr)
    raise typer.Exit(err.exit_code)


@contextmanager
def errors_to_exit() -> Iterator[None]:
    """Turn gpuctl errors (and unexpected ones) into one line and an exit code.

    With ``GPUCTL_DEBUG=1`` the traceback is shown instead.
    """
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except GpuctlError as err:
        if debug_enabled():
            raise
        fail(err)
    except KeyboardInterrupt:
        print("gpuctl: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # `gpuctl config show | head`: the reader left; that is not an error. Point stdout
        # at /dev/null so the interpreter's final flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise typer.Exit(0) from None
    except Exception as err:
        if debug_enabled():
            raise
        from gpuctl.core.safe_text import visible

        print(
            f"gpuctl: internal error: {type(err).__name__}: {visible(str(err))}\n"
            "  hint: run again with GPUCTL_DEBUG=1 for the traceback, and report it.",
            file=sys.stderr,
        )
        raise typer.Exit(ExitCode.FAILED) from None


def print_json(obj: Any) -> None:
    """One JSON object on stdout, sorted keys (STYLE rule 3)."""
    from gpuctl.core.redact import mask_url_passwords
    from gpuctl.core.safe_text import json_safe

    # A configured URL's password never reaches the output (in a reason, a note, an error);
    # a lone surrogate (a byte that was not UTF-8) is written as `\xff`, so strict JSON
    # parsers accept the output.
    text = json.dumps(json_safe(obj), sort_keys=True, indent=2)
    sys.stdout.write(mask_url_passwords(text) + "\n")
    sys.stdout.flush()


# `gpuctl --config FILE COMMAND`: the file named before the command (set by the app's
# root callback), for a command not given its own --config.
_root_config: list[Path] = []


def set_root_config(path: Path | None) -> None:
    # Set on every run, None included: CliRunner runs many command lines in one process.
    _root_config[:] = [] if path is None else [path]


def chosen_config(explicit: Path | None) -> Path | None:
    """The command's own ``--config``, else the one named before the command, else None
    (``$GPUCTL_CONFIG``, then the default path: ``gpuctl.config.config_path``)."""
    if explicit is not None:
        return explicit
    return _root_config[0] if _root_config else None


def open_config(explicit: Path | None) -> Config:
    """The config for a command (``gpuctl.config.load_config``), its warnings said once
    on stderr (token files that others can read)."""
    from gpuctl.config import load_config

    conf = load_config(chosen_config(explicit))
    for w in conf.warnings:
        say(f"gpuctl: warning: {w}")
    return conf
