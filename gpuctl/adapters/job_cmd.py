"""A ``gpuctl run`` job's CMD as a process: forked in its own session and held until it
is recorded (``spawn_job``, ``GatedChild``), and stopped: its pid is its process group,
so the whole group gets SIGTERM, a grace period, then SIGKILL.

The job as the decisions see it (its record, budget, priority, who can signal it) is
``gpuctl.core.jobs``; the use case, ``gpuctl.flows.run``.

A record is writable by any holder of the write token, so a pid it names proves
nothing: before any signal, the pid must carry the job's own marks in its environment
(``verify_job``): the random nonce ``gpuctl run`` put there and into the record, the
job's name, and that it was started ``--preemptible``; and it must lead its own session,
as ``GatedChild`` made it. A process ``gpuctl run`` did not start is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from gpuctl.adapters import procinfo
from gpuctl.adapters.launchers.environ import (
    RUN_JOB_ENV,
    RUN_NONCE_ENV,
    RUN_PREEMPTIBLE_ENV,
    START_NONCE_ENV,
)
from gpuctl.adapters.proof import MIN_NONCE_LEN, has_env, require_env
from gpuctl.core.jobs import JOB_GRACE_S
from gpuctl.errors import LauncherError, Unproven


def new_nonce() -> str:
    """A job's nonce: unguessable, so no other process can carry it by chance."""
    return secrets.token_hex(16)


def run_env(env: dict[str, str], job: str, nonce: str, preemptible: bool) -> dict[str, str]:
    """CMD's environment: ``env`` with the job's marks (replacing any inherited from an
    outer job), less a server's start nonce (a job run from inside a server is no server)."""
    out = {k: v for k, v in env.items() if k != START_NONCE_ENV}
    out[RUN_JOB_ENV] = job
    out[RUN_NONCE_ENV] = nonce
    out[RUN_PREEMPTIBLE_ENV] = "1" if preemptible else "0"
    return out


def verify_job(pid: int, job: str, nonce: object, proc_root: str = "/proc") -> None:
    """Refuse unless ``pid`` is the CMD ``gpuctl run`` started for the preemptible job
    ``job`` (no ``run.`` prefix) with ``nonce``, and leads its own session.

    Raises:
        LauncherError: it is not (or its environment cannot be read): never signal it.
    """
    if not isinstance(nonce, str) or len(nonce) < MIN_NONCE_LEN:
        raise LauncherError(
            f"the record of run.{job} carries no run nonce: pid {pid} is not known to be its CMD",
            hint="only a job started by this gpuctl's `gpuctl run --preemptible` can be stopped",
        )
    refused = "a record naming another process is refused: read the record again"
    marks = {RUN_JOB_ENV: job, RUN_NONCE_ENV: nonce, RUN_PREEMPTIBLE_ENV: "1"}
    try:
        require_env(
            pid,
            marks,
            f"run.{job}'s CMD",
            refused,
            lacks="the job's name, nonce or --preemptible mark",
            proc_root=proc_root,
        )
        stat = Path(f"{proc_root}/{pid}/stat").read_text()
    except Unproven as e:
        raise LauncherError(e.message, e.hint) from None
    except OSError as e:
        raise LauncherError(
            f"cannot read pid {pid}'s stat ({e.strerror or e}): "
            f"not signalling what may not be run.{job}'s CMD",
            hint="run the agent (or gpuctl) as the user who runs the job, or as root",
        ) from None
    if has_env(pid, START_NONCE_ENV, proc_root):
        # The marks pass only to the job's own CMD (``run_env``), never to a server
        # gpuctl launches (``launchers.environ`` scrubs them); a server started by an
        # older gpuctl from inside a job still carries both, and is not the job's CMD.
        raise LauncherError(
            f"pid {pid} is a server gpuctl launched (it carries {START_NONCE_ENV}), "
            f"not run.{job}'s CMD",
            hint=refused,
        )
    fields = stat.rsplit(")", 1)[-1].split()  # state, ppid, pgrp, session, ...
    if len(fields) < 4 or fields[3] != str(pid):
        raise LauncherError(
            f"pid {pid} does not lead its own session, as run.{job}'s CMD does", hint=refused
        )


