"""``gpuctl agent``: run the GPU host agent (docs/reference/agent.md).

The server stack (uvicorn, the ASGI app, the probes) is imported inside the command, so
``gpuctl --help`` does not pay for it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpuctl.cli.common import (
    ConfigOpt,
    duration_parser,
    errors_to_exit,
    open_config,
    say,
    size_parser,
)
from gpuctl.config.paths import default_sim_dir, default_state_dir
from gpuctl.config.values import ProbeName
from gpuctl.core.conn_limits import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_PER_PEER,
    DEFAULT_MAX_TOTAL,
    MIN_PER_PEER,
    ConnectionLimits,
)
from gpuctl.core.health_reach import DEFAULT_HEALTH_PORTS, parse_ports
from gpuctl.errors import UsageError

if TYPE_CHECKING:
    from gpuctl.config.values import Config


def read_token_file(
    path: Path, option: str = "--token-file", env: str = "GPUCTL_AGENT_TOKEN"
) -> str:
    """The token in ``path``, stripped; warns when group or others can read the file."""
    from gpuctl.config.readfile import TOKEN_LIMIT, NotSmallFile, read_small

    try:
        st = path.stat()
        token = read_small(path, TOKEN_LIMIT).decode("utf-8").strip()
    except NotSmallFile as err:
        raise UsageError(
            f"{option}: {err}", hint=f"pass the file that holds the token to {option}, or set {env}"
        ) from None
    except UnicodeDecodeError:
        raise UsageError(f"{option}: {path} is not UTF-8 text") from None
    except OSError as err:
        raise UsageError(
            f"cannot read the token file {path}: {err.strerror or err}",
            hint=f"pass an existing file to {option}, or set {env}",
        ) from None
    if not token:
        raise UsageError(f"the token file {path} is empty", hint="write the token into it")
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        say(
            f"gpuctl agent: warning: {path} is readable by group/others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`"
        )
    return token


LOG_LEVELS = ("debug", "info", "warning", "error")


def _agent_config(explicit: Path | None) -> Config:
    """The GPU host's config for the web view. One named with --config must load; one
    found through $GPUCTL_CONFIG or the default path that does not load is said in a
    warning, and the agent serves without it (its page then offers stop only): a user's
    broken config must not take the GPU host's agent down."""
    from gpuctl.config.values import Config
    from gpuctl.errors import ConfigError

    if explicit is not None:
        return open_config(explicit)
    try:
        return open_config(None)
    except ConfigError as err:
        say(f"gpuctl agent: warning: the web view runs without a config: {err.message}")
        return Config(path=None)


