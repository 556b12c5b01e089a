"""Shell completion in the real shells: bash, zsh and fish load the files shipped in
``completions/`` (and the ones ``--install-completion`` writes) and complete a command, a
service and a host from the config, and an option's value.

Each test starts the shell on a pseudo-terminal and presses TAB (tests/shell_helpers.py).
The staleness of ``completions/`` is checked in tests/test_cli.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.cli.completion import FILE_NAMES, SHELLS, script
from tests.conftest import gpuctl_exe
from tests.shell_helpers import ShellPty

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = ROOT / "completions"

pytestmark = pytest.mark.e2e

# How each shell loads the shipped file the way it loads any completion: bash sources it
# (as bash-completion does), zsh finds `_gpuctl` on fpath through compinit (which reads
# only files whose first line is #compdef), fish looks in fish_complete_path.
INTERACTIVE = {
    "bash": ["bash", "--norc", "--noprofile", "-i"],
    "zsh": ["zsh", "-f", "-i"],
    "fish": ["fish", "--no-config", "-i"],
}
LOAD_SHIPPED = {
    "bash": f"source {COMPLETIONS}/gpuctl",
    "zsh": f"bindkey -e; fpath=({COMPLETIONS} $fpath); autoload -Uz compinit; compinit -u -D",
    "fish": f"set -p fish_complete_path {COMPLETIONS}",
}

CONFIG = """
[hosts.dgx]
agent = "http://127.0.0.1:9"
[hosts.box]
probe = "sim"
[services.vllm-chat]
host = "dgx"
[services.photos]
host = "box"
"""

# (typed, the line after TAB): a command, a service and a host from the config, and the
# values of an option in two commands (`status --probe` used to offer nothing).
CASES = [
    ("gpuctl sta", "gpuctl status"),
    ("gpuctl ensure vl", "gpuctl ensure vllm-chat"),
    ("gpuctl stop ph", "gpuctl stop photos"),
    ("gpuctl status --host dg", "gpuctl status --host dgx"),
    ("gpuctl status --probe nvi", "gpuctl status --probe nvidia-smi"),
    ("gpuctl status --probe s", "gpuctl status --probe sim"),
    ("gpuctl agent --probe nvi", "gpuctl agent --probe nvidia-smi"),
    ("gpuctl --install-completion z", "gpuctl --install-completion zsh"),
]


def need(shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (./scripts/test installs it when run as root)")


def shell_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    bindir = str(Path(gpuctl_exe()).parent)
    env = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "TERM": "xterm",
        "LANG": "C.UTF-8",
        "GPUCTL_CONFIG": str(config),
        # Completion must not try to reach anything; a state dir keeps it off the host's.
        "GPUCTL_STATE_DIR": str(tmp_path / "state"),
        "XDG_CONFIG_HOME": str(tmp_path / "home" / ".config"),
        "XDG_DATA_HOME": str(tmp_path / "home" / ".local" / "share"),
        **extra,
    }
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


@pytest.fixture
def session(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ShellPty]]:
    """An interactive shell that has loaded the shipped completion file."""
    shell: str = request.param
    need(shell)
    # An empty working directory: a completion that falls back to file names finds none.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    sh = ShellPty(INTERACTIVE[shell], shell_env(tmp_path), cwd)
    try:
        sh.run(LOAD_SHIPPED[shell], shell)
        yield shell, sh
    finally:
        sh.close()


@pytest.mark.parametrize("session", SHELLS, indirect=True)
def test_shipped_file_completes(session: tuple[str, ShellPty]) -> None:
    shell, sh = session
    for typed, want in CASES:
        assert sh.complete(typed, shell) == want, f"{shell}: {typed!r} + TAB"


@pytest.mark.parametrize("session", ["zsh", "fish"], indirect=True)
def test_descriptions_keep_apostrophes(session: tuple[str, ShellPty]) -> None:
    """zsh and fish list each command with its summary; `SERVICE's` lost its quote in zsh."""
    shell, sh = session
    sh.complete("gpuctl st", shell, tabs=2)
    assert "Stop SERVICE's server" in sh.last_output
    assert "SERVICEs" not in sh.last_output


def test_zsh_file_is_found_by_compinit() -> None:
    """compinit reads only the first line of each file on fpath: it must be #compdef."""
    first = (COMPLETIONS / "_gpuctl").read_text().splitlines()[0]
    assert first == "#compdef gpuctl"


