"""Shared fixtures: an isolated CLI environment and a simulated GPU host with its agent."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from gpuctl.sim.host import PORTS_ENV, SimHost

# jsonschema imports rfc3987_syntax where it is installed (jupyter-events asks for
# jsonschema[format-nongpl]), and that builds 38 lark grammars at import: about 1.2 s of
# CPU in every worker. It serves only the "iri" formats, which no schema here uses
# (test_schemas checks the formats); without it jsonschema leaves those unchecked.
sys.modules.setdefault("rfc3987_syntax", None)

_C = TypeVar("_C")


class Closing(Protocol):
    """The ``closing`` fixture: hands its argument back, to be closed at the test's end."""

    def __call__(self, client: _C) -> _C: ...


# Tests on one machine share its process table: a keyword or a service name that a stray
# process of another run (or another test) carries would count as that service. Every name
# a test matches against real processes carries this run's tag (or is unique_name()'s).
RUN_TAG = secrets.token_hex(3)


def tagged(word: str) -> str:
    """``word`` made this run's own: ``trainer`` -> ``trainer-1a2b3c``."""
    return f"{word}-{RUN_TAG}"


_HOMES: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest process (each xdist worker) gets config and state homes of its own: a
    test that sets none never reads the user's config, nor shares the default state or
    sim directory with a test on another worker."""
    # A shell without job control starts a background job with SIGINT ignored, and every
    # child inherits that: the Ctrl-C tests' gpuctl would never see their SIGINT. A Python
    # handler is reset to the default at exec, so each child starts as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    home = tempfile.mkdtemp(prefix="gpuctl-tests-")
    _HOMES.append(home)
    for var, sub in (("XDG_CONFIG_HOME", "config"), ("XDG_STATE_HOME", "state")):
        os.environ[var] = os.path.join(home, sub)
    # Each worker's servers listen in a block of ports of its own (``free_port``), below
    # the kernel's ephemeral range (32768 and up on Linux): 1,000 ports a worker from 20000.
    # Set, never inherited: the xdist controller's own value reaches every worker.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    os.environ[PORTS_ENV] = f"{first}-{first + 999}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: the ``heavy`` group (one worker runs all of it, one test at a time),
    then the ``slow`` tests, then those that start an agent, a server or the installed
    gpuctl, then the units, each in file order. xdist hands tests out in this order, so
    the short ones fill the workers' gaps at the end instead of one long test running
    alone after the others are done."""

    def rank(item: pytest.Item) -> int:
        group = item.get_closest_marker("xdist_group")
        if group is not None and group.args and group.args[0] == "heavy":
            return 0
        if item.get_closest_marker("slow") is not None:
            return 1
        if any(item.get_closest_marker(m) for m in _REAL_COMPONENTS) or _HOSTS & set(
            getattr(item, "fixturenames", ())
        ):
            return 2
        return 3

    items.sort(key=rank)


# What makes a test start real components: its markers, or a host fixture (an agent).
_REAL_COMPONENTS = ("e2e", "docker", "jupyter")
_HOSTS = frozenset({"host", "sim_host"})


