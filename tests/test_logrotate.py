"""Launchers' logs rotate by size (copy, then truncate), keeping a few, even while the
server that writes them runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpuctl.adapters.launchers.logfile import open_log, rotate, rotate_all
from tests.ollama_helpers import wait_until


def test_rotate_keeps_a_few_and_empties_the_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    for round_ in range(5):
        log.write_bytes(f"round {round_}\n".encode() * 100)
        assert rotate(log, max_bytes=100, keep=3)
        assert log.stat().st_size == 0
    assert (tmp_path / "vllm.log.1").read_bytes().startswith(b"round 4")
    assert (tmp_path / "vllm.log.2").read_bytes().startswith(b"round 3")
    assert (tmp_path / "vllm.log.3").read_bytes().startswith(b"round 2")
    assert not (tmp_path / "vllm.log.4").exists()
    log.write_bytes(b"small\n")
    assert not rotate(log, max_bytes=100)
    assert log.read_bytes() == b"small\n"
    assert not rotate(tmp_path / "missing.log")


def test_a_running_writer_goes_on_at_the_start_of_the_emptied_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    fd = open_log(log, "server")  # what the process launcher hands the server
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import os, sys
            for line in sys.stdin:
                os.write(1, line.encode())
        """)],
        stdin=subprocess.PIPE, stdout=fd, text=True,
    )  # fmt: skip
    os.close(fd)
    try:
        assert writer.stdin is not None
        writer.stdin.write("x" * 5000 + "\n")
        writer.stdin.flush()
        wait_until("the first write", lambda: log.stat().st_size > 5000)
        assert rotate(log, max_bytes=1000)
        writer.stdin.write("after\n")
        writer.stdin.flush()
        wait_until("the next write", lambda: log.stat().st_size > 0)
        # No hole where the old content was: the writer appends at the new end.
        assert log.read_bytes() == b"after\n"
        assert (tmp_path / "server.log.1").stat().st_size == 5001
    finally:
        writer.stdin.close()  # type: ignore[union-attr]
        writer.wait(10)


def test_symbolic_links_are_neither_followed_nor_rotated(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"y" * 5000)
    link = tmp_path / "svc.log"
    link.symlink_to(target)
    assert not rotate(link, max_bytes=10)
    assert target.read_bytes() == b"y" * 5000
    log = tmp_path / "other.log"
    log.write_bytes(b"z" * 5000)
    (tmp_path / "other.log.1").symlink_to(target)
    # A link at the copy's name is unlinked (the name only) and the copy made afresh.
    assert rotate(log, max_bytes=10, keep=1)
    assert target.read_bytes() == b"y" * 5000
    assert not (tmp_path / "other.log.1").is_symlink()
    assert (tmp_path / "other.log.1").read_bytes() == b"z" * 5000


def test_rotate_all_rotates_the_big_logs_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_bytes(b"a" * 300)
    (tmp_path / "b.log").write_bytes(b"b" * 10)
    (tmp_path / "c.txt").write_bytes(b"c" * 300)
    assert rotate_all(tmp_path, max_bytes=100) == ["a.log"]
    assert rotate_all(tmp_path / "missing", max_bytes=100) == []
