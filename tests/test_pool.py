"""A service over a pool of hosts: several simulated hosts on loopback, each with its own
agent, simulated GPU and loopback address, and ``gpuctl ensure`` run as a user runs it.

The pick order (READY, LOADING, the tightest fit, BUSY naming each host), an UNKNOWN
host skipped and named, exactly one copy across the pool for racing callers whose
configs list the hosts in other orders under other names, and the coordinator's agent
stopped: READY elsewhere still answers, a start is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.config import parse_config
from gpuctl.core.pool import host_key
from gpuctl.errors import ConfigError
from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.host import SimHost, free_port, sim_hosts
from tests.conftest import config_env, gpuctl_exe
from tests.ensure_helpers import kill_servers, model_server_command, run_ensure, unique_name

ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def sim_pool(
    root: Path, addresses: Sequence[str]
) -> contextlib.AbstractContextManager[list[SimHost]]:
    """Simulated hosts of 128 GiB, one on each of ``addresses``, each with its agent."""
    return sim_hosts(SimHost(root=root / f"host{i}", address=a) for i, a in enumerate(addresses))


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[list[SimHost]]:
    """Three simulated hosts, each with its agent on its own loopback address."""
    with sim_pool(tmp_path, ADDRESSES) as hosts:
        yield hosts


def write_config(
    path: Path,
    hosts: Sequence[SimHost],
    names: Sequence[str],
    service: str,
    port: int,
    *,
    order: Sequence[int] | None = None,
    load_time: str = "1s",
    more: Sequence[str] = (),
) -> Path:
    """A config naming ``hosts`` as ``names``, the service's pool listed in ``order``;
    ``more``: lines after the service's table (its own keys first, other tables after)."""
    lines = []
    for h, n in zip(hosts, names, strict=True):
        env = f"GPUCTL_POOL_TOKEN_{n.upper()}"
        os.environ[env] = h.token
        lines += [
            f"[hosts.{n}]",
            f'agent = "{h.agent_url}"',
            f'token_env = "{env}"',
            f'sim_dir = "{h.sim_dir}"',
            "",
        ]
    listed = [names[i] for i in (order or range(len(names)))]
    lines += [
        f"[services.{service}]",
        f"hosts = {json.dumps(listed)}",
        'launcher = "process"',
        f"command = {json.dumps(model_server_command(service, port, '20GiB', load_time))}",
        f'health = "http://{{host}}:{port}/health"',
        f'match = ["{service}"]',
        'memory = "20GiB"',
        'health_timeout = "60s"',
        "",
        *more,
    ]
    path.write_text("\n".join(lines))
    return path


def ensure(config: Path, service: str, *args: str, timeout: float = 120) -> tuple[int, Any]:
    """``gpuctl ensure --json``: its exit code and its JSON answer."""
    p = run_ensure(config, service, *args, timeout=timeout)
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON: {p.stdout!r} {p.stderr!r}") from None


def claims(host: SimHost, name: str) -> list[int]:
    return [c.pid for c in SimGpu(host.sim_dir, define=False).claims() if c.name == name]


def copies(hosts: Sequence[SimHost], name: str) -> dict[str, int]:
    """How many servers of ``name`` hold memory on each host's simulated GPU."""
    return {h.address: len(claims(h, name)) for h in hosts if claims(h, name)}


def hold(host: SimHost, name: str, memory: str) -> None:
    """Take ``memory`` on ``host``'s simulated GPU, and wait until the claim is there."""
    host.hold(name, memory)
    deadline = time.monotonic() + 20
    while not claims(host, name):
        assert time.monotonic() < deadline, host.log_tail(name)
        time.sleep(0.05)


def by_hand(host: SimHost, service: str, port: int, load_time: str) -> subprocess.Popen[bytes]:
    """A server of ``service`` started on ``host`` outside gpuctl, as its launcher would
    start it there: on its simulated GPU, at its address (``GPUCTL_SIM_HOST``, which also
    keeps the other simulated hosts' agents from taking it for theirs)."""
    args = ["sim", "model-server", "--name", service, "--memory", "20GiB", "--port", str(port)]
    return host.spawn(
        [*args, "--load-time", load_time],
        service,
        {"GPUCTL_SIM_HOST": host.address},
    )


