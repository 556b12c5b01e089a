"""The ``jupyter`` launcher: a server started from a named JupyterLab terminal.

For a GPU host where JupyterLab is the way in (no Docker, no ssh). Everything goes
through the Jupyter server's REST API and one terminal websocket; nothing runs here.

What ``start`` does, as a user would by hand::

    PUT  /api/contents/gpuctl-jupyter          {"type": "directory"}
    PUT  /api/contents/gpuctl-jupyter/launch_vllm.sh  cd, exports, ``exec <command>``
    GET  /api/terminals/gpuctl_vllm            (POST /api/terminals only on 404)
    ws   /terminals/websocket/gpuctl_vllm, typed:
         cd "$JUPYTER_SERVER_ROOT"; nohup bash gpuctl-jupyter/launch_vllm.sh >/dev/null 2>&1 \\
             </dev/null & echo PID=$!; disown

Why it is built this way (all verified, see mechanics §1):

- ``nohup … </dev/null & …; disown`` is the one form that survives closing the websocket,
  deleting the terminal and restarting (even ``kill -9``) the Jupyter server. The launched
  job is its own process group (the terminal's shell has job control), and the script
  ends in ``exec``, so ``$!`` is the server's own pid and the group is the server's.
- The script goes through the Contents API because the pty silently drops a long typed
  line; what we type stays a few hundred characters whatever the command and env hold.
- Every marker we wait for is ``GPUCTL_<nonce>_$((0+1))_KEY=``: the echo of the typed
  line shows ``$((0+1))`` and only the output shows ``1``; the per-call nonce ignores the
  old output Jupyter replays to each new websocket.
- Paths are relative to Jupyter's ``root_dir``, which is not the terminal's working
  directory (that is the Jupyter process's own). Terminals get ``$JUPYTER_SERVER_ROOT``;
  we ``cd`` there before anything relative, and learn the absolute root from ``$PWD``.
- ``POST /api/terminals`` with a name that exists orphans the old shell, so we GET first.
- Liveness reads ``/proc/PID/stat`` (state after the last ``)``, since the command name may
  hold spaces, and the start time): a zombie is dead, and a pid whose start time differs
  from the recorded one is somebody else's (never signalled).

The terminal's shell (Jupyter's ``$SHELL``) must speak POSIX sh: bash, zsh, dash. For
fish, start Jupyter with ``SHELL=/bin/bash``.

Errors (``LauncherError``; ``StartFailed`` from ``start`` once Jupyter answered):
unreachable (``JupyterUnreachable``; ``alive`` answers None instead), token refused,
Host header refused (``allow_remote_access``), no terminals extension, no answer from
the terminal in time.
"""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
import shlex
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx

from gpuctl.adapters.launchers.base import Handle
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed

if TYPE_CHECKING:
    from websockets.sync.client import ClientConnection

SCRIPT_DIR = "gpuctl-jupyter"
"""Folder under Jupyter's root_dir for launch scripts and default logs. Not hidden (the
Contents API refuses hidden paths), and not a valid module name: a folder ``gpuctl`` in
the server's working directory would shadow the real package for ``python -m gpuctl``."""

# A log larger than this is tailed over the terminal, not downloaded whole.
_CONTENTS_MAX_BYTES = 1 << 20
_POLL_S = 0.2
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# First words after which ``exec`` would be wrong: the command is then written as is.
_KEYWORDS = ("if", "for", "while", "until", "case", "select", "function", "time", "{", "[[", "!")
_BUILTINS = ("exec", "source", ".", "cd", "export", "eval", "set", "trap", "ulimit", "umask")
_NO_EXEC_FIRST = frozenset(_KEYWORDS + _BUILTINS)


class JupyterUnreachable(LauncherError):
    """The Jupyter server did not answer (refused, timed out, reset)."""


# --------------------------------------------------------------------------- pure parts


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


