from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------- numbers (issue 7)

BAD_NUMBERS = ["inf", "nan", "0", "1e400", "-5", "-1s", "0s", "0GiB", "1e9999d"]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("defaults", "idle_timeout"),
        ("defaults", "yield_after"),
        ("defaults", "health_timeout"),
        ("defaults", "agent_timeout"),
        ("hosts.dgx", "timeout"),
        ("hosts.dgx", "gpu_memory"),
        ("services.a", "memory"),
        ("services.a", "health_timeout"),
        ("services.a", "idle_timeout"),
        ("services.a", "yield_after"),
        ("services.a", "stop_timeout"),
        ("services.a", "shm_size"),
    ],
)
def test_bad_numbers_as_strings_are_located_errors(table: str, key: str, value: str) -> None:
    data: dict[str, Any] = {"hosts": {"dgx": {}}, "services": {"a": {}}}
    where = data
    for part in table.split("."):
        where = where.setdefault(part, {})
    where[key] = value
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.message.startswith(f"{table}.{key}: "), e.value.message


@pytest.mark.parametrize(
    ("line", "location"),
    [
        ("memory = inf", "services.a.memory"),
        ("memory = nan", "services.a.memory"),
        ("memory = -inf", "services.a.memory"),
        ("memory = 1e400", "services.a.memory"),
        ("memory = 0", "services.a.memory"),
        ("memory = -3", "services.a.memory"),
        ("memory = 99999999999999999999", "services.a.memory"),
        ("health_timeout = nan", "services.a.health_timeout"),
        ("health_timeout = inf", "services.a.health_timeout"),
        ("health_timeout = 0", "services.a.health_timeout"),
        ("health_timeout = 0.0", "services.a.health_timeout"),
        ("health_timeout = -1", "services.a.health_timeout"),
        ("idle_timeout = 1e300", "services.a.idle_timeout"),
        ("stop_timeout = -0.5", "services.a.stop_timeout"),
        ("priority = 9223372036854775807", "services.a.priority"),
        ("devices = [-1]", "services.a.devices"),
    ],
)
def test_bad_toml_numbers_are_located_errors(tmp_path: Path, line: str, location: str) -> None:
    text = f'[hosts.dgx]\ntimeout = "2s"\n[services.a]\n{line}\n'
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.message.startswith(location + ": "), e.value.message


def test_host_timeout_zero_is_refused_not_unknown(tmp_path: Path) -> None:
    """`timeout = 0` once made every status UNKNOWN with a VPN hint; now it is the config's fault."""
    with pytest.raises(ConfigError, match=r"^hosts\.dgx\.timeout: a duration must be more than 0"):
        load_config(write(tmp_path, '[hosts.dgx]\nagent = "http://127.0.0.1:9"\ntimeout = 0\n'))


# --------------------------------------------------------------------------- URLs and names


@pytest.mark.parametrize(
    ("line", "location"),
    [
        ('agent = "http://[::1"', "hosts.dgx.agent"),  # urlsplit raises ValueError
        ('agent = "http://h:99999"', "hosts.dgx.agent"),  # .port raises ValueError
        ('agent = "http://h:port"', "hosts.dgx.agent"),
        ('agent = "http://h:0"', "hosts.dgx.agent"),
        ('agent = "http:///no-host"', "hosts.dgx.agent"),
        ('agent = "http://h x:1"', "hosts.dgx.agent"),
        ('agent = "http://h\\n:1/"', "hosts.dgx.agent"),
        ('jupyter = "localhost:8888"', "hosts.dgx.jupyter"),
        ('docker = "unix://"', "hosts.dgx.docker"),
        ('docker = "tcp://:2375"', "hosts.dgx.docker"),
        ('docker = "ftp://h"', "hosts.dgx.docker"),
        ('ollama = "http://[fe80::1"', "hosts.dgx.ollama"),
        ('token_env = "NOT A NAME"', "hosts.dgx.token_env"),
        ('read_token_env = "1X"', "hosts.dgx.read_token_env"),
    ],
)
def test_unparsable_urls_are_located_errors(tmp_path: Path, line: str, location: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"[hosts.dgx]\n{line}\n"))
    assert e.value.message.startswith(location + ": "), e.value.message


