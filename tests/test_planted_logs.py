"""Logs planted by a group member: a setuid log rotated by root yields no setuid copy, a
FIFO never wedges a start, a rotation or a tail, and a link at ``logs`` is never
followed. Each call that could block runs in a child with a time limit: before the fix
it hung for ever."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.adapters.launchers.logfile import rotate, rotate_all, tail_file
from gpuctl.adapters.launchers.process import ProcessLauncher
from gpuctl.config import ServiceConfig

REPO = Path(__file__).resolve().parents[1]
BAD_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH
GROUP, ATTACKER = 4242, 4243  # a shared group (gpuctl's) and a member of it who is not us


def _finishes(code: str, timeout: float = 20.0) -> str:
    """Run ``code`` in a child; it must finish in time (a blocked open fails the test)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"blocked for {timeout:g}s:\n{code}")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_setuid_log_rotates_to_a_copy_with_the_log_mode(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    log.write_bytes(b"x" * 5000)
    os.chmod(log, 0o6777)
    assert rotate(log, max_bytes=100)
    copy = (tmp_path / "svc.log.1").stat()
    assert stat.S_IMODE(copy.st_mode) == 0o600  # never the source's bits
    os.chmod(tmp_path, 0o2770)  # a folder shared through its group: the group reads
    log.write_bytes(b"x" * 5000)
    assert rotate(log, max_bytes=100)
    assert stat.S_IMODE((tmp_path / "svc.log.1").stat().st_mode) == 0o640


@pytest.fixture
def shared_logs() -> Iterator[Path]:
    """A state folder as installed (``install -d -m 2770 -g gpuctl``), reachable by
    another user (pytest's own folders are root's 0700)."""
    top = Path(tempfile.mkdtemp(prefix="gpuctl-logs-", dir="/tmp"))
    try:
        os.chmod(top, 0o711)
        state = top / "state"
        logs = state / "logs"
        logs.mkdir(parents=True)
        for d in (state, logs):
            os.chown(d, 0, GROUP)
            os.chmod(d, 0o2770)
        yield logs
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a root reclaim is the attack")
def test_a_root_reclaim_never_makes_a_setuid_copy_of_a_planted_log(
    shared_logs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group member plants a setuid copy of a program, big enough to rotate.
    plant = "cp /usr/bin/id evil.log && truncate -s 65M evil.log && chmod 06777 evil.log"
    subprocess.run(
        ["setpriv", f"--reuid={ATTACKER}", f"--regid={GROUP}", "--clear-groups",
         "sh", "-c", plant],
        cwd=shared_logs, check=True, timeout=30,
    )  # fmt: skip
    evil = shared_logs / "evil.log"
    assert evil.stat().st_mode & stat.S_ISUID and evil.stat().st_uid == ATTACKER
    # root's own log, setuid too, is rotated: its copy has the log mode.
    mine = shared_logs / "mine.log"
    mine.write_bytes(b"m" * (65 * 2**20))
    os.chmod(mine, 0o6777)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(shared_logs.parent))
    from gpuctl.wiring.reclaim import _rotate_logs  # what `gpuctl reclaim` runs

    rotated = _rotate_logs()
    for p in shared_logs.glob("*.log.*"):  # every copy: none setuid, setgid or open
        assert not p.lstat().st_mode & BAD_BITS, (p, oct(p.lstat().st_mode))
    assert rotated == ["mine.log"]
    copy = (shared_logs / "mine.log.1").stat()
    assert stat.S_IMODE(copy.st_mode) == 0o640 and copy.st_gid == GROUP
    # A neighbour's log is neither copied nor truncated by root (the owner rotates it).
    assert not (shared_logs / "evil.log.1").exists()
    assert evil.stat().st_size == 65 * 2**20


def test_a_fifo_at_the_log_is_refused_at_start_never_waited_on(tmp_path: Path) -> None:
    logs = tmp_path / "state" / "logs"
    logs.mkdir(parents=True)
    os.mkfifo(logs / "svc.log")
    out = _finishes(f"""
        from pathlib import Path
        from gpuctl.adapters.launchers.process import ProcessLauncher
        from gpuctl.config import ServiceConfig
        from gpuctl.errors import StartFailed
        svc = ServiceConfig(name="svc", host="h", command="true")
        try:
            ProcessLauncher(Path({str(logs)!r})).start(svc)
        except StartFailed as e:
            print(e.message, "|", e.hint)
        """)
    assert "svc.log of svc is not a regular file (it is a FIFO)" in out
    assert "remove" in out and "services.svc.log" in out
    assert stat.S_ISFIFO((logs / "svc.log").lstat().st_mode)  # left for its owner


def test_a_fifo_never_wedges_a_rotation_nor_a_tail(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "evil.log").write_bytes(b"e" * 5000)
    os.mkfifo(logs / "evil.log.1")
    os.mkfifo(logs / "pipe.log")
    os.mkfifo(logs / "svc.ollama-load.log")
    out = _finishes(f"""
        from pathlib import Path
        from gpuctl.adapters.launchers.base import Handle
        from gpuctl.adapters.launchers.logfile import rotate_all, tail_file
        from gpuctl.adapters.launchers.ollama import OllamaLauncher
        logs = Path({str(logs)!r})
        print(rotate_all(logs, max_bytes=100))
        print(repr(tail_file(logs / "pipe.log", 5)))
        lx = OllamaLauncher("http://127.0.0.1:9", "m", log_dir=logs)
        print(repr(lx.log_tail(Handle(kind="ollama", log=str(logs / "svc.ollama-load.log")))))
        """)
    assert out.splitlines() == ["['evil.log']", "''", "''"]
    assert (logs / "evil.log.1").read_bytes() == b"e" * 5000  # the FIFO's name, not the FIFO
    assert (logs / "evil.log").stat().st_size == 0


def test_a_link_at_logs_is_never_followed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "svc.log").write_bytes(b"o" * 5000)
    (state / "logs").symlink_to(outside)
    assert rotate_all(state / "logs", max_bytes=100) == []  # what reclaim runs
    assert not rotate(state / "logs" / "svc.log", max_bytes=100, root=state)
    (state / "logs").unlink(missing_ok=True)
    (state / "logs").symlink_to(outside)
    launcher = ProcessLauncher(state / "logs")  # the state folder is its parent
    svc = ServiceConfig(name="svc", host="h", command=f"{sys.executable} -c 'print(1)'")
    handle = launcher.start(svc)
    assert handle.pid is not None
    with contextlib.suppress(ChildProcessError):
        os.waitpid(handle.pid, 0)
    # Nothing made, rotated or written outside; the link was set aside, the log made in
    # a real folder.
    assert sorted(p.name for p in outside.iterdir()) == ["svc.log"]
    assert (outside / "svc.log").read_bytes() == b"o" * 5000
    logs = state / "logs"
    assert logs.is_dir() and not logs.is_symlink()
    assert b"gpuctl: starting svc" in (logs / "svc.log").read_bytes()
    assert any(p.name.startswith("logs.link-") for p in state.iterdir())
    assert tail_file(logs / "svc.log", 1) == "1"
