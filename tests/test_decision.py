"""Table tests of the pure decision (docs/explanation/decisions.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuctl.core.decision import NO_HEALTH, Decision, Health, classify, committed_memory
from gpuctl.core.snapshot import GpuProcess, Snapshot, StartingProcess

GiB = 1024


@dataclass(frozen=True)
class Spec:
    name: str
    memory_mib: int | None = None
    priority: int = 50
    match: tuple[str, ...] = ()
    health_timeout_s: float = 600.0
    devices: tuple[int, ...] | None = None

    @property
    def keywords(self) -> tuple[str, ...]:
        return self.match or (self.name,)

    @property
    def default_match(self) -> bool:
        return not self.match


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


def test_a_keyword_match_names_its_command_and_may_not_be_ours() -> None:
    """Someone's `python3 -c … vllm serve …` not on the GPU yet: the reason names its short
    command (secrets redacted, cut), and the hint says how to stop it counting, since only
    a keyword says it is the service's. A recorded server gets no such hint."""
    cmd = "/opt/venv/bin/python3 -c import x vllm serve --api-key s3cr3t " + "x" * 200
    early = snap(starting=(StartingProcess(29519, cmd, age_s=5.0),))
    v = classify(VLLM, REFUSED, early)
    assert v.decision is Decision.LOADING
    assert "pid 29519 starting (not on the GPU yet): python3 -c import x vllm serve" in v.reason
    assert "s3cr3t" not in v.reason and "…" in v.reason and len(v.reason) < 160
    assert "not yours? narrow the service's `match` keywords" in v.hint
    recorded = classify(VLLM, REFUSED, early, servers={29519: "vllm"})
    assert recorded.decision is Decision.LOADING and recorded.hint == ""


# --- per GPU (issue: memory is per GPU, not summed) ------------------------------------

from gpuctl.core.decision import gpu_rooms  # noqa: E402
from gpuctl.core.snapshot import GpuDevice  # noqa: E402


def gp(pid: int, cmd: str | None, gib: float | None, gpu: int, on_gpu: bool = True) -> GpuProcess:
    mem = None if gib is None else int(gib * GiB)
    return GpuProcess(pid, cmd, mem, gpu=gpu, on_gpu=on_gpu)


def multi(
    *procs: GpuProcess,
    used: tuple[float | None, ...] | None = None,
    totals: tuple[int | None, ...] = (80 * GiB, 80 * GiB),
    errors: tuple[str | None, ...] | None = None,
    starting: tuple[StartingProcess, ...] = (),
) -> Snapshot:
    """A host of len(totals) GPUs; a GPU's used memory defaults to what its processes hold."""
    devices = []
    for i, total in enumerate(totals):
        if errors and errors[i]:
            devices.append(GpuDevice(i, error=errors[i]))
            continue
        u = (
            sum(p.memory_mib or 0 for p in procs if p.gpu == i)
            if used is None or used[i] is None
            else int(used[i] * GiB)  # type: ignore[operator]
        )
        devices.append(GpuDevice(i, u, total))
    return Snapshot(
        sum(d.memory_used_mib or 0 for d in devices),
        sum(d.memory_total_mib or 0 for d in devices),
        False,
        "nvml",
        "t",
        tuple(procs),
        starting,
        gpus=len(devices),
        devices=tuple(devices),
    )


PINNED0 = Spec("pinned0", 60 * GiB, match=("pinned0",), devices=(0,))
PINNED1 = Spec("pinned1", 60 * GiB, match=("pinned1",), devices=(1,))
SIXTY = Spec("sixty", 60 * GiB, match=("sixty",))
THIRTY = Spec("thirty", 30 * GiB, match=("thirty",))
ALL = [VLLM, VLM, PINNED0, PINNED1, SIXTY, THIRTY]

A70_B10 = multi(gp(1, "comfyui", 70, 0), gp(2, "encode", 10, 1))

