"""The ``process`` launcher: a detached command on this machine.

``setsid nohup CMD >>LOG 2>&1 </dev/null &``, but with the pid of the server itself
recorded (the command is exec'd directly, never through ``sh -c``: Debian's dash keeps
a wrapper shell as the parent), with its start time, so a reused pid is never mistaken
for ours. A new session means no SIGHUP when the caller's terminal goes, and nothing
ties the server to the caller: it survives the caller's exit and restart. This fixes the
original ``subprocess.Popen`` child that died with its parent.

The server's environment is the caller's without gpuctl's secrets, plus the service's
``env`` and ``GPUCTL_START_NONCE`` (see ``environ``). The nonce is also the proof a
stop checks before it signals (``adapters.proof``): a record can name any pid. Its log
is never a symbolic link and is private (see ``logfile``).

It serves only the host gpuctl runs on: the flow checks that the caller's host identity
matches the agent's before it uses this launcher.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpuctl import failpoints
from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import (
    START_NONCE_ENV,
    START_SERVICE_ENV,
    UNPROVEN_HINT,
    new_start_nonce,
    server_env,
)
from gpuctl.adapters.launchers.logfile import open_log, tail_file
from gpuctl.adapters.proof import require_env
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed, Unproven


class ProcessLauncher:
    """Start, find, check and stop detached commands on this machine.

    Args:
        log_dir: where a service without its own ``log`` logs (``<name>.log``); its
            parent is the state folder, from which a log under it is reached.
        secrets: environment variable names the server must not inherit unless the
            service's ``env`` sets them.
        sim_env: what a simulated host (``hosts.NAME.sim_dir``) gives its servers, under
            the service's ``env``: ``GPUCTL_SIM_DIR``, so a simulated server claims
            memory on its own host's GPU (and that host's agent counts it), and
            ``GPUCTL_SIM_HOST``, the address ``gpuctl sim model-server`` listens on, so
            two simulated hosts on one machine answer on addresses of their own.
    """

    kind = "process"

    def __init__(
        self, log_dir: Path, secrets: Iterable[str] = (), sim_env: Mapping[str, str] | None = None
    ) -> None:
        self.log_dir = Path(log_dir)
        self.secrets = frozenset(secrets)
        self.sim_env = dict(sim_env or {})

    def log_path(self, service: ServiceConfig) -> Path:
        if service.log:
            return Path(service.log).expanduser()
        return self.log_dir / f"{service.name}.log"

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        if not service.command:
            raise StartFailed(f"services.{service.name}.command is missing")
        try:
            argv = shlex.split(service.command)
        except ValueError as e:
            raise StartFailed(f"services.{service.name}.command: {e}") from None
        log = self.log_path(service)
        out = open_log(log, service.name, root=self.log_dir.parent)
        # Every start carries a nonce: it is what a stop checks before it signals.
        nonce = start_nonce or new_start_nonce()
        env = server_env(service, {**os.environ, **self.sim_env}, self.secrets, nonce)
        try:
            os.write(
                out,
                f"\n--- gpuctl: starting {service.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(),
            )
            proc = subprocess.Popen(
                argv,
                cwd=service.cwd or None,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except FileNotFoundError:
            raise StartFailed(
                f"cannot start {service.name}: {argv[0]!r} not found",
                hint=f"check services.{service.name}.command and PATH",
            ) from None
        except OSError as e:
            raise StartFailed(f"cannot start {service.name}: {e.strerror or e}") from None
        finally:
            os.close(out)
        # Forget the Popen object without waiting: the server must outlive us. Python
        # would otherwise warn "subprocess still running" at exit.
        proc.returncode = 0
        # Its start time first: until it is reaped, an exited child keeps its pid and its
        # /proc entry, so the handle names it whether it still runs or not. Reaped first,
        # a quick exit left the handle without a start time, and a reused pid could pass
        # for the server.
        handle = Handle(
            kind=self.kind,
            pid=proc.pid,
            pid_start=procinfo.start_time(proc.pid),
            log=str(log),
            pid_ns=procinfo.pid_namespace(),
            proof=nonce,
        )
        _reap_when_it_exits(proc.pid)
        # The server runs and nothing has told the caller yet: the window a test kills
        # the caller in.
        failpoints.hit("launch.spawned")
        return handle

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The server a start of ``service`` with ``start_nonce`` spawned, by the nonce and
        the service's name in its environment. A nonce is read from a record anyone with
        the token may write: copied from another service's record, it names that
        service's server, which carries another name, and is not this one's."""
        if not start_nonce:
            return None
        # Each root of the processes carrying the nonce (not a child a server forked) is
        # checked: a decoy carrying a copied nonce and no service mark must not hide the
        # server behind it.
        found = procinfo.pids_with_env(START_NONCE_ENV, start_nonce)
        pid = next(
            (
                p
                for p in sorted(p for p, parent in found.items() if parent not in found)
                if _is_servers(p, service.name)
            ),
            None,
        )
        if pid is None:
            return None
        return Handle(
            kind=self.kind,
            pid=pid,
            pid_start=procinfo.start_time(pid),
            log=str(self.log_path(service)),
            pid_ns=procinfo.pid_namespace(),
            proof=start_nonce,
        )

    def alive(self, handle: Handle) -> bool | None:
        if handle.pid is None:
            return None
        return procinfo.is_same_process(handle.pid, handle.pid_start)

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        pid = handle.pid
        if pid is None or not procinfo.is_same_process(pid, handle.pid_start):
            return
        marks: dict[str, object] = {START_NONCE_ENV: handle.proof}
        if service is not None:
            marks[START_SERVICE_ENV] = service  # not another service's server
        require_env(pid, marks, "the server its record names", UNPROVEN_HINT)
        _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not procinfo.is_alive(pid):
                _reap(pid)
                return
            time.sleep(0.1)
        # The pid may have been reused while we waited: SIGKILL only the same process.
        if procinfo.is_same_process(pid, handle.pid_start):
            _signal(pid, signal.SIGKILL)
        for _ in range(50):
            if not procinfo.is_alive(pid):
                break
            time.sleep(0.1)
        _reap(pid)

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        if not handle.log:
            return ""
        return tail_file(Path(handle.log), lines)

    def close(self) -> None:
        """Nothing to close: the launcher holds no connection."""


def _is_servers(pid: int, service: str) -> bool:
    """Whether ``pid``'s environment names ``service`` as the one it was started for."""
    try:
        require_env(pid, {START_SERVICE_ENV: service}, f"{service}'s server", UNPROVEN_HINT)
    except Unproven:
        return False
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise LauncherError(
            f"not allowed to signal pid {pid}", hint="run as the server's user"
        ) from None


def _reap_when_it_exits(pid: int) -> None:
    """Collect the server's exit status when it exits, while this process lives. A
    long-lived launcher (the agent, for the web view's ensure) is the server's parent:
    unreaped, every server that stopped or crashed would stay its zombie until it exits.
    A daemon thread: a CLI caller exits at once, and the server passes to init."""
    threading.Thread(target=_reap, args=(pid, 0), daemon=True, name=f"gpuctl-reap-{pid}").start()


def _reap(pid: int, flags: int = os.WNOHANG) -> None:
    """Collect our own child's exit status, so it does not linger as our zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, flags)