def launch_script(service: ServiceConfig) -> str:
    """The bash script a terminal runs (``nohup bash <it>``) to start ``service``.

    It runs from root_dir, sends all output to the log, changes to ``service.cwd``,
    exports ``service.env`` and ends in ``exec <command>``, so that the process the
    terminal's ``$!`` names becomes the server itself.

    Raises:
        StartFailed: no command, or an env name the shell cannot export.
    """
    if not service.command:
        raise StartFailed(
            f"services.{service.name}.command: missing",
            hint="the jupyter launcher runs a command; set command = '…'",
        )
    log = log_path(service)
    lines = [
        f"# Written by gpuctl for service {service.name!r}; a Jupyter terminal runs it as",
        f"#   nohup bash {script_path(service)} >/dev/null 2>&1 </dev/null &",
        "# Relative paths start at Jupyter's root_dir, the parent of this script's folder.",
        'cd -- "$(dirname -- "$0")/.." || exit 1',
        f'mkdir -p -- "$(dirname -- {_shell_path(log)})"',
        f"exec >{_shell_path(log)} 2>&1 </dev/null",
    ]
    if service.cwd:
        where = _shell_path(service.cwd)
        lines.append(f"cd -- {where} || {{ echo gpuctl: cannot cd to {where} >&2; exit 1; }}")
    for key, value in service.env.items():
        if not _VAR.fullmatch(key):
            raise StartFailed(
                f"services.{service.name}.env: {key!r} is not a shell variable name",
                hint="use letters, digits and '_' only, not starting with a digit",
            )
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(exec_line(service.command))
    return "\n".join(lines) + "\n"


def exec_line(command: str) -> str:
    """``exec <command>`` where that keeps the command's meaning, else the command as is.

    A simple command (``vllm serve … --port 8000``, with redirections) is exec'd, so the
    launched pid is the server. Leading ``VAR=value`` words go through ``env``. A list
    or pipeline (``;``, ``&&``, ``|``…), a compound command or a builtin is written
    unchanged: the recorded pid is then the wrapper shell, and ``stop`` still reaches
    the server because it signals the whole process group.
    """
    text = command.strip()
    if "\n" in text:
        return text
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        return text  # unbalanced quotes: let bash say so in the log
    if not words or any(w[0] in ";&|()" for w in words if _is_punct(w)):
        return text
    first = next((i for i, w in enumerate(words) if not _ASSIGNMENT.match(w)), None)
    if first is None or words[first] in _NO_EXEC_FIRST:
        return text
    return f"exec env {text}" if first > 0 else f"exec {text}"


def _is_punct(word: str) -> bool:
    return bool(word) and all(c in "();<>|&" for c in word)


def _file_safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name, flags=re.ASCII)


