from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuctl.config import load_config, parse_config, token_file_warning
from gpuctl.errors import ConfigError, UsageError

GOOD = """
[defaults]
idle_timeout = "30m"
health_timeout = "10m"

[hosts.dgx]
agent = "http://100.64.0.10:9400"
token_env = "GPUCTL_DGX_TOKEN"
jupyter = "http://100.64.0.10:8888"
jupyter_token_env = "JUPYTER_TOKEN"
docker = "ssh://me@100.64.0.10"
gpu_memory = "128GiB"

[services.vllm]
host = "dgx"
launcher = "docker"
image = "vllm/vllm-openai:latest"
command = "vllm serve Qwen/Qwen3-32B --port 8000"
health = "http://100.64.0.10:8000/health"
match = ["vllm", "translategemma"]
memory = "80GiB"
priority = 100
idle_timeout = "30m"
health_timeout = "10m"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_design_example_loads(tmp_path: Path) -> None:
    conf = load_config(write(tmp_path, GOOD))
    dgx = conf.host("dgx")
    assert dgx.agent == "http://100.64.0.10:9400"
    assert dgx.gpu_memory_mib == 131072
    v = conf.service("vllm")
    assert v.memory_mib == 81920
    assert v.match == ("vllm", "translategemma")
    assert v.health_timeout_s == 600
    assert v.priority == 100
    assert conf.services_on("dgx") == [v]


def test_missing_default_file_is_empty(cli_env: Path) -> None:
    # cli_env points the user config dir at an empty folder and unsets GPUCTL_CONFIG.
    conf = load_config()
    assert conf.path == cli_env / "xdg-config" / "gpuctl" / "config.toml"
    assert not conf.path.exists()
    assert not conf.hosts and not conf.services


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_missing_file_named_by_env_is_an_error(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCTL_CONFIG", str(cli_env / "nope.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config()


@pytest.mark.parametrize(
    ("text", "location"),
    [
        ('[services.vllm]\nhost="dgx"\nmemory="lots"\n[hosts.dgx]\n', "services.vllm.memory"),
        ('[hosts.dgx]\nagent="ftp://x"\n', "hosts.dgx.agent"),
        ('[hosts.dgx]\ntimeout="soon"\n', "hosts.dgx.timeout"),
        ('[hosts.dgx]\n[services.a]\nhost="dgx"\npriority="high"\n', "services.a.priority"),
        ('[hosts.dgx]\n[services.a]\nhost="nope"\n', "services.a.host"),
        ("[hosts.dgx]\n[hosts.two]\n[services.a]\n", "services.a.host"),
        ('[hosts.dgx]\n[services.a]\nlauncher="k8s"\n', "services.a.launcher"),
        ('[hosts.dgx]\n[services.a]\nlauncher="docker"\n', "services.a.image"),
        ('[hosts.dgx]\n[services.a]\nlauncher="jupyter"\ncommand="x"\n', "services.a.launcher"),
        ('[hosts.dgx]\nagnet="http://x"\n', "hosts.dgx.agnet"),
        ('[hosts.dgx]\ntoken="s3cret"\n', "hosts.dgx.token"),
        ('[hosts.dgx]\ntoken_env="A"\ntoken_file="b"\n', "hosts.dgx"),
        ("[hosts.dgx]\n[services.a]\nmatch=[1,2]\n", "services.a.match"),
        ('[defaults]\nidle_timeout="forever"\n', "defaults.idle_timeout"),
        ("hosts = 3\n", "hosts"),
        ('[hosts."bad name"]\n', "hosts.bad name"),
        ('[hosts.dgx]\n[services.a]\nterminal="bad-name"\n', "services.a.terminal"),
        ("surprise = 1\n", "surprise"),
    ],
)
def test_errors_name_their_location(tmp_path: Path, text: str, location: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.message.startswith(location), e.value.message


def test_typo_suggests_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, '[hosts.dgx]\nagnet="http://x"\n'))
    assert "agent" in e.value.hint


def test_half_written_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML: Unterminated string"):
        load_config(write(tmp_path, GOOD[: GOOD.index("memory =") + 12]))


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(b"\xff\xfe[hosts]")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(p)


def test_single_host_is_the_default_host() -> None:
    conf = parse_config({"hosts": {"box": {}}, "services": {"w": {"memory": "15G"}}})
    assert conf.service("w").host == "box"
    assert conf.service("w").keywords == ("w",)


def test_unknown_names_suggest(tmp_path: Path) -> None:
    conf = load_config(write(tmp_path, GOOD))
    with pytest.raises(UsageError, match="unknown service 'vlm'") as e:
        conf.service("vlm")
    assert "vllm" in e.value.hint
    with pytest.raises(UsageError, match="unknown host"):
        conf.host("laptop")


def test_token_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = load_config(write(tmp_path, GOOD))
    monkeypatch.delenv("GPUCTL_DGX_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="GPUCTL_DGX_TOKEN is not set"):
        conf.host("dgx").token()
    monkeypatch.setenv("GPUCTL_DGX_TOKEN", " tok \n")
    assert conf.host("dgx").token() == "tok"


def test_token_file_relative_to_config_and_permissions(tmp_path: Path) -> None:
    tok = tmp_path / "dgx.token"
    tok.write_text("abc\n")
    os.chmod(tok, 0o644)
    conf = load_config(write(tmp_path, '[hosts.dgx]\nagent="http://h:1"\ntoken_file="dgx.token"\n'))
    assert conf.host("dgx").token() == "abc"
    warning = token_file_warning(tok)
    assert warning is not None and "chmod 600" in warning
    os.chmod(tok, 0o600)
    assert token_file_warning(tok) is None
    tok.unlink()
    with pytest.raises(ConfigError, match="token_file: cannot read"):
        conf.host("dgx").token()
