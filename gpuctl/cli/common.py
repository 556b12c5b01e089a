"""Shared option aliases, output helpers and error conversion for every command.

Kept light: this module is imported at CLI start, so it pulls in nothing heavy.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from gpuctl.errors import ExitCode, GpuctlError


def _config_names(section: str, incomplete: str) -> list[str]:
    """Tab completion of host and service names from the config (never raises)."""
    try:
        from gpuctl.config import load

        conf = load(None)
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
        help="Config file. Default: $GPUCTL_CONFIG, else the user config dir (see `gpuctl config path`).",
        envvar="GPUCTL_CONFIG",
        show_envvar=False,
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
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (with a `schema` version) on stdout.")
]
ServiceArg = Annotated[
    str,
    typer.Argument(
        help="Service name from the config.", show_default=False, autocompletion=complete_service
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("GPUCTL_DEBUG", "") not in ("", "0")


def say(message: str) -> None:
    """A status message: stderr, never stdout (stdout is for data)."""
    print(message, file=sys.stderr)


def fail(err: GpuctlError) -> NoReturn:
    """Print one error line (and its hint) on stderr and exit with its code."""
    msg = f"gpuctl: error: {err.message}"
    if err.hint:
        msg += f"\n  hint: {err.hint}"
    print(msg, file=sys.stderr)
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
        print(
            f"gpuctl: internal error: {type(err).__name__}: {err}\n"
            "  hint: run again with GPUCTL_DEBUG=1 for the traceback, and report it.",
            file=sys.stderr,
        )
        raise typer.Exit(ExitCode.FAILED) from None


def print_json(obj: Any) -> None:
    """One JSON object on stdout, sorted keys (STYLE rule 3)."""
    import json

    sys.stdout.write(json.dumps(obj, sort_keys=True, indent=2) + "\n")
    sys.stdout.flush()


def load_config(explicit: Path | None) -> Any:
    """Load the config the way every command does, warning (once, on stderr) about token
    files that others can read."""
    from gpuctl import config as cfg

    conf = cfg.load(explicit)
    for h in conf.hosts.values():
        for f in (h.token_file, h.jupyter_token_file):
            if f is not None:
                w = cfg.token_file_warning(f)
                if w:
                    say(f"gpuctl: warning: hosts.{h.name}: {w}")
    return conf
