"""The launch script a Jupyter terminal runs, and where things live under root_dir. Pure."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from gpuctl.adapters.launchers.environ import start_marks
from gpuctl.config import ServiceConfig
from gpuctl.errors import StartFailed

SCRIPT_DIR = "gpuctl-jupyter"
"""Folder under Jupyter's root_dir for launch scripts and default logs. Not hidden (the
Contents API refuses hidden paths), and not a valid module name: a folder ``gpuctl`` in
the server's working directory would shadow the real package for ``python -m gpuctl``."""

_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# First words after which ``exec`` would be wrong: the command is then written as is.
_KEYWORDS = ("if", "for", "while", "until", "case", "select", "function", "time", "{", "[[", "!")
_BUILTINS = ("exec", "source", ".", "cd", "export", "eval", "set", "trap", "ulimit", "umask")
_NO_EXEC_FIRST = frozenset(_KEYWORDS + _BUILTINS)

LOG_IS_LINK_EXIT = 86
"""The script's exit status when its log is a symbolic link (it refuses to follow it)."""


def terminal_name(service: ServiceConfig) -> str:
    """The terminal this service runs in: ``service.terminal`` or ``gpuctl_<name>``.

    Jupyter's routes match ``\\w+`` only: any other character becomes ``_``.
    """
    return re.sub(r"\W", "_", service.terminal or f"gpuctl_{service.name}", flags=re.ASCII)


def script_path(service: ServiceConfig) -> str:
    """The launch script, relative to Jupyter's root_dir."""
    return f"{SCRIPT_DIR}/launch_{_file_safe(service.name)}.sh"


def log_path(service: ServiceConfig) -> str:
    """The server's log as configured: absolute, ``~/…``, or relative to root_dir."""
    return service.log or f"{SCRIPT_DIR}/{_file_safe(service.name)}.log"


def launch_script(
    service: ServiceConfig, start_nonce: str | None = None, unset: Iterable[str] = ()
) -> str:
    """The bash script a terminal runs (``nohup bash <it>``) to start ``service``.

    It runs from root_dir, sends all output to the log (created 0600 whatever the umask,
    never through a symbolic link), changes to ``service.cwd``, unsets ``unset`` (gpuctl's
    secrets, which the terminal has from the Jupyter server's environment), exports
    ``service.env`` and the start nonce, and ends in ``exec <command>``, so that the
    process the terminal's ``$!`` names becomes the server itself.

    Raises:
        StartFailed: no command, or an env name the shell cannot export.
    """
    if not service.command:
        raise StartFailed(
            f"services.{service.name}.command: missing",
            hint="the jupyter launcher runs a command; set command = '…'",
        )
    log = shell_path(log_path(service))
    lines = [
        f"# Written by gpuctl for service {service.name!r}; a Jupyter terminal runs it as",
        f"#   nohup bash {script_path(service)} >/dev/null 2>&1 </dev/null &",
        "# Relative paths start at Jupyter's root_dir, the parent of this script's folder.",
        'cd -- "$(dirname -- "$0")/.." || exit 1',
        f'mkdir -p -- "$(dirname -- {log})"',
        # A log that is a symbolic link would make the server write into another file.
        f"[ -L {log} ] && exit {LOG_IS_LINK_EXIT}",
        f"(umask 077; : >>{log}) && chmod 600 -- {log} || exit 1",
        # Appending (>>): gpuctl rotates logs by copying and truncating them, and a
        # writer that does not append would go on writing past the truncated end.
        f"exec >>{log} 2>&1 </dev/null",
    ]
    if service.cwd:
        where = shell_path(service.cwd)
        lines.append(f"cd -- {where} || {{ echo gpuctl: cannot cd to {where} >&2; exit 1; }}")
    names = [n for n in unset if _VAR.fullmatch(n)]
    if names:
        lines.append("unset " + " ".join(sorted(names)))
    # What ``environ.is_scrubbed`` catches by pattern and no list can name: an enclosing
    # job's marks and gpuctl's secret-named variables (``exports`` below set back any the
    # service gives on purpose).
    lines.append(
        "for v in ${!GPUCTL_@}; do case $v in GPUCTL_RUN_*|*TOKEN*|*KEY*|*SECRET*|*PASSW*|*PWD*)"
        ' unset "$v";; esac; done'
    )
    exports = dict(service.env)
    if start_nonce:
        exports.update(start_marks(service.name, start_nonce))
    for key, value in exports.items():
        if not _VAR.fullmatch(key):
            raise StartFailed(
                f"services.{service.name}.env: {key!r} is not a shell variable name",
                hint="use letters, digits and '_' only, not starting with a digit",
            )
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(exec_line(service.command))
    return "\n".join(lines) + "\n"


def exec_line(command: str) -> str:
    """``exec <command>`` where that keeps the command's meaning, else ``exec bash -c``.

    A simple command (``vllm serve … --port 8000``, with redirections) is exec'd, so the
    launched pid is the server. Leading ``VAR=value`` words go through ``env``. A list
    or pipeline (``;``, ``&&``, ``|``…), a compound command, a builtin or several lines
    run in a fresh ``bash -c`` exec'd in the terminal's place: the recorded pid is then
    that wrapper, and ``stop`` still reaches the server because it signals the whole
    process group. Either way the recorded pid's own environment (``/proc/PID/environ``,
    fixed when the process is exec'd) carries the start nonce the script exported, which
    is the proof a stop checks; the terminal's shell, started before the export, does
    not carry it.
    """
    text = command.strip()
    wrapped = f"exec bash -c {shlex.quote(text)}"
    if "\n" in text:
        return wrapped
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        return wrapped  # unbalanced quotes: let bash say so in the log
    if not words or any(w[0] in ";&|()" for w in words if _is_punct(w)):
        return wrapped
    first = next((i for i, w in enumerate(words) if not _ASSIGNMENT.match(w)), None)
    if first is not None and words[first] == "exec" and first == 0:
        return text
    if first is None or words[first] in _NO_EXEC_FIRST:
        return wrapped
    return f"exec env {text}" if first > 0 else f"exec {text}"


def _is_punct(word: str) -> bool:
    return bool(word) and all(c in "();<>|&" for c in word)


def _file_safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name, flags=re.ASCII)


def shell_path(path: str) -> str:
    """Quote a path for the shell, keeping a leading ``~/`` as the remote ``$HOME``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def join_root(root: str, path: str) -> str:
    """``path`` made absolute against root_dir (``~/…`` and absolute paths unchanged)."""
    if path.startswith(("/", "~")):
        return path
    return root.rstrip("/") + "/" + path if root != "/" else "/" + path


def under_root(root: str | None, path: str) -> str | None:
    """``path`` relative to root_dir (for the Contents API), or None when outside it."""
    if path.startswith("~"):
        return None
    if not path.startswith("/"):
        return path
    if root is None:
        return None
    prefix = root.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def start_time(fields: list[str]) -> float | None:
    """Epoch seconds from ``<starttime ticks> <btime> <CLK_TCK>`` as read on the host."""
    try:
        ticks, btime, hz = int(fields[0]), int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None
    return btime + ticks / hz if hz > 0 else None