@pytest.mark.parametrize("shell", SHELLS)
def test_sourced_script_completes(shell: str, tmp_path: Path) -> None:
    """`source <(gpuctl --show-completion SHELL)`-style loading, after the shell's own set-up."""
    need(shell)
    env = shell_env(tmp_path)
    path = tmp_path / f"gpuctl-completion.{shell}"
    r = subprocess.run(
        [gpuctl_exe(), "--show-completion", shell], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == script(shell) == (COMPLETIONS / FILE_NAMES[shell]).read_text()
    path.write_text(r.stdout)
    setup = {
        "bash": f"source {path}",
        "zsh": f"bindkey -e; autoload -Uz compinit; compinit -u -D; source {path}",
        "fish": f"source {path}",
    }[shell]
    sh = ShellPty(INTERACTIVE[shell], env, tmp_path)
    try:
        sh.run(setup, shell)
        assert sh.complete("gpuctl ensure vl", shell) == "gpuctl ensure vllm-chat"
        assert sh.complete("gpuctl ensure vl", shell) == "gpuctl ensure vllm-chat"
    finally:
        sh.close()


@pytest.mark.parametrize("shell", SHELLS)
def test_install_completion_for_the_shell_named(shell: str, tmp_path: Path) -> None:
    """`gpuctl --install-completion zsh` installs zsh's script (it used to install bash's and
    exit 0); a new shell with its usual start-up files then completes."""
    need(shell)
    env = shell_env(tmp_path)
    home = Path(env["HOME"])
    r = subprocess.run(
        [gpuctl_exe(), "--install-completion", shell], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    installed = {
        "bash": home / ".bash_completions" / "gpuctl.sh",
        "zsh": home / ".zfunc" / "_gpuctl",
        "fish": home / ".config" / "fish" / "completions" / "gpuctl.fish",
    }[shell]
    assert installed.read_text() == (COMPLETIONS / FILE_NAMES[shell]).read_text()
    assert str(installed) in r.stderr
    others = {"bash": ".bash_completions", "zsh": ".zfunc", "fish": ".config/fish"}
    for other, folder in others.items():
        if other != shell:
            assert not (home / folder).exists(), f"{other}'s script was installed too"
    # Again: the start-up line is not added twice.
    r2 = subprocess.run(
        [gpuctl_exe(), "--install-completion", shell], env=env, capture_output=True, text=True
    )
    assert r2.returncode == 0, r2.stderr
    rc = {"bash": home / ".bashrc", "zsh": home / ".zshrc", "fish": None}[shell]
    if rc is not None:
        assert rc.read_text().count("\n") == 1, rc.read_text()

    argv = {
        "bash": ["bash", "--noprofile", "-i"],  # reads ~/.bashrc
        "zsh": ["zsh", "-i"],  # reads ~/.zshrc (ZDOTDIR defaults to HOME)
        "fish": ["fish", "-i"],  # reads ~/.config/fish
    }[shell]
    # Debian's global zshrc must not run the new-user wizard or a second compinit.
    sh = ShellPty(argv, {**env, "ZDOTDIR": str(home)}, tmp_path)
    try:
        sh.run("bindkey -e" if shell == "zsh" else "true", shell)
        assert sh.complete("gpuctl ensure vl", shell) == "gpuctl ensure vllm-chat"
    finally:
        sh.close()


@pytest.mark.parametrize("args", [["--install-completion", "tcsh"], ["--install-completion"]])
def test_install_completion_refuses_without_a_known_shell(args: list[str], tmp_path: Path) -> None:
    env = shell_env(tmp_path)
    r = subprocess.run([gpuctl_exe(), *args], env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert "--install-completion" in r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(env["HOME"]) == [], "nothing may be installed"


@pytest.mark.parametrize("session", ["zsh", "fish"], indirect=True)
def test_no_files_after_the_service_only_where_a_path_goes(
    session: tuple[str, ShellPty], tmp_path: Path
) -> None:
    """A TAB after `gpuctl ensure vllm-chat` listed the working directory's files (Typer
    answers `_files` in zsh, and fish falls back to files, when it has nothing to offer).
    An option that takes a path still completes files."""
    shell, sh = session
    (tmp_path / "cwd" / "notes-file.txt").write_text("x\n")
    assert sh.complete("gpuctl ensure vllm-chat ", shell, tabs=2) == "gpuctl ensure vllm-chat"
    assert "notes-file" not in sh.last_output, sh.last_output
    assert sh.complete("gpuctl stop photos ", shell) == "gpuctl stop photos"
    assert sh.complete("gpuctl config check --config no", shell) == (
        "gpuctl config check --config notes-file.txt"
    )