def _shell_path(path: str) -> str:
    """Quote a path for the shell, keeping a leading ``~/`` as the remote ``$HOME``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _join_root(root: str, path: str) -> str:
    if path.startswith(("/", "~")):
        return path
    return root.rstrip("/") + "/" + path if root != "/" else "/" + path


def _under_root(root: str | None, path: str) -> str | None:
    """``path`` relative to root_dir (for the Contents API), or None when outside it."""
    if path.startswith("~"):
        return None
    if not path.startswith("/"):
        return path
    if root is None:
        return None
    prefix = root.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def _start_time(fields: list[str]) -> float | None:
    """Epoch seconds from ``<starttime ticks> <btime> <CLK_TCK>`` as read on the host."""
    try:
        ticks, btime, hz = int(fields[0]), int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None
    return btime + ticks / hz if hz > 0 else None


# --------------------------------------------------------------------------- the terminal


class _Terminal:
    """One websocket to a terminado terminal: type a line, wait for its markers."""

    def __init__(self, ws: ClientConnection, name: str, where: str, timeout_s: float) -> None:
        self.ws = ws
        self.name = name
        self.where = where
        self.timeout_s = timeout_s
        self.buf = ""

    def run(
        self, line: str, keys: tuple[str, ...], timeout_s: float | None = None
    ) -> dict[str, str]:
        """Type ``line`` (``{M}`` stands for a fresh marker prefix); return each key's value.

        Waits until the marker of every key in ``keys`` has been printed in full.
        """
        nonce = secrets.token_hex(6)
        typed = line.replace("{M}", f"GPUCTL_{nonce}_$((0+1))_")
        # A leading space keeps our lines out of the shell's history (HISTCONTROL).
        self.send(["stdin", " " + typed + "\r"])
        patterns = {k: re.compile(rf"GPUCTL_{nonce}_1_{k}=([^\r\n]*)\r?\n") for k in keys}
        found: dict[str, str] = {}
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while True:
            for k, pat in patterns.items():
                if k not in found and (m := pat.search(self.buf)):
                    found[k] = m.group(1)
            if len(found) == len(keys):
                return found
            self._read(deadline)

    def block(self, line: str, timeout_s: float | None = None) -> str:
        """Type ``line`` between a begin and an end marker; return what it printed."""
        nonce = secrets.token_hex(6)
        mark = f"GPUCTL_{nonce}_$((0+1))_"
        self.send(["stdin", f" echo {mark}BEGIN=; {line}; echo {mark}END=\r"])
        pat = re.compile(rf"GPUCTL_{nonce}_1_BEGIN=\r?\n(.*?)GPUCTL_{nonce}_1_END=\r?\n", re.S)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while not (m := pat.search(self.buf)):
            self._read(deadline)
        return m.group(1).replace("\r\n", "\n")

    def send(self, msg: list[Any]) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps(msg))
        except ConnectionClosed as e:
            raise self._lost(e) from None

    def _read(self, deadline: float) -> None:
        from websockets.exceptions import ConnectionClosed

        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timeout()
        try:
            raw = self.ws.recv(timeout=left)
        except TimeoutError:
            raise self._timeout() from None
        except ConnectionClosed as e:
            raise self._lost(e) from None
        try:
            kind, *rest = json.loads(raw)
        except (ValueError, TypeError):
            return
        if kind == "stdout" and rest and isinstance(rest[0], str):
            self.buf += rest[0]
        elif kind == "disconnect":  # the pty died: its shell exited
            raise LauncherError(
                f"Jupyter terminal {self.name!r} at {self.where} closed (its shell exited)",
                hint="try again: gpuctl opens a new terminal of that name",
            )

    def _timeout(self) -> LauncherError:
        return LauncherError(
            f"no answer from Jupyter terminal {self.name!r} at {self.where} in time",
            hint="something may run in its foreground: open it in JupyterLab, or delete it "
            "(gpuctl creates it again)",
        )

    def _lost(self, e: Exception) -> JupyterUnreachable:
        return JupyterUnreachable(
            f"lost the connection to Jupyter at {self.where} (terminal {self.name!r}: {e})",
            hint="is the Jupyter server still running? try again",
        )


# --------------------------------------------------------------------------- the launcher


class JupyterLauncher:
    """Start, check and stop servers from named terminals of one Jupyter server.

    Args:
        base_url: the Jupyter server, e.g. ``http://100.64.0.10:8888`` (with any
            ``/user/<name>`` prefix).
        token: sent as ``Authorization: token …`` on every request (so no XSRF is needed).
        host_name: the config's host name, for error messages and hints.
        timeout_s: for each HTTP request, the websocket handshake and each typed line.
    """

    kind = "jupyter"

    def __init__(
        self, base_url: str, token: str | None, host_name: str = "?", timeout_s: float = 15.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.host_name = host_name
        self.timeout_s = timeout_s
        self._root: str | None = None

    # ---------------------------------------------------------------- the Launcher protocol

    def start(self, service: ServiceConfig) -> Handle:
        """Write the launch script, type the launch line, return the server's pid.

        Raises:
            LauncherError: Jupyter is unreachable or refuses us.
            StartFailed: the script could not be written or the terminal did not launch it.
        """
        script = launch_script(service)
        path = script_path(service)
        name = terminal_name(service)
        with self._client() as client:
            self._put(client, SCRIPT_DIR, {"type": "directory"})
            self._put(client, path, {"type": "file", "format": "text", "content": script})
            with self._terminal(client, name) as term:
                root = self._learn_root(term)
                q = shlex.quote(path)
                got = term.run(
                    f"if [ -f {q} ]; then nohup bash {q} >/dev/null 2>&1 </dev/null & "
                    "echo {M}PID=$!; disown; else echo {M}PID=none; fi",
                    ("PID",),
                )
                if not got["PID"].isdigit():
                    raise StartFailed(
                        f"Jupyter terminal {name!r} cannot see {path} in {root}",
                        hint="the terminal's $JUPYTER_SERVER_ROOT should be Jupyter's root_dir; "
                        "is the terminal from another Jupyter server?",
                    )
                pid = int(got["PID"])
                _, started = self._proc(term, pid)
        return Handle(
            kind=self.kind,
            pid=pid,
            pid_start=started,
            terminal=name,
            log=_join_root(root, log_path(service)),
        )

    def alive(self, handle: Handle) -> bool | None:
        """True while the recorded pid runs and is ours; None when Jupyter cannot be reached.

        Raises:
            LauncherError: Jupyter answers but refuses us (token, Host, no terminals).
        """
        if handle.pid is None:
            return None
        try:
            with self._client() as client, self._terminal(client, self._term(handle)) as term:
                state, started = self._proc(term, handle.pid)
        except JupyterUnreachable:
            return None
        return self._is_ours(state, started, handle)

    def stop(self, handle: Handle, grace_s: float) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; wait until gone.

        Idempotent: a server already gone (or a zombie, or a reused pid) is left alone.
        """
        if handle.pid is None:
            return
        pid, ticks = handle.pid, max(1, math.ceil(grace_s / _POLL_S))
        # s: the state letter, '' once /proc/PID is gone. Z and X have exited.
        state = f"s=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -c1)"
        wait = (
            f"n=0; while {state}; case $s in ''|Z|X) false;; esac; do "
            "[ $n -ge $t ] && break; sleep 0.2; n=$((n+1)); done"
        )
        line = (
            f"t={ticks}; kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid} 2>/dev/null; {wait}; "
            f"r=${{s:-gone}}; case $s in ''|Z|X) ;; *) kill -KILL -- -{pid} 2>/dev/null || "
            f"kill -KILL {pid} 2>/dev/null; r=killed; t=25; {wait};; esac; "
            "echo {M}STOP=$r ${s:-gone}"
        )
        with self._client() as client, self._terminal(client, self._term(handle)) as term:
            state_now, started = self._proc(term, pid)
            if not self._is_ours(state_now, started, handle):
                return
            got = term.run(line, ("STOP",), timeout_s=grace_s + 5 + 2 * self.timeout_s)
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
        with self._client() as client:
            rel = _under_root(self._root, handle.log)
            if rel is None and handle.log.startswith("/") and self._root is None:
                with self._terminal(client, self._term(handle)) as term:
                    self._learn_root(term)
                rel = _under_root(self._root, handle.log)
            if rel is not None:
                text = self._read_contents(client, rel)
                if text is not None:
                    return _last_lines(text, lines)
            with self._terminal(client, self._term(handle)) as term:
                text = term.block(f"tail -n {int(lines)} -- {_shell_path(handle.log)} 2>/dev/null")
        return _last_lines(text, lines)

    # ---------------------------------------------------------------- terminal helpers

    def _term(self, handle: Handle) -> str:
        return handle.terminal or "gpuctl"

    def _learn_root(self, term: _Terminal) -> str:
        got = term.run('cd "${JUPYTER_SERVER_ROOT:-.}"; echo {M}ROOT=$PWD', ("ROOT",))
        self._root = got["ROOT"] or "/"
        return self._root

    def _proc(self, term: _Terminal, pid: int) -> tuple[str, float | None]:
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
        return fields[0], _start_time(fields[1:])

    @staticmethod
    def _is_ours(state: str, started: float | None, handle: Handle) -> bool:
        if state in ("gone", "Z", "X", "x"):
            return False
        if handle.pid_start is not None and started is not None:
            # /proc/stat's btime may drift by a second; a reused pid differs far more.
            return abs(started - handle.pid_start) < 2.0
        return True

    @contextmanager
    def _terminal(self, client: httpx.Client, name: str) -> Iterator[_Terminal]:
        """The named terminal (created if missing) with an open websocket."""
        # websockets is imported here, not at module level: keep CLI start fast (DESIGN §2).
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        self._ensure_terminal(client, name)
        split = urlsplit(self.base_url)
        scheme = "wss" if split.scheme == "https" else "ws"
        url = f"{scheme}://{split.netloc}{split.path}/terminals/websocket/{name}"
        stack = ExitStack()
        try:
            # Entered as a context manager: websockets 17.1 deprecates the bare call, and
            # a later release may open the connection in __enter__ instead of connect().
            ws = stack.enter_context(
                connect(
                    url,
                    additional_headers=self._headers(),
                    open_timeout=self.timeout_s,
                    close_timeout=2,
                    max_size=None,
                )
            )
        except InvalidStatus as e:
            code = e.response.status_code
            if code in (401, 403):
                raise self._refused(client) from None
            raise LauncherError(
                f"Jupyter at {self.base_url} refused the websocket of terminal {name!r} "
                f"(HTTP {code})",
                hint="the terminal may have just closed: try again",
            ) from None
        except (OSError, TimeoutError, WebSocketException) as e:
            raise self._unreachable(e) from None
        with stack:
            term = _Terminal(ws, name, self.base_url, self.timeout_s)
            term.send(["set_size", 50, 250])
            yield term

    def _ensure_terminal(self, client: httpx.Client, name: str) -> None:
        # POST with an existing name does not fail: it orphans the old shell. GET first.
        r = self._request(client, "GET", f"/api/terminals/{name}")
        if r.status_code == 200:
            return
        if r.status_code != 404:
            raise self._unexpected(r, "GET", f"/api/terminals/{name}")
        r = self._request(client, "POST", "/api/terminals", json={"name": name})
        if r.status_code == 404:
            raise LauncherError(
                f"the Jupyter server at {self.base_url} has no terminals",
                hint="pip install jupyter_server_terminals on the host (and do not set "
                "ServerApp.terminals_enabled=False); check the URL's path prefix too",
            )
        if r.status_code != 200:
            raise self._unexpected(r, "POST", "/api/terminals")

    # ---------------------------------------------------------------- REST helpers

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    @contextmanager
    def _client(self) -> Iterator[httpx.Client]:
        with httpx.Client(
            base_url=self.base_url, headers=self._headers(), timeout=self.timeout_s
        ) as client:
            yield client

    def _request(
        self, client: httpx.Client, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        """One request; transport errors and refusals become ``LauncherError``."""
        try:
            r = client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if r.status_code in (401, 403):
            raise self._refused(client)
        return r

    def _put(self, client: httpx.Client, path: str, model: dict[str, Any]) -> None:
        r = self._request(client, "PUT", "/api/contents/" + quote(path), json=model)
        if r.status_code not in (200, 201):
            raise StartFailed(
                f"Jupyter at {self.base_url} would not write {path}: "
                f"HTTP {r.status_code} {_message(r)}",
                hint=f"the launcher keeps scripts in {SCRIPT_DIR}/ under Jupyter's root_dir; "
                "it must be a writable folder",
            )

    def _read_contents(self, client: httpx.Client, rel: str) -> str | None:
        """The text of a root_dir file; '' when missing, None when too big for the API."""
        path = "/api/contents/" + quote(rel)
        r = self._request(client, "GET", path, params={"content": "0", "type": "file"})
        if r.status_code in (400, 404):
            return ""
        if r.status_code != 200:
            raise self._unexpected(r, "GET", path)
        size = _json(r).get("size")
        if isinstance(size, int) and size > _CONTENTS_MAX_BYTES:
            return None
        # No format: the server sends text, or base64 when the bytes are not UTF-8.
        r = self._request(client, "GET", path, params={"content": "1", "type": "file"})
        if r.status_code in (400, 404):
            return ""
        if r.status_code != 200:
            raise self._unexpected(r, "GET", path)
        body = _json(r)
        content = body.get("content")
        if not isinstance(content, str):
            return ""
        if body.get("format") == "base64":
            return base64.b64decode(content).decode("utf-8", errors="replace")
        return content

    # ---------------------------------------------------------------- errors

    def _unreachable(self, e: BaseException) -> JupyterUnreachable:
        if isinstance(e, httpx.TimeoutException | TimeoutError):
            what = f"JupyterLab at {self.base_url} did not answer within {self.timeout_s:g}s"
        else:
            what = f"cannot reach JupyterLab at {self.base_url}: is it running?"
        return JupyterUnreachable(
            f"{what} ({type(e).__name__}: {e})" if str(e) else what,
            hint=f"start it on {self.host_name}, or fix hosts.{self.host_name}.jupyter",
        )

    def _refused(self, client: httpx.Client) -> LauncherError:
        """A 401/403: our token, or (when even ``GET /api`` is refused) the Host header."""
        try:
            # GET /api needs no token: refused even there means the Host check refused us.
            open_status = client.get("/api").status_code
        except httpx.HTTPError:
            open_status = 0
        if open_status == 403:
            host = urlsplit(self.base_url).hostname
            return LauncherError(
                f"Jupyter at {self.base_url} refused the Host header {host!r} "
                "(it listens on loopback and accepts only local names)",
                hint="start Jupyter with --ServerApp.allow_remote_access=True",
            )
        h = self.host_name
        if self.token is None:
            return LauncherError(
                f"Jupyter at {self.base_url} wants a token and we have none",
                hint=f"set hosts.{h}.jupyter_token_env or hosts.{h}.jupyter_token_file",
            )
        return LauncherError(
            f"Jupyter at {self.base_url} refused our token",
            hint=f"check hosts.{h}.jupyter_token_env / jupyter_token_file "
            "(a 403 \"'_xsrf' argument missing\" means the same)",
        )

    def _unexpected(self, r: httpx.Response, method: str, path: str) -> LauncherError:
        return LauncherError(
            f"Jupyter at {self.base_url} answered HTTP {r.status_code} to {method} {path}: "
            f"{_message(r)}",
            hint="is the URL a Jupyter server (with any /user/<name> prefix)?",
        )


def _json(r: httpx.Response) -> Mapping[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _message(r: httpx.Response) -> str:
    msg = _json(r).get("message")
    return str(msg) if msg else r.reason_phrase


def _last_lines(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