def test_good_urls_keep_their_form() -> None:
    conf = parse_config(
        {
            "hosts": {
                "dgx": {
                    "agent": "https://[::1]:9400/",
                    "docker": "unix:///var/run/docker.sock",
                    "ollama": "http://127.0.0.1:11434",
                    "jupyter": "http://h:8888/lab/",
                }
            }
        }
    )
    h = conf.host("dgx")
    assert h.agent == "https://[::1]:9400"
    assert h.docker == "unix:///var/run/docker.sock"
    assert h.jupyter == "http://h:8888/lab"


@pytest.mark.parametrize(
    "name", ["vllm\n", "-x", ".hidden", "a b", "a/b", "x" * 102, "ü", "", "a\x00b"]
)
def test_service_names_the_store_refuses_are_refused_at_load(name: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"hosts": {"dgx": {}}, "services": {name: {}}})
    assert e.value.message.startswith("services."), e.value.message
    assert "a name may hold" in e.value.message


@pytest.mark.parametrize("name", ["vllm", "qwen3.32b", "a-b", "x_", "0", "x" * 101])
def test_service_names_the_store_accepts(name: str) -> None:
    from gpuctl.core.names import is_valid_name

    conf = parse_config({"hosts": {"dgx": {}}, "services": {name: {}}})
    assert conf.service(name).name == name
    assert is_valid_name(name)
    assert not is_valid_name(name + "\n")


# --------------------------------------------------------------------------- launcher fields


@pytest.mark.parametrize(
    ("lines", "location"),
    [
        ('launcher = "docker"\nimage = "vllm vllm"', "services.a.image"),
        ('launcher = "docker"\nimage = "x"\nvolumes = ["/data"]', "services.a.volumes"),
        ('launcher = "docker"\nimage = "x"\nvolumes = ["/a:rel"]', "services.a.volumes"),
        ('launcher = "docker"\nimage = "x"\nvolumes = ["/a:/b:rx"]', "services.a.volumes"),
        ('launcher = "docker"\nimage = "x"\nports = { "http" = 8000 }', "services.a.ports.http"),
        ('launcher = "docker"\nimage = "x"\nports = { "8000" = 70000 }', "services.a.ports.8000"),
        ('launcher = "docker"\nimage = "x"\nports = { "8000/ip" = 1 }', "services.a.ports"),
        ('launcher = "docker"\nimage = "x"\nports = { "8000" = true }', "services.a.ports.8000"),
        ('launcher = "docker"\nimage = "x"\nshm_size = "lots"', "services.a.shm_size"),
        ('launcher = "docker"\nimage = "x"\nipc_mode = "shared"', "services.a.ipc_mode"),
        ('launcher = "docker"\nimage = "x"\npid_mode = "mine"', "services.a.pid_mode"),
        ('launcher = "docker"\nimage = "x"\nnetwork = "no such/net"', "services.a.network"),
        ('launcher = "docker"\nimage = "x"\ngpus = "all"', "services.a.gpus"),
        ('launcher = "docker"\nimage = "x"\nenv = { "A=B" = "1" }', "services.a.env"),
        ('launcher = "docker"\nimage = "x"\nenv = { A = true }', "services.a.env.A"),
        ('launcher = "jupyter"\ncommand = "x"\nenv = { "my-var" = "1" }', "services.a.env"),
        ('launcher = "jupyter"\ncommand = "x"\nterminal = "a b"', "services.a.terminal"),
        ('launcher = "process"', "services.a.command"),
        ('match = ["vllm,sglang"]', "services.a.match"),
        ('match = [" "]', "services.a.match"),
    ],
)
def test_launcher_fields_are_checked_at_load(tmp_path: Path, lines: str, location: str) -> None:
    text = f'[hosts.dgx]\njupyter = "http://127.0.0.1:8888"\n[services.a]\n{lines}\n'
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.message.startswith(location), e.value.message


