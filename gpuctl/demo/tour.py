"""``gpuctl demo``: the whole story on a simulated GPU, in a few chapters.

The flow only sequences real processes and real status calls; what the user sees is
the narrator's job (the CLI gives it a Rich one).

The demo runs on a real machine beside other people's processes, and gpuctl counts a
host process whose command line holds a service's ``match`` keyword as that service
starting. With ``match = ["vllm"]``, anyone's ``vllm serve`` (or an editor on
``vllm.log``) made the first chapter show LOADING and BUSY where it promises IDLE. So every
keyword, and the name in the fake server's command line, carries a tag unique to the run
(``gpuctl-demo-<hex>-vllm``); the services keep their short names for the story.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import msgspec

from gpuctl.config import load_config
from gpuctl.core.decision import Decision
from gpuctl.demo.chapters import LOAD_TIME_S, heading
from gpuctl.demo.priority import IDLE_S, decision_of, photos_toml, priority_chapter
from gpuctl.errors import GpuctlError
from gpuctl.flows.status import StatusReport
from gpuctl.sim.host import SimHost, SimHostError, free_port
from gpuctl.wiring.build import gather_status


class Narrator(Protocol):
    def chapter(self, title: str, text: str) -> None:
        """``text``: a paragraph a line, each wrapped by the narrator; a newline is kept
        (a summary says one thing a line), so prose is not broken by hand."""
        ...

    def show(self, report: StatusReport) -> None: ...
    def watch(
        self,
        poll: Callable[[], StatusReport],
        until: Callable[[StatusReport], bool],
        timeout_s: float,
    ) -> StatusReport: ...
    def results(self, rows: list[dict[str, Any]]) -> None: ...
    def missed(self, text: str) -> None:
        """Say plainly that something a chapter promised did not happen."""
        ...

    def locks(self, config_path: str) -> None: ...
    def events(self, config_path: str, since: float) -> int:
        """Print the journal of the run since ``since``; returns how many events."""
        ...


class DemoResult(msgspec.Struct, frozen=True):
    """The last report, and what the chapters promised and did not see happen."""

    report: StatusReport
    missed: tuple[str, ...]


def intro(agent_url: str) -> str:
    """Chapter 1's text: the idle GPU, then what the tour will show (every chapter that
    follows; no decision named, the first panel shows only IDLE)."""
    return (
        f"A simulated 128 GiB GPU (like a DGX Spark) with its agent at {agent_url}. "
        "Nothing runs on it, so every service is IDLE: safe to start. Then: someone else's "
        "job on it; three callers racing to start one server; the record they share; "
        "priorities, as the chat preempts a photo batch that later resumes; and a chat "
        "request through `gpuctl proxy` that starts the stopped server."
    )


def demo_tag() -> str:
    """A tag no process outside this run has in its command line."""
    return f"gpuctl-demo-{secrets.token_hex(4)}"


def run_demo(narrator: Narrator, *, load_time_s: float = LOAD_TIME_S) -> DemoResult:
    """Play the demo. Each chapter checks what it promised; what did not happen is said
    in that chapter and returned. Everything it starts is stopped on return."""
    missed: list[str] = []

    def claim(ok: bool, text: str) -> None:
        if not ok:
            narrator.missed(text)
            missed.append(text)

    vllm_port = free_port()
    tag = demo_tag()
    began = time.time()
    with SimHost(gpu_memory="128GiB") as host:
        server = (
            f"{sys.executable} -m gpuctl sim model-server --name {tag}-vllm --memory 80GiB "
            f"--load-time {load_time_s}s --port {vllm_port} --sim-dir {host.sim_dir} --model qwen"
        )
        try:
            host.start_agent()
        except SimHostError as e:
            raise GpuctlError(e.message, hint=e.hint) from None
        cfg_path = host.write_config(
            f"""
[services.vllm]
launcher = "process"
command = "{server}"
health = "http://127.0.0.1:{vllm_port}/health"
match = ["{tag}-vllm"]
memory = "80GiB"
priority = 100
idle_timeout = "{IDLE_S:g}s"
models = ["qwen"]

{photos_toml(tag, free_port(), host.base / "photos", host.sim_dir)}

[services.trainer]
match = ["{tag}-trainer"]
memory = "120GiB"

