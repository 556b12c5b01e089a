"""The lifecycle of a server in a named Jupyter terminal: start, find, check, stop, log."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable

from gpuctl import failpoints
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import (
    START_NONCE_ENV,
    START_SERVICE_ENV,
    UNPROVEN_HINT,
    dropped,
    new_start_nonce,
)
from gpuctl.adapters.launchers.jupyter.errors import JupyterUnreachable
from gpuctl.adapters.launchers.jupyter.rest import JupyterApi
from gpuctl.adapters.launchers.jupyter.script import (
    SCRIPT_DIR,
    join_root,
    launch_script,
    log_path,
    script_path,
    shell_path,
    start_time,
    terminal_name,
    under_root,
)
from gpuctl.adapters.launchers.jupyter.terminal import Terminal
from gpuctl.adapters.proof import MIN_NONCE_LEN
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed, Unproven

_POLL_S = 0.2


class JupyterLauncher:
    """Start, check and stop servers from named terminals of one Jupyter server.

    Args:
        base_url: the Jupyter server, e.g. ``http://100.64.0.10:8888`` (with any
            ``/user/<name>`` prefix).
        token: sent as ``Authorization: token …`` on every request (so no XSRF is needed).
        host_name: the config's host name, for error messages and hints.
        timeout_s: for each HTTP request, the websocket handshake and each typed line.
        secrets: environment variable names the server must not keep from the terminal's
            environment unless the service's ``env`` sets them.
    """

    kind = "jupyter"

    def __init__(
        self,
        base_url: str,
        token: str | None,
        host_name: str = "?",
        timeout_s: float = 15.0,
        secrets: Iterable[str] = (),
    ) -> None:
        self.api = JupyterApi(base_url, token, host_name, timeout_s)
        self.secrets = frozenset(secrets)
        self._root: str | None = None

    @property
    def base_url(self) -> str:
        return self.api.base_url

    @property
    def host_name(self) -> str:
        return self.api.host_name

    @property
    def timeout_s(self) -> float:
        return self.api.timeout_s

    # ---------------------------------------------------------------- the Launcher protocol

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        """Write the launch script, type the launch line, return the server's pid.

        Raises:
            LauncherError: Jupyter is unreachable or refuses us.
            StartFailed: the script could not be written, the log is a symbolic link, or
                the terminal did not launch it.
        """
        # Every start carries a nonce: it is what a stop checks before it signals.
        nonce = start_nonce or new_start_nonce()
        script = launch_script(service, nonce, dropped(service, self.secrets))
        path = script_path(service)
        name = terminal_name(service)
        log = log_path(service)
        with self.api.client() as client:
            self.api.put(client, SCRIPT_DIR, {"type": "directory"})
            self.api.put(client, path, {"type": "file", "format": "text", "content": script})
            with self.api.terminal(client, name) as term:
                root = self._learn_root(term)
                q = shlex.quote(path)
                got = term.run(
                    f"if [ -L {shell_path(log)} ]; then echo {{M}}PID=link; "
                    f"elif [ -f {q} ]; then nohup bash {q} >/dev/null 2>&1 </dev/null & "
                    "echo {M}PID=$!; disown; else echo {M}PID=none; fi",
                    ("PID",),
                )
                if got["PID"] == "link":
                    raise StartFailed(
                        f"the log {join_root(root, log)} of {service.name} is a symbolic link; "
                        "gpuctl does not follow it",
                        hint=f"remove the link, or set services.{service.name}.log to a plain file",
                    )
                if not got["PID"].isdigit():
                    raise StartFailed(
                        f"Jupyter terminal {name!r} cannot see {path} in {root}",
                        hint="the terminal's $JUPYTER_SERVER_ROOT should be Jupyter's root_dir; "
                        "is the terminal from another Jupyter server?",
                    )
                pid = int(got["PID"])
                # The server runs and nothing has told the caller yet: the window a test
                # kills the caller in.
                failpoints.hit("launch.spawned")
                _, started = self._proc(term, pid)
        return Handle(
            kind=self.kind,
            pid=pid,
            pid_start=started,
            terminal=name,
            log=join_root(root, log),
            proof=nonce,
        )

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The server a start with ``start_nonce`` launched, found by the nonce in its
        environment (``/proc/PID/environ`` on the host); None without a nonce or match.

        Raises:
            LauncherError: Jupyter is unreachable or refuses us.
        """
        if not start_nonce or not start_nonce.isalnum():
            return None
        name = terminal_name(service)
        entry = shlex.quote(f"{START_NONCE_ENV}={start_nonce}")
        with self.api.client() as client, self.api.terminal(client, name) as term:
            text = term.block(
                f"for f in $(grep -lsxzF -- {entry} /proc/[0-9]*/environ); do "
                "p=${f#/proc/}; p=${p%/environ}; "
                "echo $p $(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f1,2); done"
            )
            pids: dict[int, int] = {}
            for line in text.splitlines():
                words = line.split()
                ok = len(words) == 3 and words[0].isdigit() and words[2].isdigit()
                if ok and words[1] not in ("Z", "X", "x"):  # Z, X: exited
                    pids[int(words[0])] = int(words[2])
            # The server is the one whose parent does not carry the nonce too (a command
            # that was not exec'd leaves a wrapper shell above it).
            roots = sorted(p for p, parent in pids.items() if parent not in pids)
            if not roots:
                return None
            pid = roots[0]
            _, started = self._proc(term, pid)
        return Handle(kind=self.kind, pid=pid, pid_start=started, terminal=name, proof=start_nonce)

    def alive(self, handle: Handle) -> bool | None:
        """True while the recorded pid runs and is ours; None when Jupyter cannot be reached.

        Raises:
            LauncherError: Jupyter answers but refuses us (token, Host, no terminals).
        """
        if handle.pid is None:
            return None
        try:
            with self.api.client() as client, self.api.terminal(client, _term(handle)) as term:
                state, started = self._proc(term, handle.pid)
        except JupyterUnreachable:
            return None
        return _is_ours(state, started, handle)

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; wait until gone.

        Idempotent: a server already gone (or a zombie, or a reused pid) is left alone.
        Only a process whose environment carries the handle's start nonce is signalled
        (``adapters.proof``; checked in the terminal, on the host).

        Raises:
            Unproven: the process does not carry the nonce; nothing was signalled.
        """
        if handle.pid is None:
            return
        pid, ticks = handle.pid, max(1, math.ceil(grace_s / _POLL_S))
        proof = handle.proof
        if not isinstance(proof, str) or len(proof) < MIN_NONCE_LEN or not proof.isalnum():
            raise Unproven(
                f"pid {pid} on {self.host_name} is not known to be the server its record "
                "names: its record has no proof",
                UNPROVEN_HINT,
            )
        entry = shlex.quote(f"{START_NONCE_ENV}={proof}")
        # And the service it was started for: a record copied from another service
        # carries that server's nonce too.
        test = f"grep -qsxzF -- {entry} /proc/{pid}/environ"
        if service is not None:
            mark = shlex.quote(f"{START_SERVICE_ENV}={service}")
            test += f" && grep -qsxzF -- {mark} /proc/{pid}/environ"
        # s: the state letter, '' once /proc/PID is gone. Z and X have exited.
        state = f"s=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -c1)"
        wait = (
            f"n=0; while {state}; case $s in ''|Z|X) false;; esac; do "
            "[ $n -ge $t ] && break; sleep 0.2; n=$((n+1)); done"
        )
        line = (
            f"if ! {{ {test}; }}; then echo {{M}}STOP=unproven; "
            f"else t={ticks}; kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid} 2>/dev/null; {wait}; "
            f"r=${{s:-gone}}; case $s in ''|Z|X) ;; *) kill -KILL -- -{pid} 2>/dev/null || "
            f"kill -KILL {pid} 2>/dev/null; r=killed; t=25; {wait};; esac; "
            "echo {M}STOP=$r ${s:-gone}; fi"
        )
        with self.api.client() as client, self.api.terminal(client, _term(handle)) as term:
            state_now, started = self._proc(term, pid)
            if not _is_ours(state_now, started, handle):
                return
            got = term.run(line, ("STOP",), timeout_s=grace_s + 5 + 2 * self.timeout_s)
        if got["STOP"].strip() == "unproven":
            raise Unproven(
                f"pid {pid} on {self.host_name} is not the server its record names (its "
                f"environment lacks {START_NONCE_ENV} or {START_SERVICE_ENV}, or cannot be read)",
                UNPROVEN_HINT,
            )
        last = got["STOP"].split()[-1:] or ["gone"]
        if last[0] not in ("gone", "Z", "X", "x"):
            raise LauncherError(
                f"pid {pid} on {self.host_name} still runs 5s after SIGKILL (state {last[0]})",
                hint="a process in state D waits on the kernel or a driver; check the host",
            )

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        """The last ``lines`` of the server's log, '' when it has none (yet).

        Read through the Contents API when it lies under root_dir and is not huge,
        otherwise with ``tail`` in the terminal.
        """
        if not handle.log or lines <= 0:
            return ""
        with self.api.client() as client:
            rel = under_root(self._root, handle.log)
            if rel is None and handle.log.startswith("/") and self._root is None:
                with self.api.terminal(client, _term(handle)) as term:
                    self._learn_root(term)
                rel = under_root(self._root, handle.log)
            if rel is not None:
                text = self.api.read_contents(client, rel)
                if text is not None:
                    return _last_lines(text, lines)
            with self.api.terminal(client, _term(handle)) as term:
                text = term.block(f"tail -n {int(lines)} -- {shell_path(handle.log)} 2>/dev/null")
        return _last_lines(text, lines)

    def close(self) -> None:
        """Nothing to close: each call opens and closes its own connections."""

    # ---------------------------------------------------------------- terminal helpers

    def _learn_root(self, term: Terminal) -> str:
        got = term.run('cd "${JUPYTER_SERVER_ROOT:-.}"; echo {M}ROOT=$PWD', ("ROOT",))
        self._root = got["ROOT"] or "/"
        return self._root

    @staticmethod
    def _proc(term: Terminal, pid: int) -> tuple[str, float | None]:
        """The state letter ('gone' when there is no such process) and the start time."""
        got = term.run(
            f"s=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f1,20); "
            "echo {M}ST=${s:-gone} $(sed -n 's/^btime //p' /proc/stat) "
            "$(getconf CLK_TCK 2>/dev/null || echo 100)",
            ("ST",),
        )
        fields = got["ST"].split()
        if not fields or fields[0] == "gone":
            return "gone", None
        return fields[0], start_time(fields[1:])


def _term(handle: Handle) -> str:
    return handle.terminal or "gpuctl"


def _is_ours(state: str, started: float | None, handle: Handle) -> bool:
    if state in ("gone", "Z", "X", "x"):
        return False
    if handle.pid_start is not None and started is not None:
        # /proc/stat's btime may drift by a second; a reused pid differs far more.
        return abs(started - handle.pid_start) < 2.0
    return True


def _last_lines(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
