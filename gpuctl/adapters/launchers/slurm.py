"""The ``slurm`` launcher: the server runs as a Slurm batch job.

``start`` submits ``sbatch --parsable --job-name gpuctl-<service> --gres gpu:N
[--time] [--partition] [--account] [--nice] [--qos] --comment gpuctl:<nonce> --output
<log> --open-mode append --wrap 'exec <command>'``. The job inherits sbatch's
environment (``--export ALL``, Slurm's default), which is the caller's less gpuctl's
secrets plus the service's ``env`` and the start marks (``environ.server_env``), so
``GPUCTL_START_NONCE`` reaches the server as with the process launcher. The record keeps
``{"kind": "slurm", "job_id": ...}``.

The proof a stop checks (``Launcher.stop``) is the job's owner, its name and its
comment: a record can name any job id, and ``scancel`` of another user's or another
service's job must never follow from it. Name and comment alone prove nothing: every
user of the cluster can read them in squeue and give a job of theirs the same, so only
a job of the user gpuctl runs as (squeue's ``%u``) counts. ``find`` looks for the
service's job by owner, name and the nonce in its comment, so the job of a start whose
caller died before recording it (or whose ``sbatch`` timed out after submitting) is
adopted, never submitted twice.

Phases come from Slurm: a PENDING job is a start under way (``queue_state`` says why
it waits: "queued by Slurm: Resources"); RUNNING plus a healthy ``/health`` is READY.
``health`` may name ``{node}``: the node Slurm chose, read from squeue's ``%N`` once the
job of this user runs (``node_of``), and only when it is a plain host name. Admission is Slurm's: gpuctl does not count the job against the
host's GPU memory (``flows.look``).

Every Slurm command runs with a timeout; every failure is a ``LauncherError`` with a hint.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.environ import server_env
from gpuctl.adapters.launchers.logfile import open_log, tail_file
from gpuctl.config import ServiceConfig, SlurmConfig
from gpuctl.errors import LauncherError, StartFailed, Unproven

JOB_PREFIX = "gpuctl-"
COMMENT_PREFIX = "gpuctl:"
# squeue's states of a job that still holds (or waits for) its place. COMPLETING is a
# job whose processes are ending: no longer a server.
ACTIVE = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING"}
)
QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING"})
CALL_TIMEOUT_S = 20.0
# How long ``stop`` waits for a job to leave the queue after ``scancel --signal KILL``.
KILL_WAIT_S = 10.0
# The owner (%u) comes before the fields any user may choose (name, comment), so a "|"
# in those cannot shift it; the comment, last, may hold "|" itself.
_FORMAT = "%i|%T|%r|%N|%u|%j|%k"
_FIELDS = 7
# sbatch --parsable: "<job id>[;<cluster>]"; an array job's id is "<id>_<task>".
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?", re.ASCII)
# A node name that can stand for the host part of a URL: nothing a URL would read as a
# user, a port, a path or a second host.
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*", re.ASCII)
# One bracket of a Slurm host list: "01-03,07".
_RANGES = re.compile(r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*", re.ASCII)


class JobState(msgspec.Struct, frozen=True):
    """One job as squeue lists it."""

    job_id: str
    state: str
    reason: str
    node: str
    user: str
    name: str
    comment: str

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def queued(self) -> bool:
        return self.state in QUEUED


def job_name(service: str) -> str:
    return f"{JOB_PREFIX}{service}"


def current_user() -> str:
    """The user gpuctl runs as, as squeue's ``%u`` writes it (the uid where the name is
    unknown). From the password database, not ``$USER``, which the caller can set."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def first_host(nodes: str) -> str:
    """The first host of squeue's ``%N`` (a Slurm host list: ``a,b``, ``node[01-03,07]``),
    checked to be a plain host name.

    Raises:
        LauncherError: a list this cannot read, or a name that is no host name.
    """
    first, depth = nodes, 0
    for i, ch in enumerate(nodes):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            first = nodes[:i]
            break
    parts = re.split(r"\[([^\]]*)\]", first)
    host = parts[0]
    for ranges, rest in zip(parts[1::2], parts[2::2], strict=True):
        if not _RANGES.fullmatch(ranges):
            host = first  # refused below, with the whole list
            break
        host += ranges.split(",")[0].split("-")[0] + rest
    if "[" in host or "]" in host or not _HOST.fullmatch(host):
        raise LauncherError(
            f"squeue gave the node {nodes!r}, which is not a host name",
            hint="write the server's host in the service's health instead of {node}",
        )
    return host