# The groups whose daemons came after the suite's time budget (a browser, Slurm): each
# reports its own line, so the core's figure stays comparable from run to run.
_GROUPS = ("browser", "slurm")
_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each test's set-up, call and tear-down by group (in the xdist controller too:
    every worker's reports pass through it)."""
    group = next((g for g in _GROUPS if g in report.keywords), "core")
    _SECONDS[group] = _SECONDS.get(group, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _SECONDS:
        return
    parts = ", ".join(f"{g} {_SECONDS.get(g, 0.0):.0f} s" for g in ("core", *_GROUPS))
    terminalreporter.write_line(f"test time by group (summed over workers): {parts}")


def pytest_unconfigure(config: pytest.Config) -> None:
    for home in _HOMES:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config, state and sim dirs in tmp_path; no colour; fixed width."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("GPUCTL_CONFIG", raising=False)
    (tmp_path / "xdg-config" / "gpuctl").mkdir(parents=True)
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUCTL_SIM_DIR", str(tmp_path / "sim"))
    monkeypatch.delenv("GPUCTL_DEBUG", raising=False)
    monkeypatch.delenv("GPUCTL_AGENT_TOKEN", raising=False)
    return tmp_path


@pytest.fixture
def closing() -> Iterator[Closing]:
    """``client = closing(openai.OpenAI(...))``: closed when the test ends, pass or fail.
    An SDK client (openai, ollama) keeps a pool of connections; dropped unclosed, its
    sockets are collected, and reported as unclosed, during some later, unrelated test."""
    with contextlib.ExitStack() as stack:

        def keep(client: Any) -> Any:
            stack.callback(client.close)
            return client

        yield keep


@pytest.fixture
def sim_host(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimHost]:
    """A simulated GPU host (128 GiB) with ``gpuctl agent --probe sim`` running (with the
    test's ``@pytest.mark.failpoints``, if any)."""
    set_marked_failpoints(request, monkeypatch)
    with SimHost(root=tmp_path / "simhost") as host:
        host.start_agent()
        yield host


def set_marked_failpoints(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUCTL_FAILPOINTS`` from the test's ``@pytest.mark.failpoints(SPEC)``, for a host
    fixture to call before it starts its agent: the agent and every gpuctl the test runs
    inherit it (``ensure.backoff=seconds:60``: a back-off a loaded machine cannot run
    past between two calls). No marker: nothing changes."""
    from gpuctl import failpoints

    marker = request.node.get_closest_marker("failpoints")
    if marker is None:
        return
    monkeypatch.setenv(failpoints.ENV, str(marker.args[0]))
    failpoints.reset()
    request.addfinalizer(failpoints.reset)


def config_file(cli_env: Path) -> Path:
    """Where gpuctl looks for its config inside ``cli_env`` (the user config dir)."""
    return cli_env / "xdg-config" / "gpuctl" / "config.toml"


def gpuctl_exe() -> str:
    """The installed console script next to this interpreter (what a user runs)."""
    exe = Path(sys.executable).with_name("gpuctl")
    if exe.exists():
        return str(exe)
    found = shutil.which("gpuctl")
    assert found, "gpuctl is not installed next to the test interpreter"
    return found


def config_env(config: Path) -> dict[str, str]:
    """This process's environment with ``GPUCTL_CONFIG=config`` and no debug output: what a
    user's shell gives the gpuctl a test runs."""
    env = dict(os.environ)
    env["GPUCTL_CONFIG"] = str(config)
    env.pop("GPUCTL_DEBUG", None)
    return env


def gpuctl(
    config: Path, *args: str, timeout: float = 120, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gpuctl ARGS`` run as the installed console script with ``config``, its output
    captured; ``env`` adds to (or overrides) the environment. It never raises on a non-zero
    exit: the tests assert on the code."""
    return subprocess.run(
        [gpuctl_exe(), *args],
        env={**config_env(config), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def gpuctl_in_process(
    config: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gpuctl ARGS`` run in this process through Typer's ``CliRunner``, with the
    environment ``gpuctl()`` would give it: for tests that check only the output and the
    exit code, without the half second a spawned interpreter costs. A test of what the
    console script itself adds (its exit path, its stream set-up) runs ``gpuctl()``
    instead."""
    return gpuctl_in_process_env({**config_env(config), **(env or {})}, *args)


def gpuctl_in_process_env(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuctl_in_process`` with exactly ``env`` as its environment, as
    ``subprocess.run(..., env=env)`` would give it: every other variable of this
    process is unset for the run (and put back after). The API's per-process caches are
    reset around it."""
    from typer.testing import CliRunner

    from gpuctl import api
    from gpuctl.cli.app import create_app

    wanted: dict[str, str | None] = {name: None for name in os.environ}
    wanted.update(env)
    api._reset_for_tests()
    try:
        r = CliRunner().invoke(create_app(list(args)), list(args), env=wanted)
    finally:
        api._reset_for_tests()
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(
        [gpuctl_exe(), *args], r.exit_code, stdout=r.stdout, stderr=r.stderr
    )


# The commands whose process matters beyond its output: an ``ensure`` leaves its server
# running, a ``run`` owns its command, a ``resume`` starts a batch again.
SPAWNED = frozenset({"ensure", "run", "resume"})


def gpuctl_either(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuctl ARGS`` with exactly ``env``: spawned as the installed console script when
    the command is one of ``SPAWNED``, in this process (``gpuctl_in_process_env``)
    otherwise. For a helper that runs both kinds."""
    if args[0] not in SPAWNED:
        return gpuctl_in_process_env(env, *args)
    return subprocess.run(
        [gpuctl_exe(), *args], env=dict(env), capture_output=True, text=True, timeout=180,
        check=False,
    )  # fmt: skip


def has_nvidia() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")
