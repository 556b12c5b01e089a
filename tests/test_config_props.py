"""Property tests: whatever the config, a size or a duration holds, the loader answers with
a value or a ConfigError that names a location, never another exception (issue 7)."""

from __future__ import annotations

import math
import string
import tomllib
from datetime import date, datetime, time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuctl.config import Config, load_config, parse_config
from gpuctl.config.parse import DEFAULTS_KEYS, HOST_KEYS, ROOT_KEYS, SERVICE_KEYS
from gpuctl.core.units import MAX_DURATION_S, MAX_SIZE_MIB, parse_duration_s, parse_size_mib
from gpuctl.errors import ConfigError

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)

# What tomllib can hand us: every TOML type, including inf/nan floats and huge ints.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(
        [
            "inf",
            "nan",
            "0",
            "1e400",
            "-5",
            "30m",
            "80GiB",
            "never",
            "http://[::1",
            "http://h:1",
            "unix:///s",
            "auto",
            "sim",
            "docker",
            "ollama",
            "sleep",
            "stop",
            "vllm\n",
            "/a:/b:ro",
        ]
    ),
    st.datetimes().map(lambda d: d),
    st.dates(),
    st.times(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


GOOD: dict[str, list[Any]] = {
    "idle_timeout": ["30m", "never", 60],
    "health_timeout": ["10m", 5.5],
    "agent_timeout": ["3s"],
    "timeout": ["2s", 1],
    "priority": [50, -3],
    "agent": ["http://127.0.0.1:9400", "https://[::1]:1/"],
    "jupyter": ["http://h:8888"],
    "ollama": ["http://h:11434"],
    "docker": ["unix:///var/run/docker.sock", "ssh://me@h"],
    "token_env": ["GPUCTL_T"],
    "read_token_env": ["GPUCTL_R"],
    "jupyter_token_env": ["JT"],
    "token_file": ["t.token"],
    "gpu_memory": ["128GiB", "1024MiB"],
    "probe": ["auto", "sim"],
    "sim_dir": ["/tmp/sim"],
    "host": ["dgx"],
    "launcher": ["docker", "jupyter", "process", "ollama"],
    "image": ["vllm/vllm-openai:latest"],
    "command": ["vllm serve m"],
    "health": ["http://127.0.0.1:8000/health"],
    "metrics": ["http://127.0.0.1:8000/metrics"],
    "match": [["vllm"], "vllm"],
    "memory": ["80GiB", "512MiB"],
    "devices": [[0], [0, 1], 2],
    "stop": ["stop", "sleep"],
    "sleep_level": [1, 2],
    "model": ["qwen3:32b"],
    "env": [{"A": "1"}],
    "volumes": [["/a:/b:ro"]],
    "ports": [{"8000": 8000}],
    "ipc_mode": ["host"],
    "pid_mode": ["host"],
    "network": ["my-net"],
    "shm_size": ["16GiB"],
    "stop_timeout": ["30s"],
    "terminal": ["gpuctl_x"],
    "gpus": [True, False],
    "cwd": ["/srv"],
    "log": ["/tmp/x.log"],
}
HOSTILE = [
    "inf",
    "nan",
    "0",
    "1e400",
    "-5",
    "",
    " ",
    "http://[::1",
    "x\n",
    float("nan"),
    float("inf"),
    0,
    -1,
    2**63 - 1,
    True,
    [],
    {},
    ["a,b"],
    "never",
]


def good_table(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.lists(st.sampled_from(keys), max_size=6, unique=True).flatmap(
        lambda ks: st.fixed_dictionaries({k: st.sampled_from(GOOD.get(k, ["x"])) for k in ks})
    )


names = st.one_of(st.sampled_from(["dgx", "vllm", "a.b", "-x", "v\n", ""]), st.text(max_size=6))
# A plausible config (one host, a few services, good values) with one or two values, keys
# or tables swapped for hostile ones: validation gets deep before it meets the bad value.
plausible = st.fixed_dictionaries(
    {
        "defaults": good_table(DEFAULTS_KEYS),
        "hosts": st.fixed_dictionaries({"dgx": good_table(HOST_KEYS)}),
        "services": st.dictionaries(
            st.sampled_from(["vllm", "chat", "w"]), good_table(SERVICE_KEYS), max_size=3
        ),
    }
)
mutation = st.tuples(
    st.sampled_from(["defaults", "hosts", "services", "root"]),
    st.one_of(st.sampled_from(HOST_KEYS + SERVICE_KEYS + DEFAULTS_KEYS), st.text(max_size=8)),
    st.one_of(st.sampled_from(HOSTILE), values),
    names,
)


def _mutate(data: dict[str, Any], muts: list[tuple[str, str, Any, str]]) -> dict[str, Any]:
    for section, key, value, name in muts:
        if section == "root":
            data[key if key not in ("defaults", "hosts", "services") else section] = value
        elif section == "defaults":
            data["defaults"][key] = value
        else:
            tables = data[section]
            target = next(iter(tables), None) if tables and name not in tables else name
            if target is None or key == "":
                tables[name] = value  # a whole table replaced, or a new one with a bad name
            elif isinstance(tables.get(target), dict):
                tables[target][key] = value
            else:
                tables[target] = value
    return data


configs = st.one_of(
    st.tuples(plausible, st.lists(mutation, max_size=2)).map(lambda p: _mutate(*p)),
    st.tuples(plausible, st.lists(mutation, max_size=2)).map(lambda p: _mutate(*p)),
    st.dictionaries(st.one_of(st.sampled_from(ROOT_KEYS), st.text(max_size=8)), values, max_size=3),
)


def _located(message: str, roots: set[str]) -> bool:
    """``<location>: <what>``, the location starting at one of the config's top-level keys."""
    loc, sep, rest = message.partition(": ")
    return bool(sep and rest and loc) and any(
        loc == r or loc.startswith(r + ".") or loc.startswith(repr(r)[:10]) for r in roots
    )


@pytest.mark.slow
@SETTINGS
@given(configs)
def test_any_config_is_a_config_or_a_located_error(data: dict[str, Any]) -> None:
    try:
        conf = parse_config(data)
    except ConfigError as e:
        assert _located(e.message, {str(k) for k in data}), e.message
        return
    assert isinstance(conf, Config)
    for s in conf.services.values():
        assert s.host in conf.hosts
        assert s.memory_mib is None or 1 <= s.memory_mib <= MAX_SIZE_MIB
        for d in (s.health_timeout_s, s.stop_timeout_s, s.idle_timeout_s):
            assert d is None or (math.isfinite(d) and 0 < d <= MAX_DURATION_S)
    for h in conf.hosts.values():
        assert math.isfinite(h.timeout_s) and h.timeout_s > 0


toml_text = st.one_of(
    st.binary(max_size=200),
    st.text(alphabet=string.printable, max_size=200).map(str.encode),
    st.lists(
        st.sampled_from(
            [
                "[hosts.dgx]",
                "[services.vllm]",
                "[defaults]",
                'agent = "http://[::1"',
                "memory = inf",
                "memory = nan",
                "health_timeout = 0",
                "timeout = -1",
                'idle_timeout = "never"',
                "devices = [0, 0]",
                'host = "dgx"',
                "[host.dgx]",
                'launcher = "ollama"',
                "priority = 99999999999999999999",
                "x = [[[[1]]]]",
                'ports = { "8000" = 70000 }',
                "stop = 'sleep'",
                "sleep_level = 2",
            ]
        ),
        max_size=12,
    ).map(lambda lines: "\n".join(lines).encode()),
)


@SETTINGS
@given(toml_text)
def test_any_file_is_a_config_or_a_located_error(
    tmp_path_factory: pytest.TempPathFactory, raw: bytes
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.toml"
    path.write_bytes(raw)
    try:
        conf = load_config(path)
    except ConfigError as e:
        try:
            roots = set(tomllib.loads(raw.decode()))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError):
            roots = set()
        assert e.message.startswith(str(path)) or _located(e.message, roots), e.message
        return
    assert conf.path == path


@SETTINGS
@given(
    st.one_of(
        st.text(max_size=20),
        st.integers(),
        st.floats(),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    )
)
def test_sizes_are_a_value_or_a_value_error(text: Any) -> None:
    for allow_zero in (False, True):
        try:
            mib = parse_size_mib(text, allow_zero=allow_zero)
        except ValueError as e:
            assert str(e)
            continue
        assert isinstance(mib, int) and (0 if allow_zero else 1) <= mib <= MAX_SIZE_MIB


@SETTINGS
@given(
    st.one_of(
        st.text(max_size=20),
        st.integers(),
        st.floats(),
        st.booleans(),
        st.none(),
        st.from_regex(r"\A[0-9]{1,400}(\.[0-9]{1,5})?(ms|s|m|h|d){0,1}\Z"),
    )
)
def test_durations_are_a_value_or_a_value_error(text: Any) -> None:
    for allow_zero in (False, True):
        try:
            s = parse_duration_s(text, allow_zero=allow_zero)
        except ValueError as e:
            assert str(e)
            continue
        assert isinstance(s, float) and math.isfinite(s)
        assert (s >= 0 if allow_zero else s > 0) and s <= MAX_DURATION_S


def test_the_strategies_reach_valid_configs() -> None:
    """The properties above would hold vacuously if every example were an error."""
    conf = parse_config(
        {"hosts": {"dgx": {"timeout": "2s"}}, "services": {"vllm": {"memory": "1MiB"}}}
    )
    assert conf.service("vllm").memory_mib == 1
    _ = (date, datetime, time, Path)  # TOML's date/time values are among the scalars


def test_messages_stay_one_short_line() -> None:
    """A huge or deeply nested value is cut short in the message, never echoed whole."""
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    for value in ("9" * 100_000 + "x", ["x"] * 10_000, deep):
        for parse in (parse_size_mib, parse_duration_s):
            with pytest.raises(ValueError) as e:
                parse(value)
            assert len(str(e.value)) < 200 and "\n" not in str(e.value)
        with pytest.raises(ConfigError) as c:
            parse_config({"hosts": {"h": {"timeout": value}}})
        assert c.value.message.startswith("hosts.h.timeout: ") and len(c.value.message) < 200