def test_docker_fields_that_docker_takes() -> None:
    svc = parse_config(
        {
            "hosts": {"dgx": {}},
            "services": {
                "a": {
                    "launcher": "docker",
                    "image": "vllm/vllm-openai:latest",
                    "volumes": ["/data/hf:/root/.cache/huggingface:ro", "hfcache:/cache"],
                    "ports": {"8000": 8000, "9000/udp": "9001"},
                    "ipc_mode": "host",
                    "pid_mode": "container:other",
                    "network": "my-net",
                    "shm_size": "16GiB",
                }
            },
        }
    ).service("a")
    assert svc.ports == {"8000": 8000, "9000/udp": 9001}
    assert svc.shm_size == "16GiB"


# --------------------------------------------------------------------------- new keys


def test_new_keys_parse_with_their_defaults(tmp_path: Path) -> None:
    text = """
[hosts.dgx]
agent = "http://127.0.0.1:9400"
read_token_env = "GPUCTL_DGX_READ_TOKEN"
ollama = "http://127.0.0.1:11434"

[services.vllm]
health = "http://127.0.0.1:8000/health"
devices = [0, 1]
stop = "sleep"
metrics = "http://127.0.0.1:8001/metrics"

[services.chat]
launcher = "ollama"
model = "qwen3:32b"
idle_timeout = "never"

[services.plain]
"""
    conf = load_config(write(tmp_path, text))
    dgx = conf.host("dgx")
    assert dgx.read_token_env == "GPUCTL_DGX_READ_TOKEN" and dgx.ollama == "http://127.0.0.1:11434"
    v = conf.service("vllm")
    assert (v.devices, v.stop, v.sleep_level) == ((0, 1), "sleep", 1)
    assert v.metrics == "http://127.0.0.1:8001/metrics"
    c = conf.service("chat")
    assert (c.launcher, c.model, c.idle_timeout_s, c.stop) == ("ollama", "qwen3:32b", None, "stop")
    p = conf.service("plain")
    assert (p.devices, p.stop, p.sleep_level, p.idle_timeout_s, p.gpus) == (
        None,
        "stop",
        None,
        1800.0,
        True,
    )


def test_idle_timeout_never_in_defaults() -> None:
    conf = parse_config(
        {"defaults": {"idle_timeout": "never"}, "hosts": {"h": {}}, "services": {"a": {}}}
    )
    assert conf.defaults.idle_timeout_s is None
    assert conf.service("a").idle_timeout_s is None


def test_yield_after_defaults_to_10m_inherits_defaults_and_takes_never() -> None:
    """10 minutes unless set; ``[defaults]`` sets it for every server; "never" exempts."""
    conf = parse_config({"hosts": {"h": {}}, "services": {"a": {}}})
    assert (conf.defaults.yield_after_s, conf.service("a").yield_after_s) == (600.0, 600.0)
    conf = parse_config(
        {
            "defaults": {"yield_after": "20m"},
            "hosts": {"h": {}},
            "services": {"a": {}, "b": {"yield_after": "NEVER"}, "c": {"yield_after": "90s"}},
        }
    )
    got = [conf.service(n).yield_after_s for n in "abc"]
    assert (conf.defaults.yield_after_s, got) == (1200.0, [1200.0, None, 90.0])


def test_a_batch_never_yields_and_refuses_a_yield_after_of_its_own() -> None:
    """A batch answers no requests, so it would look idle while it works: the default
    passes it by, "never" is accepted, and any duration is a located error."""
    batch = {"kind": "batch"}
    conf = parse_config(
        {"defaults": {"yield_after": "5m"}, "hosts": {"h": {}}, "services": {"b": batch}}
    )
    assert conf.service("b").yield_after_s is None
    never = {"kind": "batch", "yield_after": "never"}
    assert (
        parse_config({"hosts": {"h": {}}, "services": {"b": never}}).service("b").yield_after_s
        is None
    )
    with pytest.raises(ConfigError) as e:
        parse_config({"hosts": {"h": {}}, "services": {"b": {**batch, "yield_after": "5m"}}})
    assert e.value.message.startswith("services.b.yield_after: a batch never yields")
    assert "kind" in e.value.hint


