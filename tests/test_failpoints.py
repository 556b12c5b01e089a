"""Failpoints: off unless the environment names them; each action does what it says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CODE = "from gpuctl import failpoints; failpoints.hit('here'); print('passed')"


def run(env_value: str | None, tmp_path: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUCTL_FAILPOINTS"}
    if env_value is not None:
        env["GPUCTL_FAILPOINTS"] = env_value
    env["GPUCTL_FAILPOINTS_DIR"] = str(tmp_path)
    return subprocess.Popen(
        [sys.executable, "-c", CODE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("value", [None, "", "elsewhere=kill", "here=", "junk"])
def test_off_unless_named(value: str | None, tmp_path: Path) -> None:
    out, _ = run(value, tmp_path).communicate(timeout=30)
    assert out.strip() == "passed"


def test_kill(tmp_path: Path) -> None:
    p = run("other=pause;here=kill", tmp_path)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert out == ""


def test_interrupt(tmp_path: Path) -> None:
    p = run("here=interrupt", tmp_path)
    _, err = p.communicate(timeout=30)
    assert p.returncode != 0
    assert "KeyboardInterrupt" in err


def test_pause_until_signalled(tmp_path: Path) -> None:
    p = run("here=pause", tmp_path)
    assert p.stderr is not None
    line = p.stderr.readline()
    assert line == f"gpuctl failpoint here: pause (pid {p.pid})\n"
    assert (tmp_path / f"here.{p.pid}").exists()
    assert p.poll() is None
    p.send_signal(signal.SIGINT)  # as Ctrl-C
    out, err = p.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert out == ""


def test_sleep(tmp_path: Path) -> None:
    out, _ = run("here=sleep:0.01", tmp_path).communicate(timeout=30)
    assert out.strip() == "passed"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 15.0),
        ("run_queue.ttl=kill", 15.0),  # not a duration: the default stays
        ("elsewhere=seconds:1", 15.0),
        ("here=pause;run_queue.ttl=seconds:6", 6.0),
    ],
)
def test_seconds_shortens_only_the_named_duration(
    value: str | None, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuctl import failpoints

    if value is None:
        monkeypatch.delenv("GPUCTL_FAILPOINTS", raising=False)
    else:
        monkeypatch.setenv("GPUCTL_FAILPOINTS", value)
    failpoints.reset()
    try:
        assert failpoints.seconds("run_queue.ttl", 15.0) == expected
    finally:
        monkeypatch.undo()
        failpoints.reset()