def stop_job(handle: dict[str, Any], job: str, grace_s: float = JOB_GRACE_S) -> bool:
    """SIGTERM the job's process group, wait up to ``grace_s``, then SIGKILL. Returns
    whether it had to be killed. ``job``: its name (no ``run.`` prefix).

    Raises:
        LauncherError: the job runs on another machine (its pid means nothing here), its
            handle names no pid, the pid is not the job's CMD (``verify_job``), or this
            user may not signal it.
    """
    pid, started = handle.get("pid"), handle.get("pid_start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise LauncherError("the job's record names no pid")
    here = procinfo.host_identity()
    if (handle.get("host"), handle.get("boot_id")) != (here.hostname, here.boot_id):
        raise LauncherError(
            f"job pid {pid} runs on {handle.get('host') or 'another machine'}, not here",
            hint="run the preempting command on the GPU host, or give the host an agent",
        )
    start = float(started) if isinstance(started, int | float) else None
    return signal_job(pid, start, grace_s, job=job, nonce=handle.get("run_nonce"))


def signal_job(pid: int, start: float | None, grace_s: float, *, job: str, nonce: object) -> bool:
    """SIGTERM, up to ``grace_s`` for it to end, then SIGKILL: to the job's process group
    (CMD is its session's leader, so its children go too), or to its pid alone when CMD
    left that group. ``start``: its recorded start time; a pid reused by another process
    is never signalled. Returns whether it had to be killed (False: it ended, or had
    ended before).

    Raises:
        LauncherError: this user may not signal it (another user's job, not as root),
            or it is not the job's CMD (``verify_job``): nothing was signalled.
    """
    if not procinfo.is_same_process(pid, start):
        return False  # it has ended already (or its pid went to another process)
    verify_job(pid, job, nonce)
    _send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not procinfo.is_same_process(pid, start):
            return False
        time.sleep(0.05)
    if not procinfo.is_same_process(pid, start):
        return False
    _send(pid, signal.SIGKILL)
    return True


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        # Its group only while it leads one: killpg of a pid that leads none would miss
        # it (ESRCH), and then nothing would ever stop it.
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return  # ended meanwhile
    except PermissionError:
        # Silently waiting out the grace period would report a stop that never happened.
        raise LauncherError(
            f"not permitted to signal job pid {pid} ({sig.name})",
            hint="stop it as the user who runs it, or run the agent (or gpuctl) as root",
        ) from None


class GatedChild:
    """CMD forked in its own session, held before ``exec`` until ``go()``.

    ``gpuctl run`` records the child's pid first and only then lets it run: a kill -9 of
    ``gpuctl run`` between the two would otherwise leave a CMD on the GPU that no record
    counts (the trials found one such, as an out-of-memory of a server admitted beside
    it). If ``gpuctl run`` dies before ``go()``, the child reads the end of its pipe and
    exits without running CMD.
    """

    def __init__(self, argv: list[str], env: dict[str, str], nonce: str) -> None:
        self.nonce = nonce
        go_r, self._go_w = os.pipe()
        self._err_r, err_w = os.pipe()  # close-on-exec: EOF means exec succeeded
        pid = os.fork()
        if pid == 0:  # the child: only async-signal-safe work until exec
            code = 125
            try:
                os.setsid()
                os.close(self._go_w)
                os.close(self._err_r)
                if os.read(go_r, 1) == b"1":
                    os.execvpe(argv[0], argv, env)  # noqa: S606 (CMD itself, never a shell)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.write(err_w, str(e.errno or 0).encode())
                code = 127
            os._exit(code)
        os.close(go_r)
        os.close(err_w)
        self.pid = pid
        self.returncode: int | None = None

    def go(self) -> None:
        """Let it exec CMD. Raises the ``OSError`` exec failed with (the child is reaped)."""
        os.write(self._go_w, b"1")
        os.close(self._go_w)
        data = b""
        while chunk := os.read(self._err_r, 32):
            data += chunk
        os.close(self._err_r)
        if data:
            self.wait()
            errno_ = int(data.decode() or 0)
            raise OSError(errno_, os.strerror(errno_))

    def abandon(self) -> None:
        """Never run CMD: the child exits at once."""
        with contextlib.suppress(OSError):
            os.close(self._go_w)
            os.close(self._err_r)
        self.wait()

    def wait(self) -> int:
        """Its exit code; negative N for a signal N (as ``subprocess``)."""
        if self.returncode is None:
            while True:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    break
                except InterruptedError:
                    continue
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def spawn_job(argv: list[str], env: dict[str, str], job: str, preemptible: bool) -> GatedChild:
    """CMD forked in its own session, held before it runs, with the job's marks in its
    environment (``verify_job``: a stop signals only a pid that carries its nonce)."""
    nonce = new_nonce()
    return GatedChild(argv, run_env(env, job, nonce, preemptible), nonce)
