"""``gpuctl demo``: the whole story on a simulated GPU, in a few chapters.

The flow only sequences real processes and real status calls; what the user sees is
the narrator's job (the CLI gives it a Rich one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from gpuctl.config import load_config
from gpuctl.core.decision import Decision
from gpuctl.flows.simhost import SimHost, free_port
from gpuctl.flows.status import StatusReport, gather


class Narrator(Protocol):
    def chapter(self, title: str, text: str) -> None: ...
    def show(self, report: StatusReport) -> None: ...
    def watch(
        self,
        poll: Callable[[], StatusReport],
        until: Callable[[StatusReport], bool],
        timeout_s: float,
    ) -> StatusReport: ...


def decision_of(report: StatusReport, service: str) -> Decision | None:
    for h in report.hosts:
        for v in h.verdicts:
            if v.service == service:
                return v.decision
    return None


def run_demo(narrator: Narrator, *, load_time_s: float = 8.0) -> StatusReport:
    """Play the demo; returns the last report. Everything it starts is stopped on return."""
    vllm_port = free_port()
    with SimHost(gpu_memory="128GiB") as host:
        host.start_agent()
        cfg_path = host.write_config(
            f"""
[services.vllm]
health = "http://127.0.0.1:{vllm_port}/health"
match = ["vllm"]
memory = "80GiB"
priority = 100

[services.photos]
match = ["photo-batch"]
memory = "30GiB"
priority = 50

[services.trainer]
match = ["trainer"]
memory = "120GiB"
"""
        )
        config = load_config(cfg_path)

        def poll() -> StatusReport:
            return gather(config)

        narrator.chapter(
            "1. An idle GPU",
            f"A simulated 128 GiB GPU (like a DGX Spark) with its agent at {host.agent_url}.\n"
            "Nothing runs on it, so every service is IDLE: safe to start.",
        )
        report = poll()
        narrator.show(report)

        narrator.chapter(
            "2. Someone else's job",
            "ComfyUI (not managed by us) takes 20 GiB. gpuctl sees it at process level:\n"
            "vLLM's 80 GiB still FITS beside it; a 120 GiB trainer is BUSY, and gpuctl says who holds the GPU.",
        )
        host.hold("comfyui", "20GiB")
        report = narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.FITS, 10)

        narrator.chapter(
            "3. A model server loading",
            f"A fake vLLM starts: {load_time_s:.0f} s cold start, memory growing to 80 GiB, port bound but refusing\n"
            "connections, just like the real one. A memory-only check would call the GPU idle in its first\n"
            "seconds and start a second copy. gpuctl says LOADING from the first moment, before the GPU even\n"
            "sees the process, and counts the server at its full budget: the 30 GiB photo batch no longer fits.",
        )
        host.model_server("vllm", "80GiB", f"{load_time_s}s", vllm_port)
        narrator.watch(poll, lambda r: decision_of(r, "vllm") is Decision.LOADING, 10)
        report = narrator.watch(
            poll, lambda r: decision_of(r, "vllm") is Decision.READY, load_time_s + 30
        )

        narrator.chapter(
            "4. Ready",
            "vLLM answers its health check: READY. Scripts get the same picture from `gpuctl status --json`.\n"
            "Cleaning up: every process of the demo is stopped and its directory removed.",
        )
        time.sleep(0.2)
        return report