def gone_before_join(config: Path, host: SimHost, service: str, port: int) -> tuple[int, Any]:
    """``gpuctl ensure`` that finds the copy LOADING on ``host`` (started by hand), which
    goes (killed) between the pool's look and its join (failpoint ``pool.join``)."""
    loading = by_hand(host, service, port, "600s")
    deadline = time.monotonic() + 20
    while not claims(host, service):
        assert time.monotonic() < deadline, host.log_tail(service)
        time.sleep(0.05)
    p = subprocess.Popen(
        [gpuctl_exe(), "ensure", service, "--json"],
        env={**config_env(config), "GPUCTL_FAILPOINTS": "pool.join=stop"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stderr is not None
    line = p.stderr.readline()
    assert line.startswith("gpuctl failpoint pool.join: stop"), (line, p.communicate())
    host.stop(loading)
    while claims(host, service):
        time.sleep(0.05)
    p.send_signal(signal.SIGCONT)
    stdout, _ = p.communicate(timeout=120)
    return p.returncode, json.loads(stdout)


@pytest.fixture
def service() -> Iterator[str]:
    name = unique_name("pool")
    yield name
    kill_servers(name)


def test_the_tightest_fit_is_chosen_then_ready_there(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port)
    hold(pool[0], "holdera", "60GiB")  # 68 GiB left
    hold(pool[1], "holderb", "90GiB")  # 38 GiB left: the tightest that fits 20 GiB
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "b", True), out
    assert out["pool"] == ["a", "b", "c"]
    assert copies(pool, service) == {"127.0.0.2": 1}
    # {host} expanded to b's address: the server was launched to listen there alone.
    assert httpx.get(f"http://127.0.0.2:{port}/health", timeout=5).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    # READY first, wherever the tightest fit now is.
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "b", False), out
    assert copies(pool, service) == {"127.0.0.2": 1}
    # `gpuctl stop` without --host stops it wherever in the pool it runs.
    p = subprocess.run(
        [gpuctl_exe(), "stop", service, "--json"],
        env=config_env(config),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    stop = json.loads(p.stdout)
    assert (p.returncode, stop["host"]) == (0, "b"), stop
    assert len(stop["stopped"]) == 1 and stop["stopped"][0].endswith(" on b"), stop
    assert copies(pool, service) == {}


def test_status_has_a_row_per_host_and_groups_the_pool(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port)
    hold(pool[0], "holdera", "60GiB")
    hold(pool[2], "holderc", "60GiB")  # b is the roomiest: a and c are the tight fits
    code, out = ensure(config, service)
    assert (code, out["host"]) == (0, "a"), out
    # --host keeps a start to one host of the pool: never a second copy beside the first.
    code, other = ensure(config, service, "--host", "b")
    assert (code, other["outcome"], other["host"]) == (3, "busy", "b"), other
    assert "the pool's copy is READY on host a, not b" in other["reason"], other
    code, there = ensure(config, service, "--host", "a")
    assert (code, there["outcome"], there["host"], there["launched"]) == (0, "ready", "a", False)
    p = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=config_env(config),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    rows = [r for r in json.loads(p.stdout)["services"] if r["name"] == service]
    assert [(r["host"], r["decision"], r["pool"]) for r in rows] == [
        ("a", "READY", ["a", "b", "c"]),
        ("b", "IDLE", ["a", "b", "c"]),
        ("c", "FITS", ["a", "b", "c"]),
    ], rows
    text = subprocess.run(
        [gpuctl_exe(), "status"],
        env={**config_env(config), "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    assert "POOLED SERVICE" in text, text
    line = next(x for x in text.splitlines() if service in x and "READY" in x and "IDLE" in x)
    assert line.index("a READY") < line.index("b IDLE") < line.index("c FITS"), line


def test_a_start_under_way_is_joined(pool: list[SimHost], tmp_path: Path, service: str) -> None:
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port, load_time="3s")
    code, started = ensure(config, service, "--no-wait")
    assert (code, started["outcome"]) == (0, "started"), started
    # Another host is now the tightest fit: the start under way is joined all the same.
    other = next(i for i, n in enumerate("abc") if n != started["host"])
    hold(pool[other], "holder", "90GiB")
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["launched"]) == (0, "ready", False), out
    assert out["host"] == started["host"]
    assert sum(copies(pool, service).values()) == 1


def test_busy_names_each_host(pool: list[SimHost], tmp_path: Path, service: str) -> None:
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, free_port())
    for i, h in enumerate(pool):
        hold(h, f"holder{i}", "120GiB")
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["decision"]) == (3, "busy", "BUSY"), out
    for name in ("a: BUSY", "b: BUSY", "c: BUSY"):
        assert name in out["reason"], out
    assert copies(pool, service) == {}


