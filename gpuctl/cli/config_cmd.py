"""``gpuctl config check|show|path|init``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuctl.cli.common import (
    ConfigOpt,
    JsonOpt,
    chosen_config,
    errors_to_exit,
    print_json,
    say,
)
from gpuctl.errors import ExitCode, GpuctlError

config_app = typer.Typer(help="Find, check and show the configuration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")


# `config path`'s own --config: the shared help points here ("see `gpuctl config path`").
_PathConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Config file. Default: $GPUCTL_CONFIG, else the user config dir.",
        metavar="FILE",
    ),
]


@config_app.command("path")
def path(config: _PathConfigOpt = None) -> None:
    """Print where the config file is read from (and whether it exists)."""
    with errors_to_exit():
        from gpuctl.config import config_path

        p, _ = config_path(chosen_config(config))
        print(p)
        if not p.exists():
            import shlex

            init = "gpuctl config init" + (f" --config {shlex.quote(str(p))}" if config else "")
            print(f"(does not exist yet: `{init}` writes a starter config there)", file=sys.stderr)


@config_app.command("check", short_help="Validate the config; exit 1 naming what is wrong.")
def check(config: ConfigOpt = None) -> None:
    """Validate the config: exit 0 when it is good, 1 naming what is wrong.

    Beyond the file itself, every secret it names must be there: an unset token_env
    or a token_file that is missing, a folder or empty fails the check.
    """
    with errors_to_exit():
        from gpuctl.config import config_path, load_config

        p, _ = config_path(chosen_config(config))
        conf = load_config(chosen_config(config))
        problems = [e for h in conf.hosts.values() for e in h.secret_problems()]
        warnings = list(conf.warnings)
        local_dir = None if problems else _local_state_dir_warning(conf)
        if local_dir:
            warnings.append(local_dir)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if problems:
            for e in problems:
                # The same hint status gives for the same token problem.
                print(f"gpuctl: error: {e.message}", file=sys.stderr)
                if e.hint:
                    print(f"  hint: {e.hint}", file=sys.stderr)
            raise typer.Exit(ExitCode.FAILED)
        if not p.exists():
            print(f"{p}: no config file (an empty config: status probes this machine)")
        else:
            from gpuctl.core.units import plural

            hosts, services = plural(len(conf.hosts), "host"), plural(len(conf.services), "service")
            print(f"{p}: ok ({hosts}, {services})")


def _local_state_dir_warning(conf: Any) -> str | None:
    """On the GPU host itself, warn when this CLI's state dir differs from its agent's:
    two stores would mean two truths. Several agents on this machine with state dirs of
    their own (simulated hosts, a pool tried on one machine) are each reached through
    their agent, and no one GPUCTL_STATE_DIR could match them all: no warning then."""
    from gpuctl.adapters import procinfo
    from gpuctl.config.paths import default_state_dir

    here = procinfo.host_identity()
    mine = str(default_state_dir())
    theirs: dict[str, str] = {}  # state dir -> the first host whose agent uses it
    for h in conf.hosts.values():
        if not h.agent:
            continue
        try:
            from gpuctl.adapters.agent_client import AgentClient

            client = AgentClient(
                h.agent, h.token_for_reads(), timeout_s=min(h.timeout_s, 2.0), host_name=h.name
            )
            try:
                snap = client.status()
            finally:
                client.close()
        except GpuctlError:
            continue
        same_host = snap.host is not None and (snap.host.hostname, snap.host.boot_id) == (
            here.hostname,
            here.boot_id,
        )
        if same_host and snap.state_dir:
            theirs.setdefault(snap.state_dir, h.name)
    if len(theirs) != 1:
        return None
    [(state_dir, name)] = theirs.items()
    if state_dir == mine:
        return None
    return (
        f"hosts.{name}: its agent runs on this machine with state dir {state_dir}, "
        f"but this CLI would use {mine}; set GPUCTL_STATE_DIR={state_dir}"
    )


@config_app.command("show", short_help="Print the config with defaults filled in, secrets masked.")
def show(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Print the config as gpuctl understands it: defaults filled in, secrets masked.

    The output is valid TOML with the config's own key names (secrets' sources appear as
    comments), so it can be pasted back.
    """
    with errors_to_exit():
        from gpuctl.config import load_config
        from gpuctl.render.config_view import config_to_json, config_to_toml

        conf = load_config(chosen_config(config))
        if json_out:
            print_json(config_to_json(conf))
        else:
            sys.stdout.write(config_to_toml(conf))


@config_app.command("init", short_help="Write a commented starter config.")
def init(
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            help="The GPU host's agent URL, when this machine has no GPU. "
            "Default: http://127.0.0.1:9400.",
            metavar="URL",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            "-H",
            help="The host's name in the config. Default: this machine's name when it has "
            "a GPU, else gpu.",
            metavar="NAME",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing config file.")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Write a commented starter config (it passes `gpuctl config check` as it stands).

    With a GPU here (and no --agent), this machine is the host, probed directly;
    otherwise the config points at an agent and a token file is created beside it (mode 600). An existing
    config is never replaced without --force; an existing token file is kept.
    """
    with errors_to_exit():
        from gpuctl.adapters.probes.detect import local_gpu_answers
        from gpuctl.config import config_path
        from gpuctl.config.starter import write_starter

        p, _ = config_path(chosen_config(config))
        # An --agent named on the command line means "the GPU is there", GPU here or not.
        gpu_here = agent is None and local_gpu_answers()
        done = write_starter(p, gpu_here=gpu_here, agent=agent, host=host, force=force)
        print(done.config)
        if done.agent is None:
            say(f"wrote {done.config}: host {done.host}, this machine's GPU, probed directly")
        else:
            tok = "created" if done.token_created else "kept"
            say(
                f"wrote {done.config}: host {done.host}, agent {done.agent}\n"
                f"  token file {done.token_file} ({tok}, mode 600): the agent needs the same "
                f"token: gpuctl agent --token-file <a copy of it>"
            )
        say("next: add a [services.NAME] (see the commented example), then `gpuctl config check`")
