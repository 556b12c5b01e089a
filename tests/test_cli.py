"""The command line: help, completions, import cost, and bad input without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from gpuctl.cli.app import create_app
from gpuctl.sim.host import free_port
from tests.conftest import config_file, gpuctl_exe, has_nvidia, tagged

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
app = create_app()

HEAVY = ("docker", "websockets", "pynvml", "uvicorn", "starlette", "fastapi", "paramiko")


def test_help_lists_commands(cli_env: Path) -> None:
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("status", "agent", "config", "sim", "demo"):
        assert cmd in r.output


def test_version(cli_env: Path) -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("gpuctl ")


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["config", "check", "--help"]])
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpuctl", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line
    }
    assert imported, "importtime printed nothing"
    assert "typer" in imported  # the probe works
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_a_command_never_imports_trio_nor_the_httpx_cli(cli_env: Path) -> None:
    """httpx imports its own command-line client (click, rich.progress, pygments) and
    httpcore imports trio whenever they are installed, as they are here (mkdocs and
    selenium bring them): the console script keeps both off every command's start."""
    import importlib.util

    assert importlib.util.find_spec("trio") and importlib.util.find_spec("click")
    config_file(cli_env).write_text(
        f'[hosts.box]\nprobe = "sim"\nsim_dir = "{cli_env / "sim"}"\n'
        '[services.chat]\nhost = "box"\nhealth = "http://127.0.0.1:1/health"\n'
    )
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpuctl", "status", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode in (0, 3), r.stdout + r.stderr
    loaded = {
        line.split("|")[-1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "httpx._client" in loaded, "status --json imports httpx: the probe works"
    assert not {"click", "pygments", "trio._core", "rich.progress"} & loaded, loaded


@pytest.mark.parametrize(
    ("shell", "name"), [("bash", "gpuctl"), ("zsh", "_gpuctl"), ("fish", "gpuctl.fish")]
)
def test_completions_are_current(shell: str, name: str) -> None:
    r = subprocess.run(
        [gpuctl_exe()],
        env={**os.environ, "_GPUCTL_COMPLETE": f"source_{shell}"},
        capture_output=True,
        text=True,
        check=True,
    )
    committed = (ROOT / "completions" / name).read_text()
    assert r.stdout == committed, f"completions/{name} is stale: run scripts/gen-completions"


def test_completion_offers_configured_names(cli_env: Path) -> None:
    config_file(cli_env).write_text('[hosts.dgx]\n[hosts.box]\n[services.vllm]\nhost="dgx"\n')
    r = subprocess.run(
        [gpuctl_exe()],
        env={
            **os.environ,
            "_GPUCTL_COMPLETE": "complete_bash",
            "COMP_WORDS": "gpuctl status --host d",
            "COMP_CWORD": "3",
        },
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.split() == ["dgx"]


def test_bad_config_is_one_line(cli_env: Path) -> None:
    config_file(cli_env).write_text('[services.vllm]\nmemory = "lots\n')
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    assert r.output.startswith("gpuctl: error: ")
    assert "invalid TOML" in r.output


def test_bad_value_names_location(cli_env: Path) -> None:
    config_file(cli_env).write_text('[hosts.dgx]\n[services.vllm]\nmemory = "lots"\n')
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 1
    assert "services.vllm.memory" in r.output


def test_unknown_host_is_usage_error(cli_env: Path) -> None:
    config_file(cli_env).write_text('[hosts.dgx]\nagent = "http://127.0.0.1:1"\n')
    r = runner.invoke(app, ["status", "--host", "dgz"])
    assert r.exit_code == 2
    assert "unknown host 'dgz'" in r.output and "did you mean 'dgx'" in r.output


def test_locks_and_run_without_a_host_say_so(cli_env: Path) -> None:
    """`gpuctl locks` with no config printed nothing and exited 0, as if the records
    were empty; `gpuctl run` said the config had "several hosts"."""
    path = config_file(cli_env)
    for args in (["locks"], ["locks", "--json"], ["run", "--memory", "1GiB", "--", "true"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.splitlines()
        assert lines[0].startswith(f"gpuctl: error: no config file at {path}, so no host: "), lines
        assert (
            lines[1]
            == "  hint: `gpuctl config init` writes one (or point --config / GPUCTL_CONFIG at yours)"
        )
    path.write_text('[defaults]\nidle_timeout = "1h"\n')
    r = runner.invoke(app, ["locks"])
    assert r.exit_code == 2 and r.output.splitlines() == [
        f"gpuctl: error: {path} configures no host: gpuctl locks lists the records each configured host keeps",
        f"  hint: add a [hosts.NAME] table to {path}",
    ], r.output


def test_debug_shows_traceback(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file(cli_env).write_text("[hosts.dgx\n")
    monkeypatch.setenv("GPUCTL_DEBUG", "1")
    r = runner.invoke(app, ["status"])
    assert r.exit_code != 0
    assert r.exception is not None and type(r.exception).__name__ == "ConfigError"


@pytest.mark.skipif(has_nvidia(), reason="this machine has an NVIDIA GPU")
def test_status_without_config_or_gpu(cli_env: Path) -> None:
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 4
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines[0].startswith("gpuctl: no NVIDIA GPU found"), r.output
    assert "gpuctl demo" in r.output and "--probe sim" in r.output


def test_status_dead_agent_json(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("DGX_TOKEN", "t")
    config_file(cli_env).write_text(
        f'[hosts.dgx]\nagent = "http://127.0.0.1:{port}"\ntoken_env = "DGX_TOKEN"\n'
        f'[services.vllm]\nhealth = "http://127.0.0.1:{port}/health"\nmemory = "80GiB"\n'
    )
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 4
    obj = json.loads(r.stdout)
    assert obj["schema"] == 1 and obj["ok"] is False
    (host,) = obj["hosts"]
    assert host["ok"] is False and "refused" in host["error"]
    (svc,) = obj["services"]
    assert svc["decision"] == "UNKNOWN" and svc["name"] == "vllm" and svc["host"] == "dgx"


def test_status_missing_token_env(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_TOKEN", raising=False)
    config_file(cli_env).write_text(
        '[hosts.dgx]\nagent = "http://127.0.0.1:9"\ntoken_env = "NOPE_TOKEN"\n'
    )
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 4
    host = json.loads(r.stdout)["hosts"][0]
    assert "NOPE_TOKEN is not set" in host["error"]


def test_config_path_show_mask(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_file(cli_env)
    cfg.write_text(
        '[hosts.dgx]\nagent = "http://h:9400"\ntoken_env = "DGX_TOKEN"\n[services.vllm]\nmemory="80G"\n'
    )
    monkeypatch.setenv("DGX_TOKEN", "supersecret-value")
    r = runner.invoke(app, ["config", "path"])
    assert r.exit_code == 0 and r.stdout.strip() == str(cfg)
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code == 0 and "ok (1 host, 1 service)" in r.stdout
    for args in (["config", "show"], ["config", "show", "--json"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0
        assert "supersecret" not in r.output
        assert "$DGX_TOKEN" in r.output
    obj = json.loads(runner.invoke(app, ["config", "show", "--json"]).stdout)
    assert obj["services"]["vllm"]["memory"] == "80GiB"
    assert obj["services"]["vllm"]["host"] == "dgx"
    # The TOML view is the config's own vocabulary: it loads back as the same config.
    shown = runner.invoke(app, ["config", "show"]).stdout
    again = cli_env / "again.toml"
    again.write_text(shown)
    from gpuctl.config import load_config

    assert load_config(again).services == load_config(cfg).services


def test_config_show_writes_toml_that_check_reads_back(cli_env: Path) -> None:
    """A host named `gpu.box` (a dotted name: a quoted key in TOML) and strings TOML must
    escape come back from `config show` as the same config, which `config check` passes;
    by hand, `[hosts.gpu.box]` made a table `box` inside a host `gpu`."""
    cfg = config_file(cli_env)
    cfg.write_text(
        '[hosts."gpu.box"]\nagent = "http://127.0.0.1:9400"\n'
        '[services."chat-1"]\nhost = "gpu.box"\nmemory = "8GiB"\nlauncher = "process"\n'
        'command = "vllm serve \'m\' --chat-template \\"{{x}}\\"\ttab"\n'
    )
    assert runner.invoke(app, ["config", "check"]).exit_code == 0
    shown = runner.invoke(app, ["config", "show"]).stdout
    assert '[hosts."gpu.box"]' in shown, shown
    again = cli_env / "again.toml"
    again.write_text(shown)
    r = runner.invoke(app, ["config", "check", "--config", str(again)])
    assert r.exit_code == 0, r.output
    from gpuctl.config import load_config

    assert load_config(again).services == load_config(cfg).services
    assert load_config(again).hosts == load_config(cfg).hosts


def test_config_show_and_check_carry_yield_after(cli_env: Path) -> None:
    """``yield_after`` is shown under its key (a batch has none: it never yields) in both
    views, and the TOML view loads back as the same config; ``check`` names a bad one."""
    cfg = config_file(cli_env)
    cfg.write_text(
        '[defaults]\nyield_after = "15m"\n[hosts.dgx]\n'
        '[services.chat]\nmemory = "80GiB"\n'
        '[services.quiet]\nyield_after = "never"\n'
        '[services.batch]\nkind = "batch"\n'
    )
    obj = json.loads(runner.invoke(app, ["config", "show", "--json"]).stdout)
    assert obj["defaults"]["yield_after"] == "15m"
    got = {n: s.get("yield_after") for n, s in obj["services"].items()}
    assert got == {"chat": "15m", "quiet": "never", "batch": None}
    shown = runner.invoke(app, ["config", "show"]).stdout
    assert 'yield_after = "15m"' in shown
    again = cli_env / "again.toml"
    again.write_text(shown)
    from gpuctl.config import load_config

    assert load_config(again).services == load_config(cfg).services
    cfg.write_text('[hosts.dgx]\n[services.b]\nkind = "batch"\nyield_after = "5m"\n')
    r = runner.invoke(app, ["config", "check"])
    assert r.exit_code != 0 and "services.b.yield_after: a batch never yields" in r.output


def test_watch_and_json_exclude(cli_env: Path) -> None:
    r = runner.invoke(app, ["status", "--watch", "--json"])
    assert r.exit_code == 2


def test_help_summaries_fit_without_cuts(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    for args in (["--help"], ["sim", "--help"]):
        r = runner.invoke(create_app(), args)
        assert r.exit_code == 0
        commands = r.output.split("Commands:")[1]
        assert "..." not in commands, commands
        assert max(len(line) for line in commands.splitlines()) <= 80


@pytest.mark.parametrize("cmd", ["ensure", "stop", "touch"])
def test_usage_names_the_argument_plainly(cli_env: Path, cmd: str) -> None:
    r = runner.invoke(app, [cmd, "--help"])
    assert r.exit_code == 0
    assert f"Usage: gpuctl {cmd} [OPTIONS] SERVICE\n" in r.output


def test_run_usage_shows_the_double_dash_and_the_arguments(cli_env: Path) -> None:
    """It read `gpuctl run [OPTIONS] [CMD]`: no `--`, and CMD alone."""
    r = runner.invoke(app, ["run", "--help"])
    assert r.exit_code == 0 and "Usage: gpuctl run [OPTIONS] -- CMD...\n" in r.output, r.output
    r = runner.invoke(app, ["run", "--bogus"])
    assert r.exit_code == 2 and "Usage: gpuctl run [OPTIONS] -- CMD...\n" in r.output, r.output


def test_config_before_the_command(cli_env: Path) -> None:
    """`gpuctl --config F status` failed with "No such option: --config"."""
    f = cli_env / "elsewhere.toml"
    f.write_text('[hosts.box]\nprobe = "sim"\n')
    r = runner.invoke(app, ["--config", str(f), "config", "path"])
    assert r.exit_code == 0 and r.stdout == f"{f}\n", r.output
    r = runner.invoke(app, ["-c", str(f), "config", "check"])
    assert r.exit_code == 0 and r.stdout.startswith(f"{f}: ok (1 host"), r.output
    r = runner.invoke(app, ["--config", str(f), "status", "--json"])
    assert r.exit_code == 0 and [h["name"] for h in json.loads(r.stdout)["hosts"]] == ["box"]
    # The command's own --config wins; the next command line starts afresh.
    r = runner.invoke(app, ["--config", str(cli_env / "nope.toml"), "config", "path", "-c", str(f)])
    assert r.stdout == f"{f}\n", r.output
    r = runner.invoke(app, ["--config", str(cli_env / "nope.toml"), "locks"])
    assert r.exit_code == 1 and "config file" in r.output and "nope.toml does not exist" in r.output
    r = runner.invoke(app, ["config", "path"])
    assert r.stdout == f"{config_file(cli_env)}\n", r.output


def test_only_a_chosen_command_is_built() -> None:
    from gpuctl.cli.app import _command_modules

    assert _command_modules(["status", "--json"]) == ["status_cmd"]
    assert _command_modules(["ensure", "vllm", "-c", "x.toml"]) == ["service_cmd"]
    assert _command_modules(["--config", "status", "locks"]) == ["service_cmd"]
    assert _command_modules(["-c", "x.toml", "status"]) == ["status_cmd"]
    every = _command_modules([])
    assert every == _command_modules(["--help"]) == _command_modules(["nosuch"])
    assert {"status_cmd", "service_cmd", "agent_cmd", "sim_cmd", "demo_cmd", "config_cmd"} <= set(
        every
    )


def _sim_status(
    cli_env: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``gpuctl status --probe sim`` on a simulated GPU holding 20 GiB for user-owned work."""
    sim = cli_env / "sim"
    hold = subprocess.Popen(
        [
            gpuctl_exe(),
            "sim",
            "hold",
            "--name",
            "comfyui",
            "--memory",
            "20GiB",
            "--sim-dir",
            str(sim),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hold.stdout is not None
        hold.stdout.readline()  # it says so once it holds the memory
        return subprocess.run(
            [gpuctl_exe(), "status", "--probe", "sim", "--sim-dir", str(sim), *args],
            capture_output=True,
            env={**os.environ, **(env or {})},
            check=False,
            timeout=60,
        )
    finally:
        hold.terminate()
        hold.communicate()


def test_status_falls_back_to_ascii(cli_env: Path) -> None:
    r = _sim_status(cli_env, env={"PYTHONIOENCODING": "ascii", "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode("ascii")  # every byte ASCII
    assert "GPU memory #####...." in text and "20.0 GiB / 128.0 GiB" in text
    assert "Error" not in r.stderr.decode()


def test_status_user_filter(cli_env: Path) -> None:
    me = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    shown = json.loads(_sim_status(cli_env, "--json", "--user", me).stdout)
    assert [p["user"] for p in shown["hosts"][0]["processes"]] == [me]
    hidden = json.loads(_sim_status(cli_env, "--json", "--user", "nobody-else").stdout)
    assert hidden["hosts"][0]["processes"] == []
    assert hidden["hosts"][0]["memory_used_mib"] == 20 * 1024  # a filter never hides memory


def test_status_only_unknown_service_is_usage_error(cli_env: Path) -> None:
    config_file(cli_env).write_text(
        '[hosts.dgx]\nagent = "http://127.0.0.1:9"\n[services.vllm]\nmatch = ["vllm"]\n'
    )
    r = runner.invoke(app, ["status", "--only", "vlm"])
    assert r.exit_code == 2, r.output
    assert "unknown service 'vlm'" in r.output and "vllm" in r.output


def test_status_shows_each_simulated_gpu(cli_env: Path) -> None:
    env = {"GPUCTL_SIM_GPUS": "80GiB,80GiB", "COLUMNS": "100", "NO_COLOR": "1"}
    sim = cli_env / "sim"
    hold = subprocess.Popen(
        [
            gpuctl_exe(),
            "sim",
            "hold",
            "--name",
            tagged("comfyui"),
            "--memory",
            "30GiB",
            "--gpu",
            "1",
        ],
        env={**os.environ, **env, "GPUCTL_SIM_DIR": str(sim)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hold.stdout is not None
        hold.stdout.readline()
        r = subprocess.run(
            [gpuctl_exe(), "status", "--probe", "sim", "--sim-dir", str(sim)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            check=False,
            timeout=60,
        )
    finally:
        hold.terminate()
        hold.communicate()
    assert r.returncode == 0, r.stderr
    assert "GPU 0 memory" in r.stdout and "GPU 1 memory" in r.stdout
    gpu1 = next(line for line in r.stdout.splitlines() if "GPU 1 memory" in line)
    assert "30.0 GiB / 80.0 GiB" in gpu1
    row = next(line for line in r.stdout.splitlines() if str(hold.pid) in line)
    assert "30.0 GiB" in row and " 1 " in row


@pytest.mark.parametrize(
    ("cmd", "choices"),
    [
        (["status"], "--probe <auto|nvml|nvidia-smi|sim>"),
        (["agent"], "--probe <auto|nvml|nvidia-smi|sim>"),
        (["agent"], "--log-level <debug|info|warning|error>"),
    ],
)
def test_option_values_show_their_choices(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch, cmd: list[str], choices: str
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    r = runner.invoke(create_app(), [*cmd, "--help"])
    assert r.exit_code == 0 and choices in r.output


def test_watch_on_a_terminal_names_its_interval_and_quits_on_ctrl_c(cli_env: Path) -> None:
    import pty
    import select
    import signal
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [gpuctl_exe(), "status", "--watch", "--interval", "300ms", "--probe", "sim"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "COLUMNS": "100", "TERM": "xterm"},
        start_new_session=True,
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and out.count("▁".encode()) < 3:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=20)
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = out.decode(errors="replace")
    assert "every 300ms" in text and "Ctrl-C to quit" in text, text[-2000:]
    assert "used" in text and "▁" in text  # the sparkline of an idle GPU
    assert code == 0
    assert "Traceback" not in text


def test_every_command_module_is_in_the_lazy_table() -> None:
    """A new ``cli/*_cmd.py`` must be named in ``COMMANDS``, or it would never register."""
    from gpuctl.cli.app import COMMANDS

    modules = {p.stem for p in (ROOT / "gpuctl" / "cli").glob("*_cmd.py")}
    assert modules == set(COMMANDS.values())
    r = runner.invoke(create_app(), ["--help"])
    for name in COMMANDS:
        assert f"\n  {name} " in r.output, name


def test_a_listen_address_without_its_port_names_the_commands_own_port(cli_env: Path) -> None:
    """`gpuctl proxy --listen localhost` showed the agent's 127.0.0.1:9400 as the example."""
    for cmd, port in (("proxy", 9401), ("agent", 9400)):
        r = runner.invoke(app, [cmd, "--listen", "localhost"])
        assert r.exit_code == 2, r.output
        assert r.stderr.splitlines() == [
            f"gpuctl: error: bad --listen 'localhost': expected HOST:PORT, like "
            f"127.0.0.1:{port} or [::1]:{port}",
            f"  hint: did you mean localhost:{port}?",
        ], r.stderr


def test_status_with_a_sim_dir_that_is_not_there(cli_env: Path) -> None:
    """A --sim-dir named on the command line that does not exist is a typo, not an idle
    GPU: exit 4 with a hint, no panel. The default folder ($GPUCTL_SIM_DIR, not created
    yet) is still an empty simulated GPU."""
    missing = cli_env / "nope" / "x"
    r = runner.invoke(app, ["status", "--probe", "sim", "--sim-dir", str(missing), "--json"])
    assert r.exit_code == 4
    assert r.stdout == ""
    assert f"gpuctl: error: --sim-dir {missing}: no such directory" in r.stderr
    assert "hint: check the path" in r.stderr
    assert not (cli_env / "sim").exists()
    r = runner.invoke(app, ["status", "--probe", "sim", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True


def test_proxy_on_a_taken_port_names_the_proxy(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    monkeypatch.setenv("DGX_TOKEN", "t")
    config_file(cli_env).write_text(
        '[hosts.dgx]\nagent = "http://127.0.0.1:9"\ntoken_env = "DGX_TOKEN"\n'
        '[services.vllm]\nhealth = "http://127.0.0.1:9/health"\nmemory = "80GiB"\n'
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = runner.invoke(app, ["proxy", "--listen", f"127.0.0.1:{port}"])
    assert r.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in r.stderr
    assert "another `gpuctl proxy`?" in r.stderr and "gpuctl agent" not in r.stderr


def test_touch_on_a_stopped_service_says_it_is_not_running(cli_env: Path) -> None:
    config_file(cli_env).write_text(
        '[hosts.local]\nprobe = "sim"\n'
        f'[services.vllm]\nhost = "local"\nhealth = "http://127.0.0.1:{free_port()}/health"\n'
        'memory = "80GiB"\n'
    )
    r = runner.invoke(app, ["touch", "vllm"])
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == (
        "vllm: marked as used (it is not running: stopped; `gpuctl ensure vllm` starts it)"
    )


def test_sim_ls_warns_once_when_its_total_differs_from_the_sim_dirs(cli_env: Path) -> None:
    sim = cli_env / "sim"
    args = ["--name", tagged("held"), "--memory", "1GiB", "--gpu-memory", "128GiB"]
    hold = subprocess.Popen(
        [gpuctl_exe(), "sim", "hold", *args, "--sim-dir", str(sim)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hold.stdout is not None
        hold.stdout.readline()  # it holds the memory, gpu.json is written
        r = runner.invoke(app, ["sim", "ls", "--sim-dir", str(sim), "--gpu-memory", "64GiB"])
        same = runner.invoke(app, ["sim", "ls", "--sim-dir", str(sim), "--gpu-memory", "128GiB"])
    finally:
        hold.terminate()
        hold.communicate()
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 1 and "128.0 GiB" in warnings[0] and "64.0 GiB" in warnings[0]
    assert "of 128.0 GiB" in r.stdout  # gpu.json is what is read
    assert same.exit_code == 0 and "warning" not in same.stderr
    help_text = runner.invoke(app, ["sim", "ls", "--help"]).stdout
    assert "saved in" not in " ".join(help_text.split())


def test_config_show_masks_env_secrets_command_keys_and_url_tokens(cli_env: Path) -> None:
    """Issue 17: ``config show`` printed these three secrets whole (each failed before).
    An attack review then found a URL's password in an ``env`` value under a plain name,
    a key in another such value and a value glued to an option in ``command`` (the last
    three: each failed before they were masked)."""
    config_file(cli_env).write_text(
        "[hosts.dgx]\n"
        "[services.vllm]\n"
        'launcher = "process"\n'
        'command = "vllm serve m --api-key sk-cmd-secret1 --port 8000 -HX-Auth-Token:hdr-secret6"\n'
        'health = "http://127.0.0.1:8000/health?token=url-secret2"\n'
        'env = { HF_TOKEN = "hf_env_secret3", CUDA_HOME = "/usr/local/cuda",'
        ' DB_URL = "postgres://u:db-secret4@h/db", EXTRA_ARGS = "--api-key sk-secret5" }\n'
    )
    for args in (["config", "show"], ["config", "show", "--json"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert "postgres://u:***@h/db" in r.output, r.output
        for secret in (
            "sk-cmd-secret1",
            "url-secret2",
            "hf_env_secret3",
            "db-secret4",
            "sk-secret5",
            "hdr-secret6",
        ):
            assert secret not in r.output, (args, r.output)
        assert "--api-key ***" in r.output and "token=***" in r.output
        assert "/usr/local/cuda" in r.output


def test_stop_json_prints_its_object_when_the_agent_is_down(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 4 with stop's JSON object on stdout, as every other command prints its own;
    the error line stays on stderr."""
    monkeypatch.setenv("DGX_TOKEN", "t")
    config_file(cli_env).write_text(
        '[hosts.dgx]\nagent = "http://127.0.0.1:9"\ntoken_env = "DGX_TOKEN"\n'
        '[services.vllm]\nhealth = "http://127.0.0.1:9/health"\nmemory = "80GiB"\n'
    )
    r = runner.invoke(app, ["stop", "vllm", "--json"])
    assert r.exit_code == 4, r.output
    out = json.loads(r.stdout)
    schema = json.loads((ROOT / "schemas" / "stop.schema.json").read_text())
    jsonschema.validate(out, schema)
    assert out["exit_code"] == 4 and out["stopped"] == [] and out["host"] == "dgx"
    assert "connection refused" in out["reason"] and "gpuctl agent" in out["reason"]
    assert r.stderr.startswith("gpuctl: error: connection refused")


def test_resume_says_what_it_does_on_a_service_never_preempted() -> None:
    r = runner.invoke(create_app(), ["resume", "--help"], terminal_width=200)
    text = " ".join(r.output.split())
    assert "not preempted, resume is `ensure` that never preempts" in text, text


@pytest.mark.parametrize("how", ["console-script", "python -m"])
def test_ctrl_c_while_gpuctl_loads_is_one_line_and_130(cli_env: Path, how: str) -> None:
    """Ctrl-C in the first tenth of a second, while the modules load (held there by the
    `cli.loading` failpoint): exit 130 and `gpuctl: interrupted`, never a traceback from
    whichever import it landed in."""
    import signal

    argv = [gpuctl_exe()] if how == "console-script" else [sys.executable, "-m", "gpuctl"]
    env = {**os.environ, "GPUCTL_FAILPOINTS": "cli.loading=pause"}
    proc = subprocess.Popen(
        [*argv, "status"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("gpuctl failpoint cli.loading: pause")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip() == "gpuctl: interrupted" and out == "", err
