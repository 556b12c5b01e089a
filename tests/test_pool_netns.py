"""A pool with one host behind a network partition: its agent runs in a network
namespace the test creates (``tests/netns.py``), reached over a veth pair at a link-local
address, and the partition cuts that link so packets are dropped, not refused: every
client waits for its own timeout, as across a real partition (the agent-stopped case,
connection refused, is in ``test_pool.py``).

The partitioned host is the pool's coordinator (its state folder sorts first, and the
hosts share hostname and boot id). While it is cut off: a copy READY on another host
still answers, naming it skipped; nothing is started anywhere (UNKNOWN, exit 4), and
``ensure`` returns once the client's timeouts run out; ``status`` shows it UNKNOWN. Once
the link heals, one copy starts, and only one for callers racing across the heal.

A copy ``ensure`` starts runs on a loopback host: the caller launches it, on this
machine, where the namespace's address is not (the namespace's host is kept full for
those tests); a copy on the namespace's host is started there by hand. A copy found
READY or LOADING that is gone before it is joined is not started again while a host is
cut off (the join looks at the pool again).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port, sim_hosts
from tests import netns
from tests.conftest import config_env, gpuctl_exe
from tests.ensure_helpers import kill_servers, server_pids, unique_name
from tests.test_pool import by_hand, copies, ensure, gone_before_join, hold, write_config

pytestmark = pytest.mark.skipif(bool(netns.unavailable()), reason=netns.unavailable() or "")

NAMES = ["a", "b", "c"]  # a: the namespace's host, the coordinator


@pytest.fixture
def ns() -> Iterator[netns.Netns]:
    with netns.netns() as n:
        yield n


@pytest.fixture
def pool(tmp_path: Path, ns: netns.Netns) -> Iterator[list[SimHost]]:
    """``a`` in the namespace (the coordinator: ``h0-netns`` sorts first), ``b`` and ``c``
    on loopback."""
    with sim_hosts(
        [
            netns.NetnsSimHost(root=tmp_path / "h0-netns", address=ns.inside, ns=ns),
            SimHost(root=tmp_path / "h1", address="127.0.0.2"),
            SimHost(root=tmp_path / "h2", address="127.0.0.3"),
        ]
    ) as hosts:
        yield hosts


@pytest.fixture
def service() -> Iterator[str]:
    name = unique_name("pnet")
    yield name
    kill_servers(name)


def status_rows(config: Path, service: str) -> list[tuple[str, str]]:
    p = subprocess.run(
        [gpuctl_exe(), "status", "--json"],
        env=config_env(config),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    rows = [r for r in json.loads(p.stdout)["services"] if r["name"] == service]
    return [(r["host"], r["decision"]) for r in rows]


def fill(a: SimHost) -> None:
    """Leave ``a`` no room for the service, so a start goes to ``b`` or ``c``."""
    hold(a, "holdera", "120GiB")


def nothing_started(pool: list[SimHost], service: str) -> None:
    """No server of ``service`` holds memory on any simulated GPU, nor runs at all."""
    assert copies(pool, service) == {}
    assert server_pids(service) == []


@pytest.mark.slow  # each look at the cut-off host waits out its timeouts (5 s)
def test_the_copy_elsewhere_answers_while_the_coordinator_is_cut_off(
    pool: list[SimHost], tmp_path: Path, ns: netns.Netns, service: str
) -> None:
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, NAMES, service, port)
    fill(pool[0])
    hold(pool[1], "holderb", "60GiB")  # b: the tightest fit
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "b", True), out
    # Started through the coordinator, a: the pool's record is in a's store alone.
    pool_records = [(h.state_dir / "records" / f"_pool.{service}.json") for h in pool]
    assert [r.exists() for r in pool_records] == [True, False, False]
    ns.cut()
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "b", False), out
    assert any(n.startswith("skipped host a: UNKNOWN") for n in out["notes"]), out
    assert copies(pool, service) == {"127.0.0.2": 1}
    ns.heal()
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "b", False), out
    assert not any("skipped" in n for n in out["notes"]), out


@pytest.mark.slow  # each look at the cut-off host waits out its timeouts (5 s)
def test_a_partition_refuses_a_start_until_the_link_heals(
    pool: list[SimHost], tmp_path: Path, ns: netns.Netns, service: str
) -> None:
    config = write_config(tmp_path / "c.toml", pool, NAMES, service, free_port())
    fill(pool[0])
    ns.cut()
    # Returns at all (the pytest timeout is the bound): each ask of a ends at the
    # client's timeout, and the answer is a refusal, never a start.
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["decision"]) == (4, "unknown", "UNKNOWN"), out
    assert "a: UNKNOWN" in out["reason"], out
    assert "b: UNKNOWN" not in out["reason"] and "c: UNKNOWN" not in out["reason"], out
    nothing_started(pool, service)
    # status: a is UNKNOWN, never free; b and c answer.
    rows = status_rows(config, service)
    assert rows[0] == ("a", "UNKNOWN"), rows
    assert [r[0] for r in rows[1:]] == ["b", "c"] and "UNKNOWN" not in {r[1] for r in rows[1:]}
    nothing_started(pool, service)
    ns.heal()
    assert status_rows(config, service)[0] == ("a", "BUSY")
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["launched"]) == (0, "ready", True), out
    assert out["host"] in ("b", "c"), out
    assert sum(copies(pool, service).values()) == 1
    assert len(server_pids(service)) == 1


@pytest.mark.slow  # each look at the cut-off host waits out its timeouts (5 s)
def test_a_copy_behind_the_partition_is_never_doubled(
    pool: list[SimHost], tmp_path: Path, ns: netns.Netns, service: str
) -> None:
    """The copy runs on ``a`` (a server started by hand in the namespace, at its address):
    cut off, nobody can see it, so nothing starts on ``b`` or ``c``, however roomy they
    are; healed, it is found READY on ``a``."""
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, NAMES, service, port)
    by_hand(pool[0], service, port, "1s")
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://{ns.inside}:{port}/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, pool[0].log_tail(service)
        time.sleep(0.1)
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "a", False), out
    ns.cut()
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["decision"]) == (4, "unknown", "UNKNOWN"), out
    assert "a: UNKNOWN" in out["reason"], out
    assert copies(pool, service) == {ns.inside: 1}
    assert len(server_pids(service)) == 1
    ns.heal()
    code, out = ensure(config, service)
    assert (code, out["outcome"], out["host"], out["launched"]) == (0, "ready", "a", False), out
    assert copies(pool, service) == {ns.inside: 1}


@pytest.mark.slow  # each look at the cut-off host waits out its timeouts (5 s)
def test_a_copy_gone_before_it_is_joined_is_not_started_again_while_cut_off(
    pool: list[SimHost], tmp_path: Path, ns: netns.Netns, service: str
) -> None:
    """The copy is LOADING on ``b`` when the pool looks, and gone (crashed) by the time
    ``ensure`` joins it, while ``a`` is cut off: the join never turns into a start on ``b``
    (a copy may run on ``a``, where nobody can see, and the pool's lease is not held). It
    looks again, and refuses."""
    port = free_port()
    config = write_config(tmp_path / "c.toml", pool, NAMES, service, port)
    ns.cut()
    code, out = gone_before_join(config, pool[1], service, port)
    assert (code, out["outcome"], out["decision"]) == (4, "unknown", "UNKNOWN"), out
    assert "a: UNKNOWN" in out["reason"], out
    nothing_started(pool, service)


# A caller that runs ``gpuctl ensure`` until it answers 0, printing each answer's JSON on
# a line of its own (the last is the one that answered).
_UNTIL_READY = """
import json, subprocess, sys, time
while True:
    p = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=False)
    print(json.dumps(json.loads(p.stdout)), flush=True)
    if p.returncode == 0:
        break
    time.sleep(0.2)