def slurm_filename(path: Path) -> str:
    """``path`` as sbatch's ``--output`` must be written for Slurm to open that very file:
    Slurm replaces ``%j``, ``%u``, ... in it (so ``%`` is written ``%%``), and a backslash
    anywhere makes it drop every backslash, so a path with one cannot be named at all.

    Raises:
        StartFailed: the path holds a backslash.
    """
    text = str(path)
    if "\\" in text:
        raise StartFailed(
            f"the log path {text!r} holds a backslash, which sbatch's --output drops",
            hint="set the service's log (or GPUCTL_STATE_DIR) to a path without one",
        )
    return text.replace("%", "%%")


def slurm_time(seconds: float) -> str:
    """sbatch's ``--time`` as ``D-HH:MM:SS``, rounded up to whole seconds."""
    total = max(1, int(-(-seconds // 1)))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


class SlurmLauncher:
    """Submit, find, check and cancel a service's Slurm job.

    Args:
        slurm: the host's ``[hosts.NAME.slurm]`` table.
        log_dir: where a service without its own ``log`` logs (``<name>.log``). On a
            cluster it must be on a file system the compute nodes share.
        secrets: environment variable names the job must not inherit.
        host: the host's name, for hints.
        user: whose jobs count as gpuctl's (squeue's ``%u``); default the user this
            process runs as.
    """

    kind = "slurm"

    def __init__(
        self,
        slurm: SlurmConfig,
        log_dir: Path,
        secrets: Iterable[str] = (),
        host: str = "",
        user: str | None = None,
    ) -> None:
        self.slurm = slurm
        self.log_dir = Path(log_dir)
        self.secrets = frozenset(secrets)
        self.host = host
        self.user = user if user is not None else current_user()
        self.kill_wait_s = KILL_WAIT_S

    def log_path(self, service: ServiceConfig) -> Path:
        if service.log:
            return Path(service.log).expanduser()
        return self.log_dir / f"{service.name}.log"

    # -- the Slurm commands ---------------------------------------------------------

    def _run(
        self,
        tool: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        where = f"hosts.{self.host}.slurm" if self.host else "the host's slurm table"
        try:
            return subprocess.run(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                # Slurm prints what users wrote (names, comments, reasons) as raw bytes.
                encoding="utf-8",
                errors="replace",
                timeout=CALL_TIMEOUT_S,
                check=False,
            )
        except FileNotFoundError:
            raise LauncherError(
                f"{tool} not found ({argv[0]!r})",
                hint=f"install Slurm's client commands, or set {where}.{tool} to its path",
            ) from None
        except subprocess.TimeoutExpired:
            raise LauncherError(
                f"{tool} did not answer within {CALL_TIMEOUT_S:.0f}s",
                hint="is slurmctld up? `sinfo` tells",
            ) from None
        except OSError as e:
            raise LauncherError(f"cannot run {tool}: {e.strerror or e}") from None

    def jobs(self, *, job_id: str | None = None, name: str | None = None) -> list[JobState]:
        """squeue's jobs, by id or by name (every state squeue still lists)."""
        argv = [self.slurm.squeue, "--noheader", "--format", _FORMAT]
        if job_id is not None:
            argv += ["--jobs", job_id, "--states", "all"]
        if name is not None:
            argv += ["--name", name]
        done = self._run("squeue", argv)
        if done.returncode != 0:
            err = _last_line(done.stderr)
            if job_id is not None and "Invalid job id" in err:
                return []  # gone from slurmctld's memory: it ended a while ago
            raise LauncherError(
                f"squeue failed: {err or f'exit status {done.returncode}'}",
                hint="is slurmctld up? `sinfo` tells",
            )
        out = []
        for line in done.stdout.splitlines():
            parts = line.split("|", _FIELDS - 1)
            if len(parts) == _FIELDS:
                out.append(JobState(*(p.strip() for p in parts)))
        return out

    def own(self, job: JobState) -> bool:
        """Whether the job is this user's: the one thing about it others cannot copy."""
        return job.user == self.user

    def state(self, handle: Handle) -> JobState | None:
        """The handle's job as squeue lists it; None once Slurm has forgotten it."""
        if not handle.job_id:
            return None
        for job in self.jobs(job_id=handle.job_id):
            if job.job_id == handle.job_id:
                return job
        return None

    def queue_state(self, handle: Handle) -> str | None:
        """Why the job waits ("queued by Slurm: Resources"), or None when it does not."""
        job = self.state(handle)
        if job is None or not job.queued:
            return None
        if job.state == "CONFIGURING":
            return f"queued by Slurm: its node {job.node} is being readied (CONFIGURING)"
        if job.reason in ("", "None"):
            # Submitted, not yet looked at by the scheduler: squeue's reason is "None".
            return f"queued by Slurm: waiting for the scheduler ({job.state})"
        return f"queued by Slurm: {job.reason}"

    def node_of(self, service: str, start_nonce: str | None = None) -> str | None:
        """The node the service's running job is on (squeue's ``%N``), else None. Only a
        job of this user counts, and with ``start_nonce`` only the one that start
        submitted: another user's job of the same name is no server of gpuctl's.

        Raises:
            LauncherError: Slurm cannot be asked, or its node is no host name.
        """
        for job in self.jobs(name=job_name(service)):
            if job.state != "RUNNING" or not job.node or not self.own(job):
                continue
            if start_nonce and job.comment != f"{COMMENT_PREFIX}{start_nonce}":
                continue
            return first_host(job.node)
        return None

    # -- the Launcher protocol ------------------------------------------------------

    def start(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle:
        if not service.command:
            raise StartFailed(f"services.{service.name}.command is missing")
        from gpuctl.adapters.launchers.environ import new_start_nonce

        nonce = start_nonce or new_start_nonce()
        log = self.log_path(service)
        # Created here, private and never through a link; the job appends to it.
        out = open_log(log, service.name, root=self.log_dir.parent)
        try:
            os.write(
                out,
                f"\n--- gpuctl: submitting {service.name} to Slurm at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(),
            )
        finally:
            os.close(out)
        s = self.slurm
        argv = [
            s.sbatch,
            "--parsable",
            "--job-name",
            job_name(service.name),
            "--comment",
            f"{COMMENT_PREFIX}{nonce}",
            "--output",
            slurm_filename(log),
            "--open-mode",
            "append",
            "--export",
            "ALL",
        ]
        if s.gpus:
            argv += ["--gres", f"gpu:{s.gpus}"]
        if s.time_limit_s is not None:
            argv += ["--time", slurm_time(s.time_limit_s)]
        if s.partition:
            argv += ["--partition", s.partition]
        if s.account:
            argv += ["--account", s.account]
        if s.nice is not None:
            argv += [f"--nice={s.nice}"]
        if s.qos:
            argv += ["--qos", s.qos]
        if service.cwd:
            argv += ["--chdir", service.cwd]
        # exec: the job's process is the server, not a shell that outlives its signal.
        argv += ["--wrap", f"exec {service.command}"]
        env = server_env(service, os.environ, self.secrets, nonce)
        try:
            done = self._run("sbatch", argv, env=env)
        except LauncherError as e:
            # A timed-out sbatch may have submitted the job all the same.
            return self._submitted(service, nonce, StartFailed(e.message, hint=e.hint))
        job_id = done.stdout.strip().split(";")[0]
        if done.returncode != 0:
            raise StartFailed(
                f"sbatch refused {service.name}: "
                f"{_last_line(done.stderr) or f'exit status {done.returncode}'}",
                hint=f"check hosts.{self.host}.slurm (partition, account, gpus, time_limit) "
                "against `sinfo` and `sacctmgr show assoc`",
            )
        if not _JOB_ID.fullmatch(job_id):
            return self._submitted(
                service,
                nonce,
                StartFailed(
                    f"sbatch answered {_clip(done.stdout)!r} for {service.name}, not a job id",
                    hint=f"is hosts.{self.host}.slurm.sbatch Slurm's sbatch? "
                    "`sbatch --parsable` prints the job id",
                ),
            )
        return Handle(kind=self.kind, job_id=job_id, log=str(log), proof=nonce)

    def _submitted(self, service: ServiceConfig, nonce: str, error: StartFailed) -> Handle:
        """The job an sbatch that failed to say so submitted (found by its nonce), else
        ``error`` raised: a job left unrecorded would run, and hold its GPUs, unseen."""
        try:
            found = self.find(service, nonce)
        except LauncherError:
            found = None
        if found is None:
            raise error
        return found

    def find(self, service: ServiceConfig, start_nonce: str | None = None) -> Handle | None:
        """The job a start with ``start_nonce`` submitted, by its name and comment."""
        if not start_nonce:
            return None
        for job in self.jobs(name=job_name(service.name)):
            if job.active and self.own(job) and job.comment == f"{COMMENT_PREFIX}{start_nonce}":
                return Handle(
                    kind=self.kind,
                    job_id=job.job_id,
                    log=str(self.log_path(service)),
                    proof=start_nonce,
                )
        return None

    def alive(self, handle: Handle) -> bool | None:
        """True while the job is queued or runs; None when Slurm cannot be asked."""
        if not handle.job_id:
            return None
        try:
            job = self.state(handle)
        except LauncherError:
            return None
        return job is not None and job.active

    def stop(self, handle: Handle, grace_s: float, service: str | None = None) -> None:
        """``scancel`` the job (Slurm sends SIGTERM, then SIGKILL after its KillWait),
        then wait for it to leave the queue; ``scancel --signal KILL`` after ``grace_s``."""
        job = self.state(handle)
        if job is None or not job.active:
            return
        if not self.own(job):
            raise Unproven(
                f"Slurm job {job.job_id} is {job.user or 'no one'}'s, not {self.user}'s",
                hint="gpuctl cancels only its own user's jobs; if the record is wrong, "
                "`gpuctl stop` clears it once the job has ended",
            )
        if not handle.proof or job.comment != f"{COMMENT_PREFIX}{handle.proof}":
            raise Unproven(
                f"Slurm job {job.job_id} does not carry the proof of its start",
                hint="if it is the server, `scancel` it by hand; then `gpuctl stop` clears its record",
            )
        if service is not None and job.name != job_name(service):
            raise Unproven(
                f"Slurm job {job.job_id} is {job.name!r}, not {job_name(service)!r}",
                hint="if it is the server, `scancel` it by hand; then `gpuctl stop` clears its record",
            )
        self._scancel([job.job_id])
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self._still_there(handle):
                return
            time.sleep(0.2)
        self._scancel(["--signal", "KILL", "--full", job.job_id])
        deadline = time.monotonic() + self.kill_wait_s
        while True:
            left = self._listed(handle)
            if left is None:
                return
            if time.monotonic() >= deadline:
                raise LauncherError(
                    f"Slurm job {job.job_id} is still listed ({left.state}) "
                    "after scancel --signal KILL",
                    hint=f"its node may be unreachable: `scontrol show job {job.job_id}` "
                    "tells; an operator can `scontrol update nodename=... state=down`",
                )
            time.sleep(0.2)

    def _listed(self, handle: Handle) -> JobState | None:
        """The job while it still holds its place (queued, running, completing)."""
        job = self.state(handle)
        if job is not None and (job.active or job.state == "COMPLETING"):
            return job
        return None

    def _still_there(self, handle: Handle) -> bool:
        return self._listed(handle) is not None

    def _scancel(self, args: list[str]) -> None:
        done = self._run("scancel", [self.slurm.scancel, *args])
        if done.returncode != 0:
            err = _last_line(done.stderr)
            if "already completing or completed" in err or "Invalid job id" in err:
                return
            raise LauncherError(
                f"scancel failed: {err or f'exit status {done.returncode}'}",
                hint="only the job's owner (or a Slurm operator) may cancel it",
            )

    def log_tail(self, handle: Handle, lines: int = 20) -> str:
        if not handle.log:
            return ""
        return tail_file(Path(handle.log), lines)

    def close(self) -> None:
        """Nothing to close: each Slurm command is its own process."""


def _clip(text: str, limit: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
