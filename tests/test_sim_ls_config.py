"""`gpuctl sim ls` lists the folder of the config's simulated host (``probe = "sim"``,
its ``sim_dir``), the GPU `gpuctl status` reads for it; it listed the default folder
whatever the config said. --sim-dir and $GPUCTL_SIM_DIR still come first, and without a
simulated host the default is unchanged. The installed CLI, a real process holding
simulated GPU memory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import gpuctl_exe, gpuctl_in_process_env, tagged


def _env(tmp_path: Path, config: str) -> dict[str, str]:
    cfg = tmp_path / "conf" / "config.toml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(config)
    env = {**os.environ, "GPUCTL_CONFIG": str(cfg), "XDG_STATE_HOME": str(tmp_path / "xdg")}
    env.update(GPUCTL_STATE_DIR=str(tmp_path / "state"), COLUMNS="160", NO_COLOR="1")
    for name in ("GPUCTL_SIM_DIR", "GPUCTL_SIM_GPU_MEMORY", "GPUCTL_SIM_GPUS", "GPUCTL_DEBUG"):
        env.pop(name, None)
    return env


def _ls(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return gpuctl_in_process_env(env, "sim", "ls", *args)


def test_sim_ls_lists_the_configured_sim_hosts_folder(tmp_path: Path) -> None:
    # Relative to the config file, as every path in it.
    env = _env(tmp_path, '[hosts.box]\nprobe = "sim"\nsim_dir = "gpu"\n')
    gpu, other = tmp_path / "conf" / "gpu", tmp_path / "other"
    other.mkdir()
    name = tagged("held")
    hold = subprocess.Popen(
        [gpuctl_exe(), "sim", "hold", "--name", name, "--memory", "3GiB", "--sim-dir", str(gpu)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert hold.stdout is not None
        hold.stdout.readline()  # it holds the memory
        r = _ls(env)
        j = _ls(env, "--json")
        by_env = _ls({**env, "GPUCTL_SIM_DIR": str(other)}, "--json")
        by_option = _ls(env, "--sim-dir", str(other), "--json")
    finally:
        hold.terminate()
        hold.communicate()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"simulated GPU {gpu} (hosts.box.sim_dir): 3.0 GiB used of 128.0 GiB"
    assert any(name in ln and str(hold.pid) in ln for ln in lines[1:]), r.stdout
    obj = json.loads(j.stdout)
    assert (obj["sim_dir"], obj["sim_dir_from"]) == (str(gpu), "hosts.box.sim_dir")
    assert [(c["pid"], c["name"]) for c in obj["claims"]] == [(hold.pid, name)]
    for got, source in ((by_env, "$GPUCTL_SIM_DIR"), (by_option, "--sim-dir")):
        o = json.loads(got.stdout)
        assert (o["sim_dir"], o["sim_dir_from"], o["claims"]) == (str(other), source, []), o


def test_without_a_simulated_host_the_default_folder_is_listed(tmp_path: Path) -> None:
    env = _env(tmp_path, '[hosts.dgx]\nagent = "http://127.0.0.1:9"\n[hosts.gpu]\nprobe = "auto"\n')
    r = _ls(env, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    default = tmp_path / "xdg" / "gpuctl" / "sim"
    assert (obj["sim_dir"], obj["sim_dir_from"]) == (str(default), "default")
    text = _ls(env).stdout.splitlines()[0]
    assert text.startswith(f"simulated GPU {default}: "), text


def test_two_simulated_hosts_in_different_folders_ask_which(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        '[hosts.a]\nprobe = "sim"\nsim_dir = "one"\n[hosts.b]\nprobe = "sim"\nsim_dir = "two"\n',
    )
    r = _ls(env)
    assert r.returncode == 2, r.stdout + r.stderr
    conf = tmp_path / "conf"
    assert r.stderr.splitlines() == [
        "gpuctl: error: the config simulates its hosts in different folders: "
        f"a ({conf / 'one'}), b ({conf / 'two'})",
        "  hint: name the one to list: gpuctl sim ls --sim-dir DIR",
    ]
    assert _ls(env, "--sim-dir", str(conf / "one")).returncode == 0
