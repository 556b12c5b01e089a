"""``launcher = "slurm"`` and ``[hosts.NAME.slurm]``: checked at load, each error naming
its key and the fix. (The launcher itself runs against a real Slurm:
tests/test_launcher_slurm.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from gpuctl.adapters.launchers.slurm import slurm_time
from gpuctl.config import SlurmConfig, parse_config
from gpuctl.errors import ConfigError


def cfg(slurm: Any = None, **svc: Any) -> dict[str, Any]:
    host: dict[str, Any] = {} if slurm is None else {"slurm": slurm}
    service = {"launcher": "slurm", "command": "vllm serve m", **svc}
    return {"hosts": {"c": host}, "services": {"s": service}}


def test_every_key_and_its_default() -> None:
    c = parse_config(cfg({}))
    assert c.hosts["c"].slurm == SlurmConfig()
    full = {
        "partition": "gpu",
        "account": "lab-1",
        "time_limit": "1h30m",
        "gpus": 2,
        "nice": 100,
        "qos": "inference",
        "sbatch": "/opt/slurm/bin/sbatch",
        "squeue": "/opt/slurm/bin/squeue",
        "scancel": "/opt/slurm/bin/scancel",
    }
    s = parse_config(cfg(full)).hosts["c"].slurm
    assert s == SlurmConfig(
        partition="gpu",
        account="lab-1",
        time_limit_s=5400.0,
        gpus=2,
        nice=100,
        qos="inference",
        sbatch="/opt/slurm/bin/sbatch",
        squeue="/opt/slurm/bin/squeue",
        scancel="/opt/slurm/bin/scancel",
    )


@pytest.mark.parametrize(
    ("slurm", "words"),
    [
        ({"partiton": "gpu"}, "hosts.c.slurm.partiton: unknown key"),
        ({"partition": "gpu a"}, "hosts.c.slurm.partition: expected a Slurm partition name"),
        ({"gpus": -1}, "hosts.c.slurm.gpus: expected an integer from 0 to 64"),
        ({"gpus": True}, "hosts.c.slurm.gpus: expected an integer"),
        ({"time_limit": "soon"}, "hosts.c.slurm.time_limit: expected a duration"),
        ({"qos": ""}, "hosts.c.slurm.qos: expected a non-empty string"),
        ({"sbatch": "sbatch --x"}, "hosts.c.slurm.sbatch: expected a command or path"),
        ("gpu", "hosts.c.slurm: expected a table"),
    ],
)
def test_bad_keys_are_named(slurm: Any, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(cfg(slurm))
    assert words in e.value.message


def test_a_slurm_service_needs_the_table_and_a_command() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(cfg(None))
    assert e.value.message == "services.s.launcher: 'slurm' needs a [hosts.c.slurm] table"
    assert e.value.hint and "[hosts.c.slurm]" in e.value.hint
    with pytest.raises(ConfigError) as e:
        parse_config(cfg({}, command=None) | {"services": {"s": {"launcher": "slurm"}}})
    assert e.value.message.startswith("services.s.command: missing")
    with pytest.raises(ConfigError) as e:
        parse_config(cfg({}, stop="sleep", health="http://{node}:8000/health"))
    assert e.value.message.startswith("services.s.stop: 'sleep'")


def test_node_in_health_only_for_slurm() -> None:
    c = parse_config(cfg({}, health="http://{node}:8000/health", url="http://gpu01:8000"))
    assert c.services["s"].health == "http://{node}:8000/health"
    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "hosts": {"c": {}},
                "services": {
                    "s": {
                        "launcher": "process",
                        "command": "x",
                        "health": "http://{node}:8000/health",
                    }
                },
            }
        )
    assert e.value.message.startswith("services.s.health: {node} names the node Slurm chose")
    with pytest.raises(ConfigError) as e:
        parse_config(cfg({}, health="ftp://{node}:8000/health"))
    assert e.value.message.startswith("services.s.health:")


def test_node_in_url_is_refused() -> None:
    # The proxy and status use url as written: a {node} there would reach no server.
    with pytest.raises(ConfigError) as e:
        parse_config(cfg({}, health="http://{node}:8000/health", url="http://{node}:8000"))
    assert e.value.message.startswith("services.s.url: {node} works in health only")
    assert e.value.hint == "write the server's host name in url, or leave url out"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(1, "0-00:00:01"), (0.2, "0-00:00:01"), (5400, "0-01:30:00"), (90061.5, "1-01:01:02")],
)
def test_time_limit_as_sbatch_reads_it(seconds: float, text: str) -> None:
    assert slurm_time(seconds) == text