# (id, spec, snapshot, decision, gpu, words in the reason)
GPU_CASES = [
    # The reported case: 70 and 10 GiB used on two 80 GiB GPUs is not "80 of 160 free".
    (
        "80 GiB fits on no single GPU",
        VLLM,
        A70_B10,
        Decision.BUSY,
        None,
        ["only 70.0 GiB", "any GPU", "most on GPU 1"],
    ),
    (
        "60 GiB fits on the emptier GPU",
        SIXTY,
        A70_B10,
        Decision.FITS,
        1,
        ["on GPU 1", "70.0 GiB of 80.0 GiB"],
    ),
    (
        "pinned to the full GPU is busy",
        PINNED0,
        A70_B10,
        Decision.BUSY,
        None,
        ["only 10.0 GiB", "comfyui"],
    ),
    ("pinned to the free GPU fits", PINNED1, A70_B10, Decision.FITS, 1, ["on GPU 1"]),
    (
        "best fit keeps the roomy GPU whole",
        THIRTY,
        multi(gp(1, "a", 40, 0), gp(2, "b", 1, 1)),
        Decision.FITS,
        0,
        ["on GPU 0", "40.0 GiB of 80.0 GiB"],
    ),
    ("idle host names a GPU", THIRTY, multi(), Decision.IDLE, 0, ["no process"]),
    # MIG / another PID namespace: the device says 30 GiB used, no process accounts for it.
    (
        "unattributed memory counts",
        VLLM,
        multi(gp(5, "python train.py", None, 0), used=(30, None), totals=(80 * GiB,)),
        Decision.BUSY,
        None,
        ["only 50.0 GiB", "30.0 GiB no process accounts for"],
    ),
    (
        "unattributed memory on an idle-looking GPU counts",
        VLLM,
        multi(used=(30, None), totals=(80 * GiB,)),
        Decision.BUSY,
        None,
        ["only 50.0 GiB"],
    ),
    (
        "beside unattributed memory what fits fits",
        THIRTY,
        multi(gp(5, "python train.py", None, 0), used=(30, None), totals=(80 * GiB,)),
        Decision.FITS,
        0,
        ["50.0 GiB of 80.0 GiB"],
    ),
    # One bad GPU: what may land on it is UNKNOWN, the rest is decided as usual.
    (
        "unpinned with a lost GPU is unknown",
        THIRTY,
        multi(gp(2, "encode", 10, 1), errors=(None, "GPU is lost")),
        Decision.UNKNOWN,
        None,
        ["GPU 1 cannot be read", "GPU is lost"],
    ),
    (
        "pinned to the lost GPU is unknown",
        PINNED1,
        multi(errors=(None, "no permission")),
        Decision.UNKNOWN,
        None,
        ["GPU 1 it is pinned to cannot be read"],
    ),
    (
        "pinned beside the lost GPU is decided",
        PINNED0,
        multi(gp(2, "encode", 10, 0), errors=(None, "GPU is lost")),
        Decision.FITS,
        0,
        ["on GPU 0"],
    ),
    (
        "pinned to a GPU the host lacks",
        Spec("nine", GiB, devices=(9,)),
        multi(),
        Decision.UNKNOWN,
        None,
        ["devices names GPU 9", "GPUs: 0, 1"],
    ),
    # A starting service with nothing on a GPU yet counts at its budget on every GPU it may use.
    (
        "an unpinned start is promised everywhere",
        THIRTY,
        multi(starting=(StartingProcess(9, "python photo-batch.py"),)),
        Decision.FITS,
        0,
        ["50.0 GiB of 80.0 GiB", "vlm (starting)"],
    ),
    (
        "an unpinned start leaves no GPU whole",
        SIXTY,
        multi(starting=(StartingProcess(9, "python photo-batch.py"),)),
        Decision.BUSY,
        None,
        ["only 50.0 GiB", "vlm (starting)"],
    ),
    (
        "a pinned start only on its GPU",
        SIXTY,
        multi(gp(3, "x", 1, 0), starting=(StartingProcess(9, "pinned1 serve"),)),
        Decision.FITS,
        0,
        ["79.0 GiB of 80.0 GiB"],
    ),
    # The agent's entries for the original API's clients hold no memory: not in accounting.
    (
        "an on_gpu false entry is not a GPU process",
        SIXTY,
        multi(gp(7, "vllm serve x", 0, 0, on_gpu=False)),
        Decision.IDLE,
        0,
        ["no process"],
    ),
]


@pytest.mark.parametrize(
    ("case", "spec", "snapshot", "expected", "gpu", "words"),
    GPU_CASES,
    ids=[c[0] for c in GPU_CASES],
)
def test_classify_per_gpu(
    case: str,
    spec: Spec,
    snapshot: Snapshot,
    expected: Decision,
    gpu: int | None,
    words: list[str],
) -> None:
    v = classify(spec, REFUSED, snapshot, others=ALL)
    assert v.decision is expected, v.reason
    assert v.gpu == gpu, v.reason
    for w in words:
        assert w in v.reason, v.reason


def test_on_gpu_false_entry_of_the_service_itself_is_not_loading_on_the_gpu() -> None:
    """gpuctl reads ``starting`` for its own decisions; the legacy entry changes nothing."""
    legacy = multi(gp(7, "vllm serve x", 0, 0, on_gpu=False))
    assert classify(VLLM, REFUSED, legacy, others=ALL).decision is Decision.IDLE
    both = multi(
        gp(7, "vllm serve x", 0, 0, on_gpu=False),
        starting=(StartingProcess(7, "vllm serve x", age_s=1.0),),
    )
    assert classify(VLLM, REFUSED, both, others=ALL).decision is Decision.LOADING