def test_an_unknown_host_refuses_a_start_but_ready_elsewhere_answers(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port)
    # Make the coordinator's host the one that is not chosen: fill every other host
    # but one, so the start goes where the coordinator is not.
    coordinator = min(range(3), key=lambda i: str(pool[i].state_dir))
    chosen = (coordinator + 1) % 3
    for i, h in enumerate(pool):
        if i != chosen:
            hold(h, f"holder{i}", "120GiB")
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"]) == (0, "ready", "abc"[chosen]), out
    # The coordinator's agent stops: the copy READY elsewhere still answers...
    pool[coordinator].close()
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"]) == (0, "ready", "abc"[chosen]), out
    assert any(f"skipped host {'abc'[coordinator]}: UNKNOWN" in n for n in out["notes"]), out
    # ...but with it gone, nothing starts: a copy may run where nobody can see.
    kill_servers(service)
    deadline = time.monotonic() + 20
    while claims(pool[chosen], service):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["decision"]) == (4, "unknown", "UNKNOWN"), out
    assert f"{'abc'[coordinator]}: UNKNOWN" in out["reason"], out
    assert out["host"] == "abc"[coordinator], out  # the host that stops it, not one that answers
    assert copies(pool, service) == {}


def test_a_copy_gone_before_it_is_joined_is_not_started_while_a_host_is_unknown(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    """The join of a copy that went meanwhile never starts one itself: with a host of the
    pool UNKNOWN, looking again refuses; with every host back, one copy starts, through
    the pool's lease."""
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port)
    pool[2].close()
    code, out = gone_before_join(config, pool[1], service, port)
    assert (code, out["outcome"], out["decision"]) == (4, "unknown", "UNKNOWN"), out
    assert "c: UNKNOWN" in out["reason"], out
    assert copies(pool, service) == {}
    pool[2].start_agent()  # on another port: the config names it again
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, port)
    code, out = gone_before_join(config, pool[1], service, port)
    assert (code, out["outcome"], out["launched"]) == (0, "ready", True), out
    assert sum(copies(pool, service).values()) == 1


