"""Host process facts: command line, user, container, liveness, start time.

A process in state ``Z`` (zombie) has exited: where PID 1 does not reap orphans
(containers, some VMs) ``kill(pid, 0)`` still succeeds on it, so every liveness
check here reads the state instead.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import time
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

from gpuctl.core.redact import redact_argv
from gpuctl.core.snapshot import HostIdentity, StartingProcess

# /docker/<64hex>, docker-<64hex>.scope, cri-containerd-<64hex>.scope, libpod-<64hex>.scope
_CGROUP_ID = re.compile(r"(?:docker|cri-containerd|libpod|containerd)[-/]([0-9a-f]{64})")


def is_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie."""
    import psutil  # lazily: the CLI's status path needs none of this

    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        # AccessDenied on status() is rare (hidepid); treat it as alive only if kill(0) works.
        try:
            os.kill(pid, 0)
        except PermissionError:
            # It exists, as another user's (EPERM is never said of a pid that is gone).
            return _state_from_proc(pid) not in ("Z", "X")
        except OSError:
            return False
        return _state_from_proc(pid) not in ("Z", "X", None)


def pid_namespace() -> int | None:
    """The inode of this process's PID namespace (``stat -L /proc/self/ns/pid``), or None
    where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _state_from_proc(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; the state follows the last ')'.
    return stat.rsplit(")", 1)[1].split()[0]


def start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), to tell a reused pid from ours."""
    import psutil  # lazily: the CLI's status path needs none of this

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_same_process(pid: int, started: float | None) -> bool:
    """True when ``pid`` is alive and (if known) started at ``started`` (±1 s)."""
    if not is_alive(pid):
        return False
    if started is None:
        return True
    now_start = start_time(pid)
    return now_start is not None and abs(now_start - started) < 1.0


def command_of(pid: int) -> str | None:
    """The full command line, secrets redacted (``gpuctl.core.redact``), or None where it
    cannot be read (other PID namespace, no permission)."""
    import psutil  # lazily: the CLI's status path needs none of this

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None
    return " ".join(redact_argv(argv)) if argv else None


def user_of(pid: int) -> str | None:
    """The process's user name (its uid where the name is unknown), or None."""
    import psutil

    try:
        return psutil.Process(pid).username()
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, OSError):
        # KeyError: a uid with no passwd entry (common inside containers).
        try:
            return str(psutil.Process(pid).uids().real)
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            return None


def container_of(pid: int, proc_root: str = "/proc") -> str | None:
    """The container id from ``/proc/<pid>/cgroup``, or None for a host process."""
    try:
        text = Path(proc_root, str(pid), "cgroup").read_text()
    except OSError:
        return None
    return parse_container_id(text)


def parse_container_id(cgroup_text: str) -> str | None:
    """Find a 64-hex container id in the text of a ``/proc/<pid>/cgroup`` file."""
    m = _CGROUP_ID.search(cgroup_text)
    return m.group(1) if m else None


