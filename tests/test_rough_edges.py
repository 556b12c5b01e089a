"""Rough edges a new user met at the terminal (issue 20): the config's checks, what a
command says with no config, where `config path` points."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import gpuctl_in_process

HOST = """
[hosts.gpu]
probe = "sim"
"""


def test_a_command_without_a_launcher_is_refused_naming_every_launcher(
    tmp_path: Path,
) -> None:
    """`config check` passed it, and `ensure` refused only later; the hint left out ollama."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(HOST + '[services.web]\ncommand = "vllm serve m"\nmemory = "20GiB"\n')
    r = gpuctl_in_process(cfg, "config", "check")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "services.web.command: set, but no launcher runs it" in r.stderr, r.stderr
    assert 'add launcher = one of "docker", "jupyter", "process", "ollama"' in r.stderr


def test_reclaim_with_no_config_says_so_and_exits_2_like_locks_and_run(tmp_path: Path) -> None:
    """`reclaim --dry-run` printed nothing and exited 0, where nothing was looked at."""
    # No --config, no GPUCTL_CONFIG, and nothing at the default path.
    env = {"GPUCTL_CONFIG": "", "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    missing = tmp_path / "xdg" / "gpuctl" / "config.toml"
    for argv in (
        ("reclaim", "--dry-run"),
        ("reclaim",),
        ("locks",),
        ("run", "--memory", "1GiB", "--", "true"),
    ):
        r = gpuctl_in_process(tmp_path / "unused.toml", *argv, env=env)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert f"no config file at {missing}, so no host" in r.stderr, (argv, r.stderr)
        assert "`gpuctl config init` writes one" in r.stderr, (argv, r.stderr)


def test_config_path_points_to_config_init(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    r = gpuctl_in_process(missing, "config", "path")
    assert r.returncode == 0 and r.stdout.strip() == str(missing), r.stdout
    assert "`gpuctl config init` writes a starter config there" in r.stderr, r.stderr