@pytest.mark.slow
def test_preemption_goes_where_the_plan_is_cheapest(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    """Room only once lower-priority work stops: one stop on a, two on b, none possible
    on c (what holds it is no service). Without --preempt the plan is named (exit 3);
    with it, a's one victim stops and the copy starts there."""
    fillers = {"a": [("fa", 20)], "b": [("fb1", 10), ("fb2", 10)]}
    more = ["priority = 100", ""]
    for host, items in fillers.items():
        for name, gib in items:
            fport = free_port()
            more += [
                f"[services.{service}{name}]",
                f'host = "{host}"',
                'launcher = "process"',
                "command = "
                + json.dumps(model_server_command(f"{service}{name}", fport, f"{gib}GiB", "1s")),
                f'health = "http://{{host}}:{fport}/health"',
                f'memory = "{gib}GiB"',
                "priority = 10",
                "",
            ]
    # b is listed first: the plan, not the order, takes the copy to a.
    config = write_config(
        tmp_path / "c.toml", pool, ["a", "b", "c"], service, free_port(), order=[1, 0, 2], more=more
    )
    try:
        for host, items in fillers.items():
            for name, _ in items:
                code, out = ensure(config, f"{service}{name}")
                assert (code, out["outcome"], out["host"]) == (0, "ready", host), out
        hold(pool[0], "holdera", "100GiB")  # a: 8 GiB free beside fa's 20
        hold(pool[1], "holderb", "100GiB")  # b: 8 GiB free beside fb1 and fb2
        hold(pool[2], "holderc", "120GiB")  # c: 8 GiB free, and nothing to stop
        code, out = ensure(config, service)
        assert (code, out["outcome"], out["decision"]) == (3, "busy", "PREEMPTABLE"), out
        assert "the cheapest plan is on a" in out["reason"], out
        code, out = ensure(config, service, "--preempt")
        assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "a", True), out
        assert copies(pool, service) == {"127.0.0.1": 1}
        assert not claims(pool[0], f"{service}fa")
        assert claims(pool[1], f"{service}fb1") and claims(pool[1], f"{service}fb2")
    finally:
        for items in fillers.values():
            for name, _ in items:
                kill_servers(f"{service}{name}")


def test_every_host_unknown_is_unknown(pool: list[SimHost], tmp_path: Path, service: str) -> None:
    config = write_config(tmp_path / "c.toml", pool, ["a", "b", "c"], service, free_port())
    for h in pool:
        h.close()
    code, out = ensure(config, service, timeout=60)
    assert (code, out["outcome"]) == (4, "unknown"), out
    assert "no host of the pool can be asked" in out["reason"]
    assert out["pool"] == ["a", "b", "c"]


