"""Table tests of the pure decision (DESIGN §4)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuctl.core.decision import NO_HEALTH, Decision, Health, classify, committed_memory
from gpuctl.core.model import GpuProcess, Snapshot, StartingProcess

GiB = 1024


@dataclass(frozen=True)
class Spec:
    name: str
    memory_mib: int | None = None
    priority: int = 50
    match: tuple[str, ...] = ()
    health_timeout_s: float = 600.0

    @property
    def keywords(self) -> tuple[str, ...]:
        return self.match or (self.name,)


VLLM = Spec("vllm", 80 * GiB, 100, ("vllm", "translategemma"))
VLM = Spec("vlm", 30 * GiB, 50, ("photo-batch",))
WHISPER = Spec("whisper", 15 * GiB, 40)
NOBUDGET = Spec("legacy", None)
SPECS = [VLLM, VLM, WHISPER, NOBUDGET]

READY = Health("ready", "http://x/health", 200)
REFUSED = Health("refused", "connection refused at http://x/health")


def snap(
    *procs: GpuProcess, starting: tuple[StartingProcess, ...] = (), total: int | None = 128 * GiB
) -> Snapshot:
    used = sum(p.memory_mib or 0 for p in procs)
    return Snapshot(used, total, False, "sim", "t", tuple(procs), starting)


def p(pid: int, cmd: str | None, gib: float | None) -> GpuProcess:
    return GpuProcess(pid, cmd, None if gib is None else int(gib * GiB))


COMFY = p(10, "python main.py --listen comfyui", 20)
COMFY_BIG = p(11, "python main.py comfyui", 60)
VLLM_LOADING = p(20, "python -m vllm.entrypoints.openai.api_server", 8)
VLM_RUN = p(30, "python photo-batch.py", 10)
HIDDEN = p(40, None, 5)

CASES = [
    # (id, spec, health, snapshot, expected decision, words in the reason)
    ("ready beats everything", VLLM, READY, snap(COMFY_BIG), Decision.READY, ["health check"]),
    ("ready while agent down", VLLM, READY, None, Decision.READY, ["health check"]),
    ("unknown when agent down", VLLM, REFUSED, None, Decision.UNKNOWN, ["refused"]),
    ("idle", VLLM, REFUSED, snap(), Decision.IDLE, ["no process"]),
    ("loading on gpu", VLLM, REFUSED, snap(VLLM_LOADING), Decision.LOADING, ["pid 20"]),
    (
        "loading before the gpu sees it",
        VLLM,
        REFUSED,
        snap(starting=(StartingProcess(21, "vllm serve Qwen"),)),
        Decision.LOADING,
        ["pid 21", "not on the GPU yet"],
    ),
    (
        "second keyword",
        VLLM,
        REFUSED,
        snap(p(22, "python translategemma.py", 1)),
        Decision.LOADING,
        ["pid 22"],
    ),
    (
        "fits beside comfyui",
        VLLM,
        REFUSED,
        snap(COMFY),
        Decision.FITS,
        ["needs 80.0 GiB", "pid 10"],
    ),
    (
        "busy beside big comfyui",
        VLLM,
        REFUSED,
        snap(COMFY_BIG),
        Decision.BUSY,
        ["pid 11", "comfyui", "60.0 GiB"],
    ),
    (
        "no budget: any process is busy",
        NOBUDGET,
        NO_HEALTH,
        snap(p(50, "small", 0.1)),
        Decision.BUSY,
        ["pid 50"],
    ),
    ("no budget: idle is idle", NOBUDGET, NO_HEALTH, snap(), Decision.IDLE, []),
    (
        "an old process that only mentions the name is not loading",
        VLLM,
        REFUSED,
        snap(starting=(StartingProcess(24, "tail -f /var/log/vllm.log", age_s=86400.0),)),
        Decision.IDLE,
        ["no process"],
    ),
    (
        "a young one is",
        VLLM,
        REFUSED,
        snap(starting=(StartingProcess(25, "vllm serve Qwen", age_s=30.0),)),
        Decision.LOADING,
        ["pid 25"],
    ),
    # vlm holds 10 GiB now but will grow to its 30 GiB budget: 30 + 80 = 110 <= 128 fits ...
    (
        "loading service counts at budget (fits)",
        VLLM,
        REFUSED,
        snap(VLM_RUN),
        Decision.FITS,
        ["98.0 GiB"],
    ),
    # ... but with comfyui's 20 GiB also there, 20 + 30 + 80 = 130 > 128 does not.
    (
        "loading service counts at budget (busy)",
        VLLM,
        REFUSED,
        snap(VLM_RUN, COMFY),
        Decision.BUSY,
        ["only 78.0 GiB"],
    ),
    (
        "a starting service counts at its budget",
        VLLM,
        REFUSED,
        snap(COMFY, starting=(StartingProcess(31, "python photo-batch.py"),)),
        Decision.BUSY,
        [],
    ),
    (
        "another service starting is not idle",
        VLM,
        REFUSED,
        snap(starting=(StartingProcess(23, "vllm serve x"),)),
        Decision.FITS,
        ["48.0 GiB"],
    ),
    (
        "hidden command stays busy",
        VLLM,
        REFUSED,
        snap(HIDDEN, COMFY_BIG),
        Decision.BUSY,
        ["not visible"],
    ),
    (
        "unknown total",
        VLLM,
        REFUSED,
        snap(COMFY, total=None),
        Decision.BUSY,
        ["total memory unknown"],
    ),
    (
        "503 while process alive is not ready",
        VLLM,
        Health("error", "HTTP 503", 503),
        snap(VLLM_LOADING),
        Decision.LOADING,
        ["503"],
    ),
]


@pytest.mark.parametrize(
    ("case", "spec", "health", "snapshot", "expected", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_classify(
    case: str,
    spec: Spec,
    health: Health,
    snapshot: Snapshot | None,
    expected: Decision,
    words: list[str],
) -> None:
    v = classify(
        spec,
        health,
        snapshot,
        others=SPECS,
        agent_error="agent at http://dgx:9400 refused the connection",
    )
    assert v.decision is expected, v.reason
    for w in words:
        assert w in v.reason


def test_total_override_for_unified_memory() -> None:
    v = classify(VLLM, REFUSED, snap(COMFY, total=None), others=SPECS, total_override_mib=128 * GiB)
    assert v.decision is Decision.FITS
    assert v.free_mib == 108 * GiB


def test_busy_names_the_holders() -> None:
    v = classify(VLLM, REFUSED, snap(COMFY_BIG, COMFY), others=SPECS)
    assert v.decision is Decision.BUSY
    assert {h.pid for h in v.holders} == {10, 11}


def test_committed_memory_counts_budget_once_per_service() -> None:
    two_workers = snap(p(1, "vllm worker 1", 30), p(2, "vllm worker 2", 30))
    used, holders = committed_memory(two_workers, SPECS, exclude=VLM)
    assert used == 80 * GiB  # max(60 measured, 80 budget), not 160
    assert len(holders) == 2


def test_unknown_process_memory_counts_zero_but_is_named() -> None:
    v = classify(WHISPER, REFUSED, snap(p(9, "mystery", None)), others=SPECS)
    assert v.decision is Decision.FITS
    assert "pid 9" in v.reason


def test_another_service_mid_start_counts_at_its_budget() -> None:
    """vllm holds its lease, its server not even spawned yet: vlm must not start into its memory."""
    idle = snap()
    assert classify(VLM, REFUSED, idle, others=SPECS).decision is Decision.IDLE
    v = classify(VLM, REFUSED, idle, others=SPECS, leased=["vllm"])
    assert v.decision is Decision.FITS and v.free_mib == 48 * GiB and "vllm (starting)" in v.reason
    big = Spec("big", 60 * GiB)
    v = classify(big, REFUSED, idle, others=[*SPECS, big], leased=["vllm"])
    assert v.decision is Decision.BUSY


def test_a_recorded_server_is_its_service_whatever_its_command() -> None:
    """`services.chat` runs `vllm serve …`: no keyword of "chat" in it, but its launcher
    recorded the pid. Loading, it holds 8 GiB; it will grow to 80."""
    chat = Spec("chat", 80 * GiB, match=("chat",))
    other = Spec("other", 80 * GiB, match=("other",))
    specs = [chat, other]
    loading = snap(p(70, "vllm serve Qwen/Qwen3-32B", 8))
    servers = {70: "chat"}
    v = classify(chat, REFUSED, loading, others=specs, servers=servers)
    assert v.decision is Decision.LOADING and "pid 70" in v.reason
    # Without the record, the other 80 GiB service would be let in beside it: OOM.
    assert classify(other, REFUSED, loading, others=specs).decision is Decision.FITS
    v = classify(other, REFUSED, loading, others=specs, servers=servers)
    assert v.decision is Decision.BUSY and "only 48.0 GiB" in v.reason
    # Not on the GPU yet: a recorded pid counts at any age.
    early = snap(starting=(StartingProcess(71, "python serve.py", age_s=10_000.0),))
    assert (
        classify(chat, REFUSED, early, others=specs, servers={71: "chat"}).decision
        is Decision.LOADING
    )
    # ... and at its budget for the others: 80 + 80 > 128.
    assert (
        classify(other, REFUSED, early, others=specs, servers={71: "chat"}).decision
        is Decision.BUSY
    )
