"""``gpuctl demo``'s chapter on priorities: the chat LLM preempts the photo batch, and
the batch resumes from its checkpoint once the LLM has been reclaimed.

The photo batch is ``gpuctl.sim.batch``: it works through a folder of items and
checkpoints each, so the chapter can show that none was done twice or lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gpuctl.core.decision import Decision
from gpuctl.flows.status import StatusReport


class Narrator(Protocol):
    """What the chapter uses of ``gpuctl.demo.tour.Narrator``."""

    def chapter(self, title: str, text: str) -> None: ...
    def watch(
        self,
        poll: Callable[[], StatusReport],
        until: Callable[[StatusReport], bool],
        timeout_s: float,
    ) -> StatusReport: ...
    def results(self, rows: list[dict[str, Any]]) -> None: ...
    def missed(self, text: str) -> None:
        """Say plainly that something the chapter promised did not happen."""
        ...


def decision_of(report: StatusReport, service: str) -> Decision | None:
    for h in report.hosts:
        for v in h.verdicts:
            if v.service == service:
                return v.decision
    return None


# The batch's photos and the time each takes: 24 s for the whole batch, so that the two
# `gpuctl ensure vllm` calls catch it mid-way even on a loaded machine (on a 2-core host
# at load 14 a batch of 6 s was done before the second of them, and beside a test suite's
# heaviest minute one of 12 s was: the two calls took 13 s; nothing was preempted).
# What is left after the resume takes the rest of the 24 s.
ITEMS = 240
PER_ITEM = "100ms"
# vLLM's idle_timeout in the demo's config: reclaim stops it once idle this long.
IDLE_S = 1.0


def photos_toml(tag: str, port: int, items: Path, sim_dir: Path) -> str:
    """The demo's photo batch as a managed, resumable service."""
    items.mkdir(parents=True, exist_ok=True)
    for i in range(ITEMS):
        (items / f"photo{i:03d}.jpg").write_text(f"photo {i}\n")
    cmd = (
        f"{sys.executable} -m gpuctl.sim.batch --name {tag}-photos --memory 30GiB "
        f"--items {items} --port {port} --per-item {PER_ITEM} --sim-dir {sim_dir}"
    )
    return f"""
[services.photos]
launcher = "process"
command = {json.dumps(cmd)}
health = "http://127.0.0.1:{port}/health"
match = ["{tag}-photos"]
memory = "30GiB"
priority = 50
resume = true
kind = "batch"
idle_timeout = "never"
stop_timeout = "5s"
"""


def priority_chapter(
    narrator: Narrator,
    *,
    title: str,
    env: dict[str, str],
    poll: Callable[[], StatusReport],
    items: Path,
    load_time_s: float,
) -> list[str]:
    """Play the chapter; leaves vLLM and the batch stopped. Returns what it promised and
    did not see happen, each in a sentence (none when the story held)."""

    def gpuctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuctl", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    log = items / ".done.log"

    def done() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    narrator.chapter(
        title,
        f"The photo batch (30 GiB, priority 50, resume = true) works through {ITEMS} photos, "
        "checkpointing each. ComfyUI still holds 20 GiB, so vLLM (80 GiB, priority 100) fits "
        "only if the batch stops: PREEMPTABLE. A plain `gpuctl ensure vllm` says so and exits 3; "
        "`gpuctl ensure vllm --preempt` stops the batch (marked preempted), waits for its memory "
        "and starts vLLM once. When vLLM has sat idle past its idle_timeout, `gpuctl reclaim` "
        "stops it and resumes the batch from its checkpoint.",
    )

    def missed(text: str) -> list[str]:
        narrator.missed(text)
        gpuctl("stop", "photos")
        gpuctl("stop", "vllm")
        return [text]

    gpuctl("ensure", "photos")
    shown = narrator.watch(poll, lambda r: decision_of(r, "photos") is Decision.READY, 30)
    if decision_of(shown, "photos") is not Decision.READY:
        return missed(f"the photo batch did not start (it is {decision_of(shown, 'photos')})")
    until = time.monotonic() + 30
    while done() < 5 and time.monotonic() < until:
        time.sleep(0.05)
    rows: list[dict[str, Any]] = []
    for caller, args in (("ensure vllm", ()), ("ensure vllm --preempt", ("--preempt",))):
        r = gpuctl("ensure", "vllm", "--json", *args, timeout=load_time_s + 60)
        try:
            data = json.loads(r.stdout) if r.stdout.strip() else {}
        except ValueError:
            data = {"reason": "no JSON answer"}
        rows.append({"caller": caller, "exit": r.returncode, **data})
    narrator.results(rows)
    at_preemption = done()
    plain, forced = rows
    if plain["exit"] != 3 or plain.get("decision") != "PREEMPTABLE":
        return missed(
            "the plain `ensure vllm` was not refused as PREEMPTABLE "
            f"(exit {plain['exit']}, {plain.get('decision', 'no decision')})"
        )
    if not forced.get("launched"):
        return missed(
            f"`ensure vllm --preempt` launched nothing (exit {forced['exit']}): nothing was "
            "preempted, so there is nothing to resume"
        )
    shown = narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.READY, 30)
    if decision_of(shown, "vllm") is not Decision.READY:
        return missed(
            f"vLLM did not become READY after the preemption ({decision_of(shown, 'vllm')})"
        )
    time.sleep(IDLE_S)
    said: list[str] = []
    until = time.monotonic() + 30
    while time.monotonic() < until:
        r = gpuctl("reclaim")
        said += [ln for ln in r.stdout.splitlines() if ln.strip()]
        if any(ln.startswith("resumed photos") for ln in said):
            break
        time.sleep(0.25)
    if not any(ln.startswith("resumed photos") for ln in said):
        narrator.chapter("   what reclaim did", "\n".join(said) or "(nothing)")
        return missed("reclaim did not resume the photo batch")
    narrator.watch(poll, lambda r: decision_of(r, "photos") is Decision.READY, 30)
    until = time.monotonic() + 60
    while done() < ITEMS and time.monotonic() < until:
        time.sleep(0.05)
    lines = log.read_text().splitlines() if log.exists() else []
    twice = len(lines) - len(set(lines))
    narrator.chapter(
        "   what reclaim did",
        "\n".join(said) + f"\nphotos done before the preemption: {at_preemption}; after resuming: "
        f"{len(set(lines))} of {ITEMS}, {twice} done twice.",
    )
    gpuctl("stop", "photos")
    gpuctl("stop", "vllm")
    out = []
    if at_preemption >= ITEMS:
        out.append(f"the batch had finished all {ITEMS} photos before vLLM preempted it")
    if len(set(lines)) < ITEMS:
        out.append(f"the resumed batch did only {len(set(lines))} of {ITEMS} photos")
    if twice:
        out.append(f"{twice} photos were done twice: the checkpoint did not hold")
    for text in out:
        narrator.missed(text)
    return out