@pytest.mark.xdist_group("heavy")
def test_racing_callers_with_two_configs_start_one_copy(
    pool: list[SimHost], tmp_path: Path, service: str
) -> None:
    """Eight callers at once, half of them with a config that lists the hosts in another
    order under other names: one server across the pool, and every caller READY on it."""
    port = free_port()
    one = write_config(tmp_path / "one.toml", pool, ["a", "b", "c"], service, port)
    other = write_config(
        tmp_path / "other.toml", pool, ["zed", "yak", "xen"], service, port, order=[2, 0, 1]
    )
    procs = [
        subprocess.Popen(
            [gpuctl_exe(), "ensure", service, "--json"],
            env=config_env(one if i % 2 else other),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, (stdout, stderr)
        outs.append(json.loads(stdout))
    assert [o["outcome"] for o in outs] == ["ready"] * 8
    assert sum(o["launched"] for o in outs) == 1, outs
    assert sum(copies(pool, service).values()) == 1
    # Both configs name the same machine, under their own names.
    where = {o["host"] for o in outs}
    renamed = {"a": "zed", "b": "yak", "c": "xen"}
    assert len({renamed.get(w, w) for w in where}) == 1, where


# ---- config and placeholders (pure)


def _parse(service: dict[str, Any], hosts: dict[str, Any] | None = None) -> Any:
    return parse_config(
        {
            "hosts": hosts
            or {"a": {"agent": "http://10.0.0.1:9400"}, "b": {"agent": "http://10.0.0.2:9400"}},
            "services": {"s": service},
        }
    )


def test_host_expands_per_host() -> None:
    conf = _parse(
        {
            "hosts": ["a", "b"],
            "health": "http://{host}:8000/health",
            "url": "http://{host}:8000",
        }
    )
    s = conf.services["s"]
    assert (s.host, s.pool, s.health) == ("a", ("a", "b"), "http://10.0.0.1:8000/health")
    on_b = conf.services_on("b")[0]
    assert (on_b.host, on_b.health, on_b.url) == (
        "b",
        "http://10.0.0.2:8000/health",
        "http://10.0.0.2:8000",
    )
    # A host without an agent is this machine.
    local = parse_config(
        {"hosts": {"x": {}}, "services": {"s": {"health": "http://{host}:1/health"}}}
    )
    assert local.services["s"].health == "http://127.0.0.1:1/health"


def test_the_proxy_places_a_pooled_upstream_on_each_host() -> None:
    from gpuctl.proxy.routes import RouteTable

    conf = _parse({"hosts": ["a", "b"], "health": "http://{host}:8000/health", "models": ["m"]})
    routes = RouteTable(conf)
    up = routes.by_model["m"]
    assert (up.service.host, up.origin) == ("a", "http://10.0.0.1:8000")
    on_b = routes.on(up, "b")
    assert (on_b.service.host, on_b.origin) == ("b", "http://10.0.0.2:8000")
    assert on_b.service.health == "http://10.0.0.2:8000/health"
    assert routes.on(on_b, "a") is up and routes.on(up, "b") is on_b  # made once


@pytest.mark.parametrize(
    ("service", "where", "hint"),
    [
        ({"host": "a", "hosts": ["a", "b"]}, "services.s.hosts: set host or hosts", "host"),
        ({"hosts": []}, "services.s.hosts: expected a non-empty list", "hosts = ["),
        ({"hosts": ["a", "a"]}, "services.s.hosts: host 'a' is listed twice", "once"),
        ({"hosts": ["a", 3]}, "services.s.hosts: expected a non-empty list", "hosts = ["),
        (
            # The pool's rule comes before a table the pool could never use.
            {"hosts": ["a", "b"], "launcher": "slurm", "command": "x"},
            "services.s.hosts: a slurm service runs on one host",
            'host = "NAME"',
        ),
        ({"hosts": ["a", "bb"]}, "services.s.hosts: unknown host 'bb'", "did you mean 'b'?"),
        (
            {"hosts": ["a"], "health": "http://{hots}:1/health"},
            "services.s.health: unknown placeholder {hots}",
            "{host}",
        ),
        (
            {"hosts": ["a"], "metrics": "http://{node}:1/metrics"},
            "services.s.metrics: unknown placeholder {node}",
            "{host}",
        ),
    ],
)
def test_pool_config_errors_name_the_key_and_the_fix(
    service: dict[str, Any], where: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as e:
        _parse(service)
    assert e.value.message.startswith(where), e.value.message
    assert "\n" not in e.value.message
    assert hint in e.value.hint


def test_a_pool_needs_an_agent_on_every_host_and_no_slurm() -> None:
    with pytest.raises(ConfigError) as e:
        _parse({"hosts": ["a", "x"]}, {"a": {"agent": "http://10.0.0.1:9400"}, "x": {}})
    assert e.value.message.startswith("services.s.hosts: host 'x' has no agent")
    assert "hosts.x.agent" in e.value.hint
    with pytest.raises(ConfigError) as e:
        _parse(
            {"hosts": ["a", "b"], "launcher": "slurm", "command": "x"},
            {
                "a": {"agent": "http://10.0.0.1:9400", "slurm": {}},
                "b": {"agent": "http://10.0.0.2:9400", "slurm": {}},
            },
        )
    assert "Slurm places its jobs itself" in e.value.message


def test_host_identity_is_the_same_whatever_the_name() -> None:
    assert host_key("h", "b", "/s") == host_key("h", "b", "/s")
    assert host_key("h", "b", "/s") != host_key("h", "b", "/t")


def test_config_show_round_trips_a_pool() -> None:
    import tomllib

    from gpuctl.render.config_view import config_to_toml

    conf = _parse(
        {
            "hosts": ["b", "a"],
            "health": "http://{host}:8000/health",
            "metrics": "http://{host}:8000/metrics",
        }
    )
    text = config_to_toml(conf)
    assert 'health = "http://{host}:8000/health"' in text
    again = parse_config(tomllib.loads(text))
    assert again.services["s"] == conf.services["s"]
    assert again.services["s"].pool == ("b", "a")
    one = _parse({"host": "a"})
    shown = config_to_toml(one)
    assert 'host = "a"' in shown and "hosts = [" not in shown.split("[services.s]")[1]