@lru_cache(maxsize=1)
def host_identity() -> HostIdentity:
    """This machine's hostname and boot id (``/proc/sys/kernel/random/boot_id``)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return HostIdentity(hostname=socket.gethostname(), boot_id=boot_id)


_CLIENT_COMMANDS = frozenset(
    {
        "status",
        "ensure",
        "stop",
        "touch",
        "locks",
        "reclaim",
        "agent",
        "config",
        "demo",
        "proxy",
        "run",
    }
)


def _subcommand(args: list[str]) -> str:
    """The command of gpuctl's arguments: the first word that is not an option, past
    the one option given before it that takes a value (``--config F`` / ``-c F``)."""
    it = iter(args)
    for a in it:
        if a in ("--config", "-c"):
            next(it, None)
        elif not a.startswith("-"):
            return a
    return ""


def _is_gpuctl_client(argv: list[str], depth: int = 0) -> bool:
    """True for ``gpuctl status vllm``-like command lines: they name a service but are not it.

    Also inside a shell's ``-c`` script (cron runs ``sh -c "gpuctl ensure vllm | …"``).
    ``gpuctl sim model-server --name vllm`` *is* a (simulated) server and stays matchable.
    """
    for i, arg in enumerate(argv[:4]):
        if os.path.basename(arg) == "gpuctl":
            rest = argv[i + 1 :]
        elif arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "gpuctl":
            rest = argv[i + 2 :]
        else:
            continue
        return _subcommand(rest) in _CLIENT_COMMANDS
    if depth == 0 and len(argv) >= 3 and os.path.basename(argv[0]) in _SHELLS and argv[1] == "-c":
        try:
            words = shlex.split(argv[2])
        except ValueError:
            words = argv[2].split()
        # Each command of the script: split at the shell's separators.
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in (";", "|", "||", "&&", "&"):
                if cmd and _is_gpuctl_client(cmd, depth + 1):
                    return True
                cmd = []
            else:
                cmd.append(w)
    return False


_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "busybox"})


@lru_cache(maxsize=1)
def own_lineage() -> tuple[int, ...]:
    """This process and its ancestors (cached: they do not change while we run).

    Read from /proc directly: it runs on every status call, where importing psutil
    would cost more than the walk.
    """
    pids = [os.getpid()]
    pid = os.getppid()
    while pid > 0 and pid not in pids:
        pids.append(pid)
        state = _stat_fields(pid)
        if state is None:
            break
        pid = int(state[1])  # the fields after the command: state, ppid, ...
    return tuple(pids)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def find_matching(
    keywords: Iterable[str],
    exclude_pids: Iterable[int] = (),
    state_dir: str | None = None,
    sim_dir: str | None = None,
) -> Iterator[StartingProcess]:
    """Host processes whose command line contains one of ``keywords`` (case-insensitive).

    Skips zombies, this process and its ancestors, gpuctl's own client commands
    (``gpuctl ensure vllm`` names the service, it is not the service), and processes
    that name a file of gpuctl's ``state_dir`` (``tail -f …/gpuctl/logs/vllm.log``
    reads the service's log, it is not the service: no launcher puts those files in a
    server's command line).

    ``sim_dir``: a simulated host's GPU folder: a server launched for another simulated
    host, or one that names another folder, does not count (``on_sim_dir``), so two
    simulated hosts on one machine do not take each other's servers for their own.
    """
    import psutil

    kws = [k.lower() for k in keywords if k]
    if not kws:
        return
    own_files = _own_files(state_dir)
    skip = set(exclude_pids)
    skip.update(own_lineage())
    now = time.time()
    for proc in psutil.process_iter(["pid", "cmdline", "status", "username", "create_time"]):
        info = proc.info
        if info["pid"] in skip or info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        argv = info.get("cmdline") or []
        if not argv:
            continue
        line = " ".join(argv)
        low = line.lower()
        if (
            any(k in low for k in kws)
            and not _is_gpuctl_client(argv)
            and not any(a.startswith(own_files) for a in argv)
            and (sim_dir is None or on_sim_dir(info["pid"], argv, sim_dir))
        ):
            created = info.get("create_time")
            age = round(max(0.0, now - created), 1) if created else None
            yield StartingProcess(
                pid=info["pid"],
                command=" ".join(redact_argv(argv)),
                user=info.get("username"),
                age_s=age,
            )


SIM_DIR_ENV = "GPUCTL_SIM_DIR"
# Set by the process launcher in a server it starts for a simulated host (with the
# host's GPUCTL_SIM_DIR beside it): that server is that host's alone.
SIM_HOST_ENV = "GPUCTL_SIM_HOST"


def on_sim_dir(pid: int, argv: list[str], sim_dir: str, proc_root: str = "/proc") -> bool:
    """Whether process ``pid`` may count as a server of the simulated host in ``sim_dir``:
    not when its command line names another folder (``--sim-dir DIR``), nor when it was
    launched for another simulated host (``GPUCTL_SIM_HOST`` in its environment, with
    another ``GPUCTL_SIM_DIR``). Any other process counts, as on a real host: a user's
    process that names the service's keyword may be it, loading."""
    want = os.path.normpath(sim_dir)
    for i, a in enumerate(argv):
        if a == "--sim-dir" and i + 1 < len(argv):
            return os.path.normpath(argv[i + 1]) == want
        if a.startswith("--sim-dir="):
            return os.path.normpath(a.partition("=")[2]) == want
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            env = dict(
                e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e
            )
    except OSError:
        return True
    if SIM_HOST_ENV not in env:
        return True
    return os.path.normpath(env.get(SIM_DIR_ENV, "")) == want


