"""The ``gpuctl`` Typer application: one factory, one sub-module per command group.

Command modules import only Typer and light gpuctl modules at import time; what a
command needs (httpx, docker, the agent's server stack) is imported inside it. The
factory registers only the command asked for (``gpuctl status …`` builds ``status``
alone): building every command's parameters costs about 20 ms per run. Help, tab
completion and anything unrecognised get every command.
"""

from __future__ import annotations

import importlib
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from typer.completion import completion_init  # type: ignore[attr-defined]

from gpuctl import __version__


class Shell(StrEnum):
    """The shells ``completions/`` has a script for (named, never guessed: guessing
    installed bash's script for a zsh user)."""

    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def _version(value: bool) -> None:
    if value:
        print(f"gpuctl {__version__}")
        raise typer.Exit()


def _install_completion(value: Shell | None) -> None:
    if value is None:
        return
    from gpuctl.cli.completion import install

    done = install(value.value, Path.home())
    print(f"gpuctl: {value.value} completion installed in {done.script}", file=sys.stderr)
    if done.rc_file is not None:
        print(f"gpuctl: added a line to {done.rc_file}", file=sys.stderr)
    print(f"gpuctl: {done.note}", file=sys.stderr)
    raise typer.Exit()


def _show_completion(value: Shell | None) -> None:
    if value is None:
        return
    from gpuctl.cli.completion import script

    sys.stdout.write(script(value.value))
    raise typer.Exit()


def create_app(argv: list[str] | None = None) -> typer.Typer:
    """The app, with the commands the command line ``argv`` needs (default: every command)."""
    if os.environ.get("_GPUCTL_COMPLETE"):
        # add_completion=False also skips registering Typer's completion protocol
        # (complete_bash, complete_zsh, ...), which our scripts speak. typer.completion is
        # a public module, but it imports completion_init rather than exporting it.
        completion_init()
        from gpuctl.cli.completion import register_classes

        register_classes()
    app = typer.Typer(
        name="gpuctl",
        help=(
            "Share one big GPU between heavy workloads: see who holds it, start model "
            "servers exactly once, reclaim what sits idle."
        ),
        no_args_is_help=True,
        # Completion options are ours (gpuctl.cli.completion): Typer's ignore the shell named.
        add_completion=False,
        context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
        install_completion: Annotated[
            Shell | None,
            typer.Option(
                "--install-completion",
                callback=_install_completion,
                is_eager=True,
                expose_value=False,
                help="Install completion for SHELL (in its user start-up files).",
            ),
        ] = None,
        show_completion: Annotated[
            Shell | None,
            typer.Option(
                "--show-completion",
                callback=_show_completion,
                is_eager=True,
                expose_value=False,
                help="Print the completion script for SHELL.",
            ),
        ] = None,
        config: Annotated[
            Path | None,
            typer.Option(
                "--config",
                "-c",
                help="Config file for the command (as its own --config, which wins).",
                metavar="FILE",
            ),
        ] = None,
    ) -> None:
        """Share one big GPU between heavy workloads."""
        from gpuctl.cli.common import set_root_config

        set_root_config(config)

    wanted = _command_modules(argv or [])
    for module in wanted:
        importlib.import_module(f"gpuctl.cli.{module}").register(app)
    return app


# Each command (or command group) and the module that registers it, in help order.
COMMANDS: dict[str, str] = {
    "status": "status_cmd",
    "ensure": "service_cmd",
    "stop": "service_cmd",
    "touch": "service_cmd",
    "locks": "service_cmd",
    "reclaim": "reclaim_cmd",
    "resume": "resume_cmd",
    "run": "run_cmd",
    "events": "events_cmd",
    "usage": "events_cmd",
    "proxy": "proxy_cmd",
    "config": "config_cmd",
    "agent": "agent_cmd",
    "sim": "sim_cmd",
    "demo": "demo_cmd",
}


def _command_modules(argv: list[str]) -> list[str]:
    """The modules to register for this command line: the chosen command's alone, or
    every one (help, completion, an unknown or missing command)."""
    every = list(dict.fromkeys(COMMANDS.values()))
    if any(k.startswith("_GPUCTL_COMPLETE") for k in os.environ):
        return every
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            return every
        if arg in ("-c", "--config"):
            next(args, None)  # its FILE, not a command
            continue
        if not arg.startswith("-"):
            module = COMMANDS.get(arg)
            return [module] if module else every
    return every


# Modules no gpuctl command uses, which httpx and httpcore import at their own import
# whenever the package is installed: httpx's command-line client (it pulls in click,
# rich.progress and pygments: 34 ms a start) and trio (httpcore imports it for its locks:
# 48 ms; gpuctl runs asyncio and threads only). ``None`` in ``sys.modules`` makes their
# import fail at once, and httpx and httpcore take their documented fallbacks. Set in
# the console script only: a program that imports ``gpuctl.api`` keeps its own choice.
NEVER_IMPORTED = ("httpx._main", "trio")


def main() -> None:
    """The console script. Ends with ``os._exit`` once stdout and stderr are flushed.

    Tearing down a few hundred imported modules costs tens of milliseconds of CPU per
    process; with 32 ``gpuctl ensure`` waiters returning at the same moment on a 2-core
    host that alone was about 0.9 s (measured: 888 ms vs 50 ms median). Every command
    has finished its work and closed its clients by then; nothing is left for atexit.
    """
    code: int = 0
    for name in NEVER_IMPORTED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    for stream in (sys.stdout, sys.stderr):
        # A terminal or pipe that cannot carry Unicode (PYTHONIOENCODING=ascii, a C
        # locale): the views draw with ASCII there, and anything else that slips through
        # (a foreign command line) prints as "?" instead of failing the command.
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding not in ("utf8", "utf16", "utf32") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    instruction = os.environ.get("_GPUCTL_COMPLETE", "")
    if instruction.startswith("source_"):
        # Our scripts, not Typer's (see gpuctl.cli.completion); other shells fall through.
        from gpuctl.cli.completion import SHELLS, script

        if instruction[len("source_") :] in SHELLS:
            sys.stdout.write(script(instruction[len("source_") :]))
            sys.stdout.flush()
            os._exit(0)
    try:
        create_app(sys.argv[1:])(prog_name="gpuctl")
    except KeyboardInterrupt:
        # Outside a command's own handling (building the app, parsing the line): one
        # line, never a traceback unless asked for.
        if os.environ.get("GPUCTL_DEBUG", "") not in ("", "0"):  # as common.debug_enabled
            raise
        print("gpuctl: interrupted", file=sys.stderr)
        code = 130
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            code = code or 0
    os._exit(code)
