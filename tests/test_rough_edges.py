"""Rough edges a new user met at the terminal (issue 20): the config's checks, what a
command says with no config, where `config path` points."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import gpuctl, gpuctl_in_process

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


def test_a_failed_start_names_its_log_in_the_hint(tmp_path: Path) -> None:
    """The FAILED hint said "see its log" without saying where it is."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        HOST + "[services.web]\n"
        'launcher = "process"\n'
        "command = \"sh -c 'echo dying; exit 3'\"\n"
        'health = "http://127.0.0.1:1/health"\nmemory = "1GiB"\n'
    )
    env = {"GPUCTL_STATE_DIR": str(tmp_path / "s"), "GPUCTL_SIM_DIR": str(tmp_path / "sim")}
    r = gpuctl(cfg, "ensure", "web", "--timeout", "30s", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    log = tmp_path / "s" / "logs" / "web.log"
    assert f"hint: see its log ({log}) and `gpuctl locks`" in r.stderr, r.stderr
    assert "dying" in log.read_text()


def test_the_locks_header_is_one_line_at_120_columns(tmp_path: Path) -> None:
    """At 120 columns `LAST USED`, `IDLE FOR` and `LEASE EXPIRES` split over two lines,
    read as two rows; at 80 they still must, to fit."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        HOST + '[services.web]\nlauncher = "process"\ncommand = "sh -c \'exit 3\'"\n'
        'health = "http://127.0.0.1:1/health"\nmemory = "1GiB"\n'
    )
    env = {"GPUCTL_STATE_DIR": str(tmp_path / "s"), "GPUCTL_SIM_DIR": str(tmp_path / "sim")}
    assert gpuctl(cfg, "ensure", "web", "--timeout", "30s", env=env).returncode == 1
    wide = gpuctl_in_process(cfg, "locks", env={**env, "COLUMNS": "120"})
    head = wide.stdout.splitlines()[0].split()
    assert head[:5] == ["HOST", "SERVICE", "PHASE", "HOLDER", "SINCE"], wide.stdout
    assert " ".join(head[5:]) == "LAST USED IDLE FOR LEASE EXPIRES STARTS", wide.stdout
    narrow = gpuctl_in_process(cfg, "locks", env={**env, "COLUMNS": "80"})
    assert all(len(ln) <= 80 for ln in narrow.stdout.splitlines()), narrow.stdout


def test_the_ensure_status_line_is_cut_with_an_ellipsis_never_wrapped() -> None:
    """At 120 columns the line wrapped, cutting the newest log line mid-word, no "…"."""
    import io

    from rich.console import Console
    from rich.spinner import Spinner

    from gpuctl.flows.results import Progress
    from gpuctl.render.progress_line import status_line

    log = "INFO 05-12 10:00:01 loader.py:42 Loading safetensors checkpoint shards: " + (
        "shard model-00003-of-00017.safetensors done; " * 4
    )
    tick = Progress("loading (launched)", 42.0, 30720, log, "", expected_s=120.0)
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False)
    console.print(Spinner("dots", text=status_line("vllm", tick, console.width - 2)))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert len(lines[0]) <= 120 and lines[0].endswith("…"), lines
    assert "vllm: loading (launched)" in lines[0] and "GPU 30.0 GiB" in lines[0], lines