"""


def _until_ready(config: Path, service: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _UNTIL_READY, gpuctl_exe(), "ensure", service, "--json"],
        env=config_env(config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # each look at the cut-off host waits out its timeouts (5 s)
def test_callers_racing_across_a_heal_start_one_copy(
    pool: list[SimHost], tmp_path: Path, ns: netns.Netns, service: str
) -> None:
    """Two callers in their own processes, their configs listing the pool in other
    orders under other names, each asking until it is answered: they start while the
    coordinator is cut off, the link heals under them, and one copy starts."""
    port = free_port()
    one = write_config(tmp_path / "one.toml", pool, NAMES, service, port)
    other = write_config(
        tmp_path / "other.toml", pool, ["zed", "yak", "xen"], service, port, order=[2, 1, 0]
    )
    fill(pool[0])
    ns.cut()
    callers = [_until_ready(one, service), _until_ready(other, service)]
    # Each has been refused at least once before the heal: its first answer came back.
    refused: list[list[dict[str, Any]]] = [[], []]
    for caller, seen in zip(callers, refused, strict=True):
        assert caller.stdout is not None
        seen.append(json.loads(caller.stdout.readline()))
    for seen in refused:
        assert (seen[0]["outcome"], seen[0]["decision"]) == ("unknown", "UNKNOWN"), seen
    nothing_started(pool, service)
    ns.heal()
    answers = []
    for caller, seen in zip(callers, refused, strict=True):
        stdout, stderr = caller.communicate(timeout=240)
        assert caller.returncode == 0, stderr
        lines = [json.loads(x) for x in stdout.splitlines() if x.strip()]
        seen += lines
        answers.append(lines[-1])
    assert [a["outcome"] for a in answers] == ["ready", "ready"], answers
    assert sum(a["launched"] for a in answers) == 1, answers
    assert sum(copies(pool, service).values()) == 1
    assert len(server_pids(service)) == 1
    renamed = {"a": "zed", "b": "yak", "c": "xen"}
    assert renamed[answers[0]["host"]] == answers[1]["host"], answers
    # Every answer before the last was a refusal: nothing started while a was cut off.
    for seen in refused:
        assert [s["outcome"] for s in seen[:-1]] == ["unknown"] * (len(seen) - 1), seen


def test_a_cut_link_drops_and_a_healed_one_answers(pool: list[SimHost], ns: netns.Netns) -> None:
    """The helper's own contract: a cut drops packets (a client waits for its timeout,
    where a refusal or "no route to host" would be a ConnectError), and heal restores."""
    agent = pool[0].agent_url
    assert httpx.get(f"{agent}/healthz", timeout=5).status_code == 200
    ns.cut()
    with pytest.raises(httpx.ConnectTimeout):
        httpx.get(f"{agent}/healthz", timeout=4)
    ns.heal()
    assert httpx.get(f"{agent}/healthz", timeout=5).status_code == 200


def test_a_store_behind_a_cut_link_is_told_within_the_hosts_timeout(
    pool: list[SimHost], ns: netns.Netns, tmp_path: Path
) -> None:
    """Reaching an agent takes no lock: a cut host's store is UNKNOWN within the host's
    own timeout (``timeout``), not the lock allowance a connected agent gets
    (``AGENT_STORE_TIMEOUT_S``). The error names the connect wait, so it cannot come
    from the longer read timeout."""
    from gpuctl.adapters.store import AGENT_STORE_TIMEOUT_S, store_for
    from gpuctl.config.values import HostConfig
    from gpuctl.errors import AgentUnavailable

    token = tmp_path / "token"
    token.write_text(pool[0].token)
    host = HostConfig(name="a", agent=pool[0].agent_url, token_file=token, timeout_s=1.0)
    with contextlib.closing(store_for(host)) as store:
        assert store.listing().records == []  # the address and token are right
    ns.cut()
    try:
        # A new command's store: a kept connection would wait for its read instead.
        with contextlib.closing(store_for(host)) as store, pytest.raises(AgentUnavailable) as e:
            store.listing()
    finally:
        ns.heal()
    assert AGENT_STORE_TIMEOUT_S > 1.0
    assert e.value.message.startswith("could not connect to the agent"), e.value.message
    assert e.value.message.endswith("within 1s"), e.value.message