def test_rooms_count_a_service_at_its_budget_on_the_gpu_it_runs_on() -> None:
    s = multi(gp(1, "vllm worker", 8, 1), gp(2, "comfyui", 20, 0))
    rooms = gpu_rooms(s, ALL, exclude=THIRTY)
    assert [(r.index, r.committed_mib) for r in rooms] == [(0, 20 * GiB), (1, 80 * GiB)]
    assert [h.pid for h in rooms[1].holders] == [1]


def test_a_service_leased_and_pinned_counts_only_on_its_gpu() -> None:
    v = classify(SIXTY, REFUSED, multi(), others=ALL, leased=["pinned0"])
    assert (v.decision, v.gpu) == (Decision.FITS, 1)
    v = classify(SIXTY, REFUSED, multi(), others=ALL, leased=["vllm"])
    assert v.decision is Decision.BUSY  # unpinned: it may take either GPU


def test_old_agent_without_devices_and_two_gpus_is_unknown_for_unpinned() -> None:
    old = Snapshot(10 * GiB, 160 * GiB, False, "nvml", "t", (gp(1, "x", 10, 0),), gpus=2)
    v = classify(THIRTY, REFUSED, old, others=ALL)
    assert v.decision is Decision.UNKNOWN and "per-GPU" in v.reason


def test_single_gpu_reasons_do_not_name_the_gpu() -> None:
    v = classify(VLLM, REFUSED, snap(COMFY), others=SPECS)
    assert (v.decision, v.gpu) == (Decision.FITS, 0)
    assert "GPU 0" not in v.reason


def test_reasons_name_the_top_holders_and_a_count() -> None:
    many = snap(*(p(100 + i, f"job{i}", 1 + i) for i in range(6)))
    v = classify(WHISPER, REFUSED, many, others=SPECS)
    assert v.decision is Decision.FITS
    assert "pid 105" in v.reason and "pid 104" in v.reason and "4 more" in v.reason
    assert "pid 100" not in v.reason
    assert len(v.holders) == 6


# The default keyword (the name, no `match`) is a whole word of the command line: an
# argument or the program's base name, never a part of a path, a file name or a URL.
CHAT = Spec("chat", 20 * GiB)
NAMES_CASES = [
    ("tail -f /root/.local/state/gpuctl/logs/chat.log", False),
    ("less chat-notes.txt", False),
    ("wrk -t4 -c64 http://10.0.0.5:8000/v1/chat/completions", False),
    ("python train.py --out /data/chat/ckpt", False),
    ("chatty --port 1", False),
    ("python -m gpuctl sim model-server --name chat --memory 20GiB", True),
    ("vllm serve Qwen/Qwen3-32B --served-model-name=chat", True),
    ("vllm serve Qwen/Qwen3-32B --served-model-name CHAT", True),
    ("/opt/venv/bin/chat --port 8000", True),
    ("/usr/bin/python3 /srv/serve/chat.py --port 8000", True),
    ("python3 -u -m chat.server --port 8000", True),
    ("python3 -mchat --port 8000", True),
    ("env CUDA_VISIBLE_DEVICES=0 chat --port 8000", True),
    ("sh -c chat --port 8000 > /tmp/x.log", True),
]


@pytest.mark.parametrize(("command", "ours"), NAMES_CASES)
def test_the_default_keyword_is_a_whole_word(command: str, ours: bool) -> None:
    from gpuctl.core.decision import owns

    assert owns(CHAT, command) is ours
    # An explicit keyword keeps its promise: a substring, anywhere.
    assert owns(Spec("chat", 20 * GiB, match=("chat",)), command) is True


def test_the_default_keyword_does_not_make_a_log_reader_loading() -> None:
    tail = StartingProcess(61, "tail -f /home/u/.local/state/gpuctl/logs/chat.log", age_s=5.0)
    v = classify(CHAT, REFUSED, snap(starting=(tail,)), others=[CHAT])
    assert v.decision is Decision.IDLE, v.reason
    sim = StartingProcess(62, "python -m gpuctl sim model-server --name chat", age_s=5.0)
    v = classify(CHAT, REFUSED, snap(starting=(sim,)), others=[CHAT])
    assert v.decision is Decision.LOADING and "pid 62" in v.reason


def test_a_reader_of_the_services_log_promises_it_no_memory() -> None:
    """The newcomer's `tail -f …/logs/chat.log` also promised chat's budget, cutting what
    the others may use; a real start by hand (`--name chat`) still promises it."""
    tail = StartingProcess(63, "tail -f /home/u/.local/state/gpuctl/logs/chat.log", age_s=5.0)
    used, _ = committed_memory(snap(starting=(tail,)), [CHAT, VLM], exclude=VLM)
    assert used == 0
    v = classify(VLM, REFUSED, snap(starting=(tail,)), others=[CHAT, VLM])
    assert v.decision is Decision.IDLE, v.reason
    sim = StartingProcess(64, "python -m gpuctl sim model-server --name chat", age_s=5.0)
    used, _ = committed_memory(snap(starting=(sim,)), [CHAT, VLM], exclude=VLM)
    assert used == 20 * GiB