@pytest.mark.parametrize(
    ("lines", "location"),
    [
        ('yield_after = "nevermore"', "services.a.yield_after"),
        ("yield_after = true", "services.a.yield_after"),
        ("devices = []", "services.a.devices"),
        ('devices = ["0"]', "services.a.devices"),
        ("devices = [0, 0]", "services.a.devices"),
        ("devices = [true]", "services.a.devices"),
        ("devices = [1024]", "services.a.devices"),
        ('stop = "kill"', "services.a.stop"),
        ('stop = "sleep"', "services.a.stop"),  # without health
        ('stop = "sleep"\nhealth = "http://h:1/health"\nsleep_level = 3', "services.a.sleep_level"),
        ("sleep_level = 2", "services.a.sleep_level"),  # without stop = "sleep"
        ('metrics = "h:1/metrics"', "services.a.metrics"),
        ('model = "qwen3:32b"', "services.a.model"),  # not launcher = "ollama"
        ('launcher = "ollama"', "services.a.model"),
        ('launcher = "ollama"\nmodel = "m"', "services.a.launcher"),  # host has no ollama URL
        ('idle_timeout = "nevermore"', "services.a.idle_timeout"),
    ],
)
def test_new_keys_are_validated(tmp_path: Path, lines: str, location: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"[hosts.dgx]\n[services.a]\n{lines}\n"))
    assert e.value.message.startswith(location), e.value.message


def test_read_token_is_used_for_reads_only_without_a_write_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUCTL_T_READ", "r-tok")
    monkeypatch.setenv("GPUCTL_T_WRITE", "w-tok")
    ro = parse_config({"hosts": {"h": {"read_token_env": "GPUCTL_T_READ"}}}).host("h")
    assert (ro.token(), ro.read_token(), ro.token_for_reads()) == (None, "r-tok", "r-tok")
    both = parse_config(
        {"hosts": {"h": {"read_token_env": "GPUCTL_T_READ", "token_env": "GPUCTL_T_WRITE"}}}
    ).host("h")
    assert both.token_for_reads() == "w-tok"
    with pytest.raises(ConfigError, match=r"^hosts\.h: set read_token_env or read_token_file"):
        parse_config({"hosts": {"h": {"read_token_env": "A", "read_token_file": "/x"}}})
    with pytest.raises(ConfigError, match=r"^hosts\.h\.read_token: secrets do not belong"):
        parse_config({"hosts": {"h": {"read_token": "s3cret"}}})


# --------------------------------------------------------------------------- typos first (issue 11)


@pytest.mark.parametrize(
    ("text", "location", "suggestion"),
    [
        ('[host.dgx]\nagent = "http://h:1"\n[services.vllm]\nmemory = "1G"\n', "host", "hosts"),
        ('[servces.vllm]\nmemory = "1G"\n', "servces", "services"),
        ('[services.vllm]\nhsot = "dgx"\n', "services.vllm.hsot", "host"),
        ('[hosts.a]\n[hosts.b]\n[services.vllm]\nhsot = "a"\n', "services.vllm.hsot", "host"),
    ],
)
def test_a_typo_is_reported_before_what_it_hides(
    tmp_path: Path, text: str, location: str, suggestion: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.message == f"{location}: unknown key"
    assert e.value.hint == f"did you mean {suggestion!r}?"


def test_no_hosts_at_all_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, '[services.vllm]\nmemory = "1G"\n'))
    assert e.value.message == "services.vllm.host: missing, and no [hosts] are configured"


# --------------------------------------------------------------------------- secrets


def test_token_file_that_is_a_folder_or_empty(tmp_path: Path) -> None:
    (tmp_path / "tokdir").mkdir()
    (tmp_path / "empty.token").write_text("\n")
    h = parse_config({"hosts": {"h": {"token_file": str(tmp_path / "tokdir")}}}).host("h")
    with pytest.raises(ConfigError, match=r"^hosts\.h\.token_file: .* is a folder"):
        h.token()
    h = parse_config({"hosts": {"h": {"token_file": str(tmp_path / "empty.token")}}}).host("h")
    with pytest.raises(ConfigError, match=r"^hosts\.h\.token_file: .* is empty"):
        h.token()