def register(app: typer.Typer) -> None:
    """Add ``gpuctl agent`` to ``app``."""

    @app.command("agent", short_help="Run the GPU host agent (HTTP /status, /records, /metrics).")
    def agent(
        *,
        listen: Annotated[
            str,
            typer.Option(
                "--listen",
                help="HOST:PORT to listen on ([::1]:PORT for IPv6). "
                "Off loopback a token is required.",
                metavar="ADDR",
            ),
        ] = "127.0.0.1:9400",
        probe: Annotated[
            ProbeName,
            typer.Option("--probe", help="How to read the GPU: auto tries NVML, then nvidia-smi."),
        ] = ProbeName.auto,
        token_file: Annotated[
            Path | None,
            typer.Option(
                "--token-file",
                help="File holding the bearer token. Default: $GPUCTL_AGENT_TOKEN.",
                dir_okay=False,
                metavar="FILE",
            ),
        ] = None,
        read_token_file_: Annotated[
            Path | None,
            typer.Option(
                "--read-token-file",
                help="File holding a read-only token: good for GET /status, /records and "
                "/metrics (dashboards, scrapers), refused (403) for writes. "
                "Default: $GPUCTL_AGENT_READ_TOKEN.",
                dir_okay=False,
                metavar="FILE",
            ),
        ] = None,
        match: Annotated[
            str | None,
            typer.Option(
                "--match",
                help="Comma-separated keywords (vllm,translategemma): for clients of the "
                "original /status, report matching processes not yet on the GPU in "
                "`processes` (memory_mib 0, on_gpu false), so is_idle is false while they load.",
                metavar="KEYWORDS",
            ),
        ] = None,
        match_max_age: Annotated[
            float,
            typer.Option(
                "--match-max-age",
                parser=duration_parser("--match-max-age"),
                show_default=False,
                help="With --match: only processes younger than this (a loading server), "
                "e.g. 15m.  [default: 15m]",
                metavar="DURATION",
            ),
        ] = 900.0,
        health_ports: Annotated[
            str,
            typer.Option(
                "--health-ports",
                help="Ports (8000-8100,9000) on which it fetches the health URL a record "
                "names, and only at this machine's own addresses (loopback, its interfaces' "
                "IPs, localhost); 'none': never. Another URL is refused and logged once.",
                metavar="PORTS",
            ),
        ] = DEFAULT_HEALTH_PORTS,
        journal_days: Annotated[
            int,
            typer.Option(
                "--journal-days",
                min=1,
                help="Days of events the journal keeps (older ones survive as daily totals; "
                "the journal also keeps under 512 MiB, dropping the oldest first).",
                metavar="DAYS",
            ),
        ] = 90,
        sim_dir: Annotated[
            Path | None,
            typer.Option(
                "--sim-dir",
                help="The simulated GPU's directory (--probe sim). Default: $GPUCTL_SIM_DIR, "
                "else <user state dir>/sim.",
                file_okay=False,
                metavar="DIR",
            ),
        ] = None,
        gpu_memory: Annotated[
            int | None,
            typer.Option(
                "--gpu-memory",
                parser=size_parser("--gpu-memory"),
                help="The GPU's total memory where the device cannot tell "
                "(unified memory), e.g. 128GiB.",
                metavar="SIZE",
            ),
        ] = None,
        cache_ttl: Annotated[
            float,
            typer.Option(
                "--cache-ttl",
                parser=duration_parser("--cache-ttl"),
                help="Reuse one GPU reading for this long (e.g. 1s, 500ms).  [default: 1s]",
                metavar="DURATION",
                show_default=False,
            ),
        ] = 1.0,
        state_dir: Annotated[
            Path | None,
            typer.Option(
                "--state-dir",
                help="The state directory. Default: $GPUCTL_STATE_DIR, else /var/lib/gpuctl "
                "when writable, else the user state dir.",
                file_okay=False,
                metavar="DIR",
            ),
        ] = None,
        log_level: Annotated[
            str,
            typer.Option(
                "--log-level",
                help="How much to log (on stderr).",
                # The choices, shown as Typer shows an enum's (the check below words the
                # error as every other option of this command does).
                metavar="<" + "|".join(LOG_LEVELS) + ">",
                autocompletion=lambda incomplete: [
                    v for v in LOG_LEVELS if v.startswith(incomplete)
                ],
            ),
        ] = "warning",
        max_connections: Annotated[
            int,
            typer.Option(
                "--max-connections",
                help="Connections kept in all; past it a new one closes the longest idle "
                "one (cut to what the descriptor limit allows).",
                min=1,
                metavar="N",
            ),
        ] = DEFAULT_MAX_TOTAL,
        max_per_peer: Annotated[
            int,
            typer.Option(
                "--max-connections-per-peer",
                help=f"Connections kept from one address (an IPv6 /64), at least {MIN_PER_PEER}.",
                min=MIN_PER_PEER,
                metavar="N",
            ),
        ] = DEFAULT_MAX_PER_PEER,
        header_timeout: Annotated[
            float,
            typer.Option(
                "--header-timeout",
                parser=duration_parser("--header-timeout"),
                show_default=False,
                help="Close a connection whose request head has not all arrived by then.  "
                "[default: 10s]",
                metavar="DURATION",
            ),
        ] = DEFAULT_HEAD_TIMEOUT_S,
        idle_timeout: Annotated[
            float,
            typer.Option(
                "--idle-timeout",
                parser=duration_parser("--idle-timeout"),
                show_default=False,
                help="Close a kept-alive connection idle this long after an answer.  [default: 5s]",
                metavar="DURATION",
            ),
        ] = DEFAULT_IDLE_TIMEOUT_S,
        config: ConfigOpt = None,
    ) -> None:
        """Run the GPU host agent: /status, /records, /events, /metrics, /openapi.json and
        the web view at /ui, over HTTP."""
        with errors_to_exit():
            # Lazy: uvicorn and the app load only when the agent really starts.
            from gpuctl.agent.server import serve

            if token_file is not None:
                token: str | None = read_token_file(token_file.expanduser())
            else:
                token = os.environ.get("GPUCTL_AGENT_TOKEN", "").strip() or None
            if read_token_file_ is not None:
                read_token: str | None = read_token_file(
                    read_token_file_.expanduser(), "--read-token-file", "GPUCTL_AGENT_READ_TOKEN"
                )
            else:
                read_token = os.environ.get("GPUCTL_AGENT_READ_TOKEN", "").strip() or None
            keywords = tuple(
                sorted({w.strip().lower() for w in (match or "").split(",") if w.strip()})
            )

            try:
                ports = parse_ports(health_ports)
            except ValueError as err:
                raise UsageError(
                    f"--health-ports: {err}",
                    hint="name ports and ranges like 8000-8100,9000, or 'none'",
                ) from None
            level = log_level.lower()
            if level not in (*LOG_LEVELS, "critical"):
                raise UsageError(
                    f"--log-level: expected debug, info, warning or error, got {log_level!r}"
                )
            state = (
                state_dir.expanduser() if state_dir is not None else default_state_dir()
            ).absolute()
            sim = (sim_dir.expanduser() if sim_dir is not None else default_sim_dir()).absolute()
            # The web view's services and buttons: this GPU host's config (--config, else
            # $GPUCTL_CONFIG, else the default path; a missing default is none).
            from gpuctl.cli.agent_ui import ConfigBackend

            # The page's flows use this agent's state directory, as its /records do.
            os.environ["GPUCTL_STATE_DIR"] = str(state)
            backend = ConfigBackend(
                _agent_config(config),
                probe=probe.value,
                sim_dir=sim,
                gpu_memory_mib=gpu_memory,
                state_dir=state,
            )
            serve(
                listen,
                probe.value,
                token,
                sim_dir=sim,
                # Named here, it must be there: the default may not be created yet.
                sim_required=sim_dir is not None,
                gpu_memory_mib=gpu_memory,
                cache_ttl_s=cache_ttl,
                state_dir=str(state),
                log_level=level,
                read_token=read_token,
                match=keywords,
                match_max_age_s=match_max_age,
                limits=ConnectionLimits(
                    max_total=max_connections,
                    max_per_peer=max_per_peer,
                    head_timeout_s=header_timeout,
                    idle_timeout_s=idle_timeout,
                ),
                health_ports=ports,
                journal_days=journal_days,
                ui_backend=backend,
            )
