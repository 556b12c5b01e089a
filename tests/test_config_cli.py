"""`gpuctl config init|check|path` and bad numbers on every duration and size option."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpuctl.cli.app import create_app
from gpuctl.config import load_config
from gpuctl.sim.host import free_port
from tests.conftest import config_file, has_nvidia

runner = CliRunner()
app = create_app()

BAD = ["inf", "nan", "0", "1e400", "-5", "-1s", "Infinity", "soon"]


def _err(output: str, option: str) -> None:
    assert "Traceback" not in output
    assert output.startswith(f"gpuctl: error: {option}: "), output


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["agent", "--cache-ttl"], "--cache-ttl"),
        (["agent", "--gpu-memory"], "--gpu-memory"),
        (["status", "--interval"], "--interval"),
        (["ensure", "vllm", "--timeout"], "--timeout"),
        (["demo", "--load-time"], "--load-time"),
        (["sim", "hold", "--name", "x", "--memory"], "--memory"),
        (["sim", "hold", "--name", "x", "--memory", "1G", "--duration"], "--duration"),
        (["sim", "model-server", "--name", "x", "--memory"], "--memory"),
        (["sim", "ls", "--gpu-memory"], "--gpu-memory ($GPUCTL_SIM_GPU_MEMORY)"),
    ],
)
def test_bad_numbers_on_the_command_line(
    cli_env: Path, args: list[str], option: str, value: str
) -> None:
    r = runner.invoke(app, [*args, value])
    assert r.exit_code == 2, r.output
    _err(r.output, option)


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-5", "-0.1s"])
@pytest.mark.parametrize(
    "option",
    ["--load-time", "--token-delay", "--engine-dies-after"],
)
def test_sim_zero_is_a_value_but_not_the_rest(cli_env: Path, option: str, value: str) -> None:
    base = ["sim", "model-server", "--name", "x", "--memory", "1G", "--port", "1"]
    r = runner.invoke(app, [*base, option, value])
    assert r.exit_code == 2, r.output
    _err(r.output, option)


def test_status_interval_has_a_floor(cli_env: Path) -> None:
    r = runner.invoke(app, ["status", "--interval", "100ms"])
    assert r.exit_code == 2
    _err(r.output, "--interval")
    assert "at least 0.25s" in r.output


def test_good_durations_reach_the_command(cli_env: Path) -> None:
    """A parser that refused everything would pass the tests above: this one must run."""
    config_file(cli_env).write_text("")
    r = runner.invoke(app, ["ensure", "vllm", "--timeout", "1h30m"])
    assert r.exit_code == 2 and "unknown service 'vllm'" in r.output, r.output


def test_bad_number_in_the_config_is_a_located_error_on_every_command(cli_env: Path) -> None:
    config_file(cli_env).write_text(
        '[hosts.box]\nprobe = "sim"\n[services.w]\nmemory = inf\nhealth_timeout = nan\n'
    )
    for args in (["status"], ["ensure", "w", "--json"], ["locks"], ["config", "check"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        assert "Traceback" not in r.output and "internal error" not in r.output
        assert "services.w.memory: " in r.output, (args, r.output)


# --------------------------------------------------------------------------- config path


def test_one_reader_of_gpuctl_config(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = runner.invoke(app, ["config", "path"])
    assert r.stdout.strip() == str(config_file(cli_env))
    monkeypatch.setenv("GPUCTL_CONFIG", str(cli_env / "env.toml"))
    r = runner.invoke(app, ["config", "path"])
    assert r.stdout.strip() == str(cli_env / "env.toml")
    r = runner.invoke(app, ["config", "path", "--config", str(cli_env / "flag.toml")])
    assert r.stdout.strip() == str(cli_env / "flag.toml")
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 1 and "env.toml does not exist" in r.output


# --------------------------------------------------------------------------- config check


@pytest.mark.parametrize(
    ("host", "expect"),
    [
        ('token_env = "GPUCTL_TEST_UNSET_TOKEN"', "hosts.dgx.token_env: environment variable"),
        ('token_file = "missing.token"', "hosts.dgx.token_file: cannot read"),
        ('token_file = "folder.token"', "hosts.dgx.token_file: "),
        ('read_token_file = "empty.token"', "hosts.dgx.read_token_file: "),
        (
            'jupyter = "http://127.0.0.1:1"\njupyter_token_env = "GPUCTL_TEST_UNSET_J"',
            "jupyter_token_env",
        ),
    ],
)
def test_check_fails_when_a_token_it_needs_is_missing(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch, host: str, expect: str
) -> None:
    monkeypatch.delenv("GPUCTL_TEST_UNSET_TOKEN", raising=False)
    monkeypatch.delenv("GPUCTL_TEST_UNSET_J", raising=False)
    cfg = config_file(cli_env)
    (cfg.parent / "folder.token").mkdir()
    (cfg.parent / "empty.token").write_text("")
    port = free_port()
    cfg.write_text(f'[hosts.dgx]\nagent = "http://127.0.0.1:{port}"\n{host}\n')
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 1, r.output
    assert expect in r.output and "Traceback" not in r.output
    assert "ok (" not in r.output
    assert "\n  hint: " in r.stderr, r.stderr  # what to do, as status says it
    if "read_" not in host and "jupyter" not in host:  # status needs this token
        s = runner.invoke(app, ["status", "--json"])
        (h,) = json.loads(s.stdout)["hosts"]
        assert h["hint"] and f"  hint: {h['hint']}" in r.stderr


def test_check_passes_when_the_tokens_are_there(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config_file(cli_env)
    tok = cfg.parent / "dgx.token"
    tok.write_text("s3cret\n")
    tok.chmod(0o600)
    monkeypatch.setenv("GPUCTL_TEST_READ_TOKEN", "r")
    port = free_port()
    cfg.write_text(
        f'[hosts.dgx]\nagent = "http://127.0.0.1:{port}"\ntoken_file = "dgx.token"\n'
        'read_token_env = "GPUCTL_TEST_READ_TOKEN"\n'
    )
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 0, r.output
    assert "ok (1 host, 0 services)" in r.output


# --------------------------------------------------------------------------- config init


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.skipif(has_nvidia(), reason="this machine has an NVIDIA GPU")
def test_init_without_a_gpu_points_at_an_agent(cli_env: Path) -> None:
    cfg = cli_env / "fresh" / "gpuctl" / "config.toml"  # the folder does not exist yet
    port = free_port()  # nothing listens there: check passes before any agent is up
    old = os.umask(0)  # a careless umask must not make the token readable
    try:
        r = runner.invoke(
            app, ["config", "init", "--config", str(cfg), "--agent", f"http://127.0.0.1:{port}"]
        )
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(cfg)
    token = cfg.parent / "gpu.token"
    assert _mode(token) == 0o600 and _mode(cfg.parent) == 0o700
    assert len(token.read_text().strip()) >= 32
    conf = load_config(cfg)
    h = conf.host("gpu")
    assert h.agent == f"http://127.0.0.1:{port}"
    assert h.token_file == token and h.token() == token.read_text().strip()
    assert "#" in cfg.read_text()  # commented
    assert f"gpuctl agent --listen 0.0.0.0:{port} --token-file" in cfg.read_text()

    r = runner.invoke(app, ["config", "check", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "ok (1 host, 0 services)" in r.output


@pytest.mark.skipif(has_nvidia(), reason="this machine has an NVIDIA GPU")
def test_init_default_agent_url(cli_env: Path) -> None:
    r = runner.invoke(app, ["config", "init"])
    assert r.exit_code == 0, r.output
    conf = load_config()
    assert conf.host("gpu").agent == "http://127.0.0.1:9400"


def test_init_never_overwrites_without_force(cli_env: Path) -> None:
    cfg = config_file(cli_env)
    cfg.write_text("# mine\n")
    r = runner.invoke(app, ["config", "init", "--agent", "http://127.0.0.1:9"])
    assert r.exit_code == 2, r.output
    assert "exists" in r.output and "--force" in r.output
    assert cfg.read_text() == "# mine\n"
    assert not (cfg.parent / "gpu.token").exists()

    r = runner.invoke(app, ["config", "init", "--agent", "http://127.0.0.1:9"])
    assert cfg.read_text() == "# mine\n"

    token = cfg.parent / "gpu.token"
    token.write_text("kept-token\n")
    token.chmod(0o600)
    r = runner.invoke(app, ["config", "init", "--force", "--agent", "http://127.0.0.1:9"])
    assert r.exit_code == 0, r.output
    assert load_config().host("gpu").agent == "http://127.0.0.1:9"
    assert token.read_text() == "kept-token\n"  # a secret is never replaced


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--agent", "http://[::1"], "--agent: "),
        (["--agent", "127.0.0.1:9400"], "--agent: "),
        (["--agent", "http://h:1", "--host", "bad name"], "--host: "),
    ],
)
def test_init_refuses_bad_options(cli_env: Path, args: list[str], expect: str) -> None:
    r = runner.invoke(app, ["config", "init", *args])
    assert r.exit_code == 2, r.output
    _err(r.output, expect.rstrip(": "))
    assert not config_file(cli_env).exists()


def test_init_with_a_gpu_probes_it_directly(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose `nvidia-smi -L` answers is the GPU host itself (a stand-in binary here:
    this machine has none)."""
    bin_dir = cli_env / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "if sys.argv[1:] == ['-L']:\n"
        "    print('GPU 0: NVIDIA GB10 (UUID: GPU-00000000-0000-0000-0000-000000000000)')\n"
        "else:\n    sys.exit(9)\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = runner.invoke(app, ["config", "init", "--host", "spark"])
    assert r.exit_code == 0, r.output
    cfg = config_file(cli_env)
    conf = load_config()
    h = conf.host("spark")
    assert (h.agent, h.probe, h.token_file) == (None, "auto", None)
    assert not list(cfg.parent.glob("*.token"))
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", ["status", "agent"])
def test_probe_completion_offers_the_one_list(command: str) -> None:
    """`status --probe <TAB>` and `agent --probe <TAB>` offer the config's probe names."""
    import subprocess

    from gpuctl.config import PROBES
    from tests.conftest import gpuctl_exe

    r = subprocess.run(
        [gpuctl_exe()],
        env={
            **os.environ,
            "_GPUCTL_COMPLETE": "complete_bash",
            "COMP_WORDS": f"gpuctl {command} --probe ",
            "COMP_CWORD": "3",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert tuple(r.stdout.split()) == PROBES, r.stdout + r.stderr


# Options whose DURATION is not gpuctl's: Ollama's keep_alive takes 0 and negatives by design.
FOREIGN_DURATIONS = {("sim ollama", "--keep-alive")}


def _walk(cmd: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _walk(sub, f"{path} {name}".strip())


def test_every_duration_and_size_option_goes_through_the_shared_parsers() -> None:
    """A new --something DURATION that skipped the parsers would take inf, nan and 0 again."""
    import typer.main

    checked = 0
    for path, cmd in _walk(typer.main.get_command(create_app())):
        for param in getattr(cmd, "params", []):
            if param.metavar not in ("DURATION", "SIZE", "SECONDS"):
                continue
            opt = max(param.opts, key=len)
            if (path, opt) in FOREIGN_DURATIONS:
                continue
            func = getattr(param.type, "func", None)
            qual = getattr(func, "__qualname__", "")
            assert qual.startswith(("duration_parser.", "size_parser.")), (path, opt, qual)
            checked += 1
    assert checked >= 12, checked


def test_a_typo_without_hosts_is_reported_as_the_typo(cli_env: Path) -> None:
    """Issue 11: `[host.dgx]` once read as `services.vllm.host: missing`."""
    config_file(cli_env).write_text(
        '[host.dgx]\nagent = "http://127.0.0.1:9"\n\n[services.vllm]\nmemory = "80GiB"\n'
    )
    for args in (["config", "check"], ["status"], ["ensure", "vllm"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        assert r.output.startswith("gpuctl: error: host: unknown key\n"), r.output
        assert "hint: did you mean 'hosts'?" in r.output
        assert "services.vllm.host" not in r.output