def _own_files(state_dir: str | None) -> tuple[str, ...]:
    """The prefixes of gpuctl's own files in ``state_dir`` (its records, locks, logs);
    empty (matches no argument) without one."""
    if not state_dir:
        return ()
    base = os.path.normpath(state_dir)
    return tuple(f"{base}/{sub}/" for sub in ("logs", "records", "locks"))


def describe_pids(pids: Iterable[int]) -> list[StartingProcess]:
    """The given pids that are alive (not zombies), as StartingProcess entries.

    For servers whose pid a record names: they are the service's whatever their
    command line says, so they are reported even without a keyword match.
    """
    import psutil

    out = []
    now = time.time()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                argv = p.cmdline()
                created = p.create_time()
                try:
                    user: str | None = p.username()
                except (KeyError, psutil.Error):
                    user = None
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out.append(
            StartingProcess(
                pid=pid,
                command=" ".join(redact_argv(argv)) or f"<pid {pid}>",
                user=user,
                age_s=round(max(0.0, now - created), 1),
            )
        )
    return out


def pids_with_env(name: str, value: str, proc_root: str = "/proc") -> dict[int, int]:
    """``{pid: ppid}`` of the live processes whose environment holds ``name=value``.

    Read from ``/proc/<pid>/environ`` (readable for our own processes, or as root).
    """
    entry = f"{name}={value}".encode()
    out: dict[int, int] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return out
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"{proc_root}/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if entry not in env.split(b"\0"):
            continue
        fields = _stat_fields(int(d))
        if fields is None or fields[0] in ("Z", "X", "x"):
            continue
        out[int(d)] = int(fields[1])
    return out


def descendants(roots: Iterable[int], proc_root: str = "/proc") -> dict[int, int]:
    """``{pid: root}`` for every live process below one of ``roots`` (children,
    grandchildren, ...), by one pass over ``/proc/<pid>/stat``; zombies left out.

    A vLLM server's engine and workers are its children: what they hold on the GPU is
    the server's. Empty when ``roots`` is.
    """
    wanted = set(roots)
    if not wanted:
        return {}
    parent: dict[int, int] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return {}
    for d in names:
        if not d.isdigit():
            continue
        try:
            stat = Path(f"{proc_root}/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) < 2 or fields[0] in ("Z", "X", "x"):
            continue
        parent[int(d)] = int(fields[1])
    out: dict[int, int] = {}
    for pid in parent:
        if pid in wanted:
            continue
        chain = [pid]
        up = parent.get(pid, 0)
        # Walk up until a root, a process already placed, or the top (pid 0 or 1).
        while up > 1 and up not in wanted and up not in out and len(chain) < 4096:
            chain.append(up)
            up = parent.get(up, 0)
        root = up if up in wanted else out.get(up)
        if root is not None:
            for c in chain:
                out[c] = root
    return out


def find_by_env(name: str, value: str) -> int | None:
    """The process that carries ``name=value`` in its environment and whose parent does
    not (the server, not a child it forked, nor a wrapper's child); None when none."""
    found = pids_with_env(name, value)
    roots = sorted(p for p, parent in found.items() if parent not in found)
    return roots[0] if roots else None