def test_loader_warns_about_readable_token_files(tmp_path: Path) -> None:
    tok = tmp_path / "dgx.token"
    tok.write_text("abc\n")
    os.chmod(tok, 0o644)
    conf = load_config(write(tmp_path, '[hosts.dgx]\ntoken_file = "dgx.token"\n'))
    assert len(conf.warnings) == 1 and "chmod 600" in conf.warnings[0]
    assert conf.warnings[0].startswith("hosts.dgx: ")
    os.chmod(tok, 0o600)
    assert load_config(tmp_path / "config.toml").warnings == ()


def test_a_token_file_warning_keeps_the_proxy_table(tmp_path: Path) -> None:
    """The warning never costs the rest of the config: [proxy] once fell back to its
    defaults (listen 127.0.0.1:9401, no client keys) whenever a token file warned."""
    tok = tmp_path / "dgx.token"
    tok.write_text("abc\n")
    os.chmod(tok, 0o644)
    (tmp_path / "proxy.keys").write_text("k1\n")
    os.chmod(tmp_path / "proxy.keys", 0o600)
    conf = load_config(
        write(
            tmp_path,
            '[hosts.dgx]\ntoken_file = "dgx.token"\n'
            '[proxy]\nlisten = "127.0.0.1:9555"\napi_keys_file = "proxy.keys"\n',
        )
    )
    assert len(conf.warnings) == 1 and "chmod 600" in conf.warnings[0]
    assert conf.proxy.listen == "127.0.0.1:9555"
    assert conf.proxy.api_keys_file == tmp_path / "proxy.keys"


def test_one_list_of_probe_names() -> None:
    from gpuctl.adapters.probes.factory import PROBE_NAMES
    from gpuctl.config import PROBES, ProbeName

    assert PROBE_NAMES is PROBES
    assert tuple(p.value for p in ProbeName) == PROBES == ("auto", "nvml", "nvidia-smi", "sim")
    with pytest.raises(ConfigError, match=r"^hosts\.h\.probe: expected one of auto, nvml"):
        parse_config({"hosts": {"h": {"probe": "cuda"}}})


def test_docs_config_example_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The configuration reference's example is a config gpuctl accepts (it documents every
    key)."""
    section = (
        Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md"
    ).read_text()
    block = section[
        section.index("```toml\n") + 8 : section.index("\n```", section.index("```toml"))
    ]
    conf = load_config(write(tmp_path, block))
    assert set(conf.hosts) == {"dgx", "box"}
    v, chat = conf.service("vllm"), conf.service("chat")
    assert (v.devices, v.stop, v.sleep_level) == ((0,), "sleep", 1)
    assert (chat.launcher, chat.model) == ("ollama", "qwen3:32b")
    from gpuctl.config.parse import HOST_KEYS, SERVICE_KEYS

    for key in (*HOST_KEYS, *SERVICE_KEYS):
        assert f"`{key}`" in section or f"\n{key} =" in block or f"# {key} =" in block, key


def test_show_round_trips_the_new_keys(tmp_path: Path) -> None:
    from gpuctl.render.config_view import config_to_toml

    text = """
[hosts.dgx]
agent = "http://127.0.0.1:9400"
read_token_file = "r.token"
ollama = "http://127.0.0.1:11434"
[services.vllm]
health = "http://127.0.0.1:8000/health"
devices = [1, 0]
stop = "sleep"
sleep_level = 2
metrics = "http://127.0.0.1:8001/metrics"
idle_timeout = "never"
[services.chat]
launcher = "ollama"
model = "qwen3:32b"
"""
    conf = load_config(write(tmp_path, text))
    again = tmp_path / "again.toml"
    again.write_text(config_to_toml(conf))
    assert load_config(again).services == conf.services
    assert load_config(again).hosts["dgx"].read_token_file == conf.hosts["dgx"].read_token_file
