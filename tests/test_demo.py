"""``gpuctl demo`` as a newcomer runs it: piped (CI, ``| less``), beside someone else's
processes whose command lines hold the words the demo's services are about."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuctl.demo.chapters import CHAPTERS, heading
from gpuctl.demo.priority import ITEMS
from tests.conftest import gpuctl_exe

pytestmark = pytest.mark.e2e

SERVICES = ("vllm", "photos", "trainer")
DECISION = re.compile(r"^│ (vllm|photos|trainer) +([A-Z]+) ", re.MULTILINE)


@pytest.fixture
def foreign_vllm() -> Iterator[subprocess.Popen[bytes]]:
    """Another user's model server, as far as its command line goes: it names vllm and the
    words the demo's other services once matched on."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
            "vllm",
            "serve",
            "photo-batch",
            "trainer",
        ]
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def panels(out: str) -> list[tuple[tuple[str, str], ...]]:
    """Each status panel the demo printed, as its (service, decision) rows."""
    found = []
    for panel in out.split("╭─")[1:]:
        body = panel.split("╰─")[0]
        found.append(tuple(DECISION.findall(body)))
    return found


def demo_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_") and k != "COLUMNS"}
    env.update(
        NO_COLOR="1",
        TERM="dumb",
        HOME=str(tmp_path),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_STATE_HOME=str(tmp_path / "state"),
    )
    return env


@pytest.mark.slow
def test_demo_piped_beside_a_foreign_vllm(
    foreign_vllm: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    env = demo_env(tmp_path)
    r = subprocess.run(
        [gpuctl_exe(), "demo", "--load-time", "2s"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr
    # Every chapter `gpuctl demo --help` lists is played, in order.
    at = [out.find(heading(n)) for n in range(1, len(CHAPTERS) + 1)]
    assert -1 not in at and at == sorted(at), at
    assert foreign_vllm.poll() is None  # the foreign process was there all along

    shown = panels(out)
    assert all(len(p) == len(SERVICES) for p in shown), shown
    # Chapter 1 promises IDLE for every service, foreign vllm or not.
    assert shown[0] == tuple((s, "IDLE") for s in SERVICES), out.split("2. ")[0]
    chapter1 = out.split("2. Someone else")[0]
    assert "LOADING" not in chapter1 and "BUSY" not in chapter1
    # Piped, each state is printed once: no panel repeats the one before it (a later
    # chapter may come back to an earlier state, the proxy's READY after LOADING say).
    repeats = [i for i in range(1, len(shown)) if shown[i] == shown[i - 1]]
    assert not repeats, shown
    decisions = [dict(p) for p in shown]
    assert decisions[1]["vllm"] == "FITS" and decisions[1]["trainer"] == "BUSY"
    assert any(d["vllm"] == "LOADING" for d in decisions)
    assert decisions[-1]["vllm"] == "READY"
    assert "1 launch for 3 callers." in out
    # The priorities chapter: PREEMPTABLE without --preempt (exit 3), one launch with it;
    # reclaim stops the idle vLLM and resumes the batch, every photo done once.
    prio = out.split("5. Priorities")[1].split("6. A chat request")[0]
    assert "PREEMPTABLE" in prio and "1 launch for 2 callers." in prio
    assert "stopped vllm on sim" in prio and "resumed photos on sim" in prio
    assert f"after resuming: {ITEMS} of {ITEMS}, 0 done twice." in " ".join(prio.split())
    # The summary says one action a line (its lines ran together into one paragraph).
    said = prio.split("what reclaim did")[1]
    assert re.search(r"^stopped vllm on sim: idle ", said, re.MULTILINE), said
    assert re.search(r"^resumed photos on sim: ", said, re.MULTILINE), said
    assert re.search(r"^photos done before the preemption: ", said, re.MULTILINE), said
    # The proxy chapter: a chat request to the stopped server, held through its start.
    proxy_part = out.split("6. A chat request to a stopped server")[1]
    assert ": loading" in proxy_part or "(answered at once)" not in proxy_part
    # Rich wraps the answer at the terminal's width (and may keep a space before the break).
    assert "This is a simulated reply from qwen" in " ".join(proxy_part.split())
    assert re.search(r"^the answer: This is", proxy_part, re.MULTILINE), proxy_part
    # The demo ends with the journal of its own run: who did what, and why.
    story = out.split("7. The GPU's story")[1].split("8. Done")[0]
    assert re.search(r"photos preempted by vllm — priority 100", story), story
    assert "vllm stopped: idle" in story and "photos resumed" in story
    assert "proxy" in story  # the proxy's cold start, and who asked through it
    # The foreign process never appears as one of the demo's services' processes.
    assert str(foreign_vllm.pid) not in out
    last = [ln for ln in out.splitlines() if ln.strip()][-1]
    assert "gpuctl config init" in last
    assert "did not happen" not in out


@pytest.mark.slow
def test_a_demo_whose_preemption_did_not_happen_says_so_and_fails(tmp_path: Path) -> None:
    """Under load the preemption once preempted nothing, and the demo still printed
    "after resuming: N of N" and "Demo done". Here `ensure vllm --preempt` dies before
    it takes a lease (a failpoint), as a caller killed by the OOM killer would."""
    env = demo_env(tmp_path)
    env["GPUCTL_FAILPOINTS"] = "preempt.before_leases=kill"
    r = subprocess.run(
        [gpuctl_exe(), "demo", "--load-time", "2s"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = " ".join(r.stdout.split())
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    assert "✗ did not happen: `ensure vllm --preempt` launched nothing" in out, out
    assert "nothing was preempted" in out
    assert "after resuming" not in out and "Demo done" not in out
    assert "The demo did not show everything it promised (1 missed" in out, out
    # The other chapters still played, and held.
    assert heading(6) in r.stdout and heading(8) in r.stdout