[proxy]
sse_interval = "1s"
"""
        )
        config = load_config(cfg_path)

        def poll() -> StatusReport:
            return gather_status(config)

        narrator.chapter(
            heading(1),
            intro(host.agent_url),
        )
        report = poll()
        narrator.show(report)
        idle = {s: decision_of(report, s) for s in ("vllm", "photos", "trainer")}
        claim(
            all(d is Decision.IDLE for d in idle.values()),
            "not every service is IDLE: " + ", ".join(f"{s} {d}" for s, d in idle.items()),
        )

        narrator.chapter(
            heading(2),
            "ComfyUI (not managed by us) takes 20 GiB. gpuctl sees it at process level: "
            "vLLM's 80 GiB still FITS beside it; a 120 GiB trainer is BUSY, and gpuctl says who holds the GPU.",
        )
        comfyui = host.hold("comfyui", "20GiB")
        report = narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.FITS, 10)
        claim(
            decision_of(report, "vllm") is Decision.FITS
            and decision_of(report, "trainer") is Decision.BUSY,
            f"vllm is {decision_of(report, 'vllm')} and the trainer "
            f"{decision_of(report, 'trainer')}, not FITS and BUSY",
        )

        narrator.chapter(
            heading(3),
            "Three `gpuctl ensure vllm` start at the same moment, as a chat app, a cron job and a "
            f"user would. The fake vLLM takes {load_time_s:.0f} s to load: its port is bound but refuses "
            "connections, its memory grows to 80 GiB. One caller takes the lease and launches it "
            "(detached: it outlives its caller); the others see LOADING and wait. gpuctl counts the "
            "loading server at its full budget, so the 30 GiB photo batch no longer fits.",
        )
        env = {**os.environ, "GPUCTL_CONFIG": str(cfg_path)}
        callers = [
            subprocess.Popen(
                [sys.executable, "-m", "gpuctl", "ensure", "vllm", "--json"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for _ in range(3)
        ]
        try:
            narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.LOADING, 15)
            report = narrator.watch(
                poll, lambda r: decision_of(r, "vllm") is Decision.READY, load_time_s + 60
            )
            rows = []
            deadline = time.monotonic() + load_time_s + 60
            for i, c in enumerate(callers, 1):
                try:
                    out, _ = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.communicate()
                    rows.append({"caller": i, "exit": "-", "reason": "still waiting; stopped"})
                    continue
                try:
                    data = json.loads(out) if out.strip() else {}
                except ValueError:
                    data = {"reason": "no JSON answer"}
                rows.append({"caller": i, "exit": c.returncode, **data})
        finally:
            for c in callers:
                if c.poll() is None:
                    c.kill()
                    c.communicate()
        narrator.results(rows)
        launches = sum(1 for r in rows if r.get("launched"))
        claim(launches == 1, f"{launches} launches for 3 callers, not 1")
        claim(
            decision_of(report, "vllm") is Decision.READY,
            f"vLLM did not become READY ({decision_of(report, 'vllm')})",
        )

        narrator.chapter(
            heading(4),
            "`gpuctl locks` reads the record every entry point shares on the GPU host: "
            "one start attempt, the server running, when it was last used.",
        )
        narrator.locks(str(cfg_path))
        subprocess.run(
            [sys.executable, "-m", "gpuctl", "stop", "vllm"],
            env=env,
            capture_output=True,
            check=False,
        )
        missed += priority_chapter(
            narrator,
            title=heading(5),
            env=env,
            poll=poll,
            items=host.base / "photos",
            load_time_s=load_time_s,
        )
        missed += _proxy_chapter(
            narrator,
            host,
            cfg_path=cfg_path,
            poll=poll,
            comfyui=comfyui,
            load_time_s=load_time_s,
        )
        subprocess.run(
            [sys.executable, "-m", "gpuctl", "stop", "vllm"],
            env=env,
            capture_output=True,
            check=False,
        )
        narrator.chapter(
            heading(7),
            "Every decision above was written to the host's journal as it was made: who "
            "started what, who was refused and why, what was preempted and by whom. "
            "`gpuctl events` reads it back (`gpuctl usage` adds it up).",
        )
        claim(narrator.events(str(cfg_path), began) > 0, "the journal holds no event of the run")
        narrator.chapter(
            heading(8),
            "Cleaning up: every process of the demo is stopped and its directory removed.",
        )
        return DemoResult(report, tuple(missed))


def _proxy_chapter(
    narrator: Narrator,
    host: SimHost,
    *,
    cfg_path: Any,
    poll: Callable[[], StatusReport],
    comfyui: subprocess.Popen[bytes],
    load_time_s: float,
) -> list[str]:
    """A chat request through ``gpuctl proxy`` to the stopped server, watched as it comes up.
    Returns what did not happen (no answer), in a sentence."""

    host.stop(comfyui)
    proxy_port = free_port()
    proxy = host.spawn(
        ["proxy", "--listen", f"127.0.0.1:{proxy_port}"], "proxy", {"GPUCTL_CONFIG": str(cfg_path)}
    )
    url = f"http://127.0.0.1:{proxy_port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proxy.poll() is not None or time.monotonic() > deadline:
            raise GpuctlError(f"gpuctl proxy did not start: {host.log_tail('proxy')}")
        time.sleep(0.1)
    narrator.chapter(
        heading(6),
        f"ComfyUI is gone and vLLM is stopped. `gpuctl proxy` listens at {url}; an app sends "
        "it an OpenAI chat request for model 'qwen' (vllm's `models`), streaming. The proxy "
        "runs the same ensure as the CLI, holds the request while the server loads (sending "
        "': loading …' comments so the client does not time out), then streams the answer.",
    )
    lines: list[str] = []
    failure: list[str] = []

    def ask() -> None:
        body = {
            "model": "qwen",
            "stream": True,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": "hello"}],
        }
        try:
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=body, timeout=load_time_s + 60
            ) as r:
                lines.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as e:
            failure.append(f"{type(e).__name__}: {e}")

    client = threading.Thread(target=ask, daemon=True)
    client.start()
    # Shown from the moment the proxy's start is under way: the idle GPU before it
    # looks as chapter 1 did.
    until = time.monotonic() + 15
    while decision_of(poll(), "vllm") is not Decision.LOADING and time.monotonic() < until:
        time.sleep(0.05)
    narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.READY, load_time_s + 60)
    client.join(load_time_s + 60)
    comments = [ln for ln in lines if ln.startswith(":")]
    words = []
    for ln in lines:
        if ln.startswith("data: {"):
            try:
                event = json.loads(ln[6:])
                if "error" in event:
                    failure.append(str(event["error"].get("message")))
                    continue
                words.append(str(event["choices"][0]["delta"].get("content") or ""))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                continue
    shown = [*comments[:2], *(["…"] if len(comments) > 3 else []), *comments[-1:]]
    text = " · ".join(dict.fromkeys(shown)) if comments else "(answered at once)"
    answer = "".join(words).strip() or ("; ".join(failure) or "no answer")
    narrator.chapter(
        "   what the client saw",
        f"{text}\nthe answer: {answer}",
    )
    if words and not failure:
        return []
    narrator.missed("the chat request got no answer through the proxy")
    return ["the chat request got no answer through the proxy"]
