"""The nvidia-smi CSV parsers against real captures, and the probe against a fake binary.

Captures: ``tests/fixtures/nvidia-smi/`` (see its README; nvidia_gpu_exporter, MIT).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from gpuctl.adapters.probes.nvidia_smi import (
    APP_COLUMNS,
    GPU_COLUMNS,
    QUERY_COLUMNS,
    NvidiaSmiProbe,
    SmiApp,
    SmiGpu,
    parse_compute_apps,
    parse_query_gpu,
)
from gpuctl.errors import NoGpuFound, ProbeError

CAPTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
H100 = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
H100_MIG = "linux-x86_64__nvidia-h100-mig__590.48.01.txt"
H200 = "linux-x86_64__nvidia-h200__590.48.01.txt"
L40S = "linux-x86_64__nvidia-l40s__595.80.txt"
RTX4080 = "linux-x86_64__nvidia-geforce-rtx-4080-super__595.71.05.txt"
GB10 = "linux-aarch64__nvidia-gb10__580.x.txt"
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
GB10_UUID = "GPU-2dee1e25-b3b5-007e-2b55-79f2d0f2ebe5"
NO_SUCH_PID = 4194000


def section(capture: str, command: str, label: str = "") -> str:
    """The output printed under ``# $ <command>...`` in a capture file.

    A capture is a header and then sections: an optional ``####`` rule, a
    ``# <phase> :: <label>`` line, the ``# $ nvidia-smi …`` line, a ``####`` rule, and the
    output up to the next rule or ``# $`` line. ``command`` matches the start of the
    ``# $`` line; ``label`` (e.g. ``load :: query-gpu``) must start the line above it.
    """
    lines = (CAPTURES / capture).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("# $ " + command):
            continue
        above = lines[i - 1][2:] if i and lines[i - 1].startswith("# ") else ""
        if not above.startswith(label):
            continue
        out: list[str] = []
        for body in lines[i + 1 :]:
            if body.startswith("# $ ") or (body.startswith("####") and out):
                break
            if not body.startswith("####"):
                out.append(body)
        return "\n".join(out).strip("\n") + "\n"
    raise LookupError(f"{capture}: no section {label!r} for {command!r}")


# --- parsers against the real captures ----------------------------------------------

APPS = "nvidia-smi --query-compute-apps="
GPUS = "nvidia-smi --query-gpu="


VIEW = {
    H100: ("NVIDIA H100 80GB HBM3", 100, 59, 631.95),
    H100_MIG: ("NVIDIA H100 80GB HBM3", None, 53, 433.78),
    H200: ("NVIDIA H200", 100, 52, 627.4),
    L40S: ("NVIDIA L40S", 9, 54, 110.23),
    RTX4080: ("NVIDIA GeForce RTX 4080 SUPER", 7, 46, 84.24),
}


@pytest.mark.parametrize(
    ("capture", "apps", "used", "total"),
    [
        (H100, [(11327, 2566), (11328, 1542), (11345, 15690)], 19818, 81559),
        (H100_MIG, [(21180, 2296), (21181, 1272), (21198, 7484)], 11125, 81559),
        (H200, [(10291, 2566), (10293, 1542), (10309, 28234)], 32362, 143771),
        (L40S, [(20037, 538), (20038, 681)], 1235, 46068),
        (RTX4080, [(2165, 25), (5022, 503), (5021, 360)], 1474, 16376),
    ],
)
def test_captures_under_load(
    capture: str, apps: list[tuple[int, int]], used: int, total: int
) -> None:
    # These captures ask for more columns, with a header and units ("2566 MiB"):
    # the header names the columns, whatever their order.
    got = parse_compute_apps(section(capture, APPS, "load ::"))
    assert got == [SmiApp(UUID0, pid, mem) for pid, mem in apps]
    (gpu,) = parse_query_gpu(section(capture, GPUS, "load :: query-gpu"))
    assert (gpu.index, gpu.uuid, gpu.memory_total_mib, gpu.memory_used_mib) == (
        0,
        UUID0,
        total,
        used,
    )
    assert gpu.memory_error is None
    # Utilisation, temperature and power as the capture has them ("100 %", "631.95 W");
    # MIG prints [N/A] for utilisation, which stays unknown.
    assert (gpu.name, gpu.utilization_pct, gpu.temperature_c, gpu.power_w) == VIEW[capture]


@pytest.mark.parametrize("capture", [H100, H100_MIG, H200, L40S])
def test_captures_at_idle_have_no_apps(capture: str) -> None:
    text = section(capture, APPS, "idle ::")
    assert text.startswith("timestamp, gpu_name")  # a header and nothing else
    assert parse_compute_apps(text) == []
    (gpu,) = parse_query_gpu(section(capture, GPUS, "idle :: query-gpu"))
    assert gpu.memory_total_mib and gpu.memory_used_mib is not None


def test_rtx_desktop_at_idle_lists_the_compositor() -> None:
    assert parse_compute_apps(section(RTX4080, APPS, "idle ::")) == [SmiApp(UUID0, 2165, 25)]


def test_gb10_per_process_memory_without_device_memory() -> None:
    apps_text = section(GB10, APPS + "gpu_uuid,pid,process_name,used_memory")
    cols = ("gpu_uuid", "pid", "process_name", "used_memory")
    assert parse_compute_apps(apps_text, cols) == [SmiApp(GB10_UUID, 114687, 19135)]
    # --format=csv with a header: [N/A] device memory.
    with_header = section(GB10, GPUS + "index,name,memory.total,memory.free")
    assert parse_query_gpu(with_header) == [SmiGpu(0, "", None, None, name="NVIDIA GB10")]
    bare = section(GB10, GPUS + "memory.used,memory.total,utilization.memory")
    bare_cols = ("memory.used", "memory.total", "utilization.memory")
    assert parse_query_gpu(bare, bare_cols) == [SmiGpu(0, "", None, None)]
    first = section(GB10, GPUS + "memory.total,memory.used,memory.free,utilization")
    assert parse_query_gpu(first) == [
        SmiGpu(0, "", None, None, utilization_pct=0, temperature_c=35, power_w=11.17)
    ]


# --- parsers: the field quirks ---------------------------------------------------------


def test_query_gpu_in_the_order_we_request() -> None:
    text = "0, GPU-a, 81559, 19818\n\n  1 ,GPU-b ,  [N/A] , [N/A]\n"
    assert parse_query_gpu(text) == [
        SmiGpu(0, "GPU-a", 81559, 19818),
        SmiGpu(1, "GPU-b", None, None),
    ]


@pytest.mark.parametrize(
    "value", ["[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Insufficient Permissions]"]
)
def test_unavailable_memory_is_none(value: str) -> None:
    (app,) = parse_compute_apps(f"GPU-a, 1234, {value}\n")
    assert app == SmiApp("GPU-a", 1234, None)
    (gpu,) = parse_query_gpu(f"0, GPU-a, {value}, {value}\n")
    assert (gpu.memory_total_mib, gpu.memory_used_mib) == (None, None)


def test_zero_memory_stays_zero_and_header_with_units_is_accepted() -> None:
    text = "gpu_uuid, pid, used_gpu_memory [MiB]\nGPU-a, 17, 0 MiB\n"
    assert parse_compute_apps(text) == [SmiApp("GPU-a", 17, 0)]


def test_no_running_processes_message_is_empty() -> None:
    assert parse_compute_apps("No running processes found\n") == []
    assert parse_compute_apps("") == []


@pytest.mark.parametrize(
    "text",
    ["GPU-a, 1234\n", "GPU-a, [N/A], 12\n", "GPU-a, 12, lots\n", "GPU-a, 12, 3, 4\n"],
)
def test_malformed_rows_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_compute_apps(text)


def test_column_constants_are_our_queries() -> None:
    assert ",".join(GPU_COLUMNS) == "index,uuid,memory.total,memory.used"
    assert ",".join(APP_COLUMNS) == "gpu_uuid,pid,used_memory"


# --- the probe, end to end, with a fake nvidia-smi ---------------------------------------


def fake_smi(tmp_path: Path, gpus: str, apps: str, body: str | None = None) -> Path:
    """An executable ``nvidia-smi`` that prints ``gpus``/``apps`` for exactly our queries."""
    (tmp_path / "gpus.txt").write_text(gpus)
    (tmp_path / "apps.txt").write_text(apps)
    script = tmp_path / "nvidia-smi"
    script.write_text(
        body
        or f"""#!/bin/sh
[ "$2" = "--format=csv,noheader,nounits" ] || {{ echo "bad format: $2" >&2; exit 2; }}
case "$1" in
  --query-gpu={",".join(QUERY_COLUMNS)}) cat "{tmp_path}/gpus.txt" ;;
  --query-compute-apps={",".join(APP_COLUMNS)}) cat "{tmp_path}/apps.txt" ;;
  *) echo "Invalid combination of input arguments: $1" >&2; exit 2 ;;
esac
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_probe_reads_h100_capture(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        section(H100, GPUS, "load :: query-gpu"),
        section(H100, APPS, "load ::"),
    )
    r = NvidiaSmiProbe(binary=str(smi)).read()
    assert r.probe == "nvidia-smi"
    assert (r.memory_used_mib, r.memory_total_mib, r.unified_memory, r.gpus) == (
        19818,
        81559,
        False,
        1,
    )
    assert [(p.pid, p.memory_mib, p.gpu) for p in r.processes] == [
        (11327, 2566, 0),
        (11328, 1542, 0),
        (11345, 15690, 0),
    ]


def test_probe_gb10_unified_memory(tmp_path: Path) -> None:
    (app,) = parse_compute_apps(
        section(GB10, APPS), ("gpu_uuid", "pid", "process_name", "used_memory")
    )
    # The capture's values, as our own query prints them.
    smi = fake_smi(
        tmp_path,
        f"0, {GB10_UUID}, [N/A], [N/A], NVIDIA H100, [N/A], [N/A], [N/A]\n",
        f"{GB10_UUID}, {app.pid}, {app.memory_mib}\n",
    )
    r = NvidiaSmiProbe(binary=str(smi), gpu_memory_mib=122880).read()
    assert (r.unified_memory, r.memory_used_mib, r.memory_total_mib) == (True, 19135, 122880)
    assert [(p.pid, p.memory_mib) for p in r.processes] == [(114687, 19135)]
    r = NvidiaSmiProbe(binary=str(smi)).read()
    assert r.memory_total_mib == psutil.virtual_memory().total // 2**20


def test_probe_names_real_process_and_maps_uuid_to_index(tmp_path: Path) -> None:
    me = os.getpid()
    smi = fake_smi(
        tmp_path,
        "0, GPU-a, 81559, 100, NVIDIA H100, [N/A], [N/A], [N/A]\n1, GPU-b, 81559, 9000, NVIDIA H100, [N/A], [N/A], [N/A]\n",
        f"GPU-b, {me}, 8192\nGPU-a, {NO_SUCH_PID}, [N/A]\n",
    )
    r = NvidiaSmiProbe(binary=str(smi)).read()
    procs = {p.pid: p for p in r.processes}
    assert procs[me].gpu == 1
    assert procs[me].command == " ".join(psutil.Process(me).cmdline())
    assert procs[me].memory_mib == 8192
    assert (procs[NO_SUCH_PID].gpu, procs[NO_SUCH_PID].command) == (0, None)
    assert procs[NO_SUCH_PID].memory_mib is None
    assert (r.gpus, r.memory_used_mib, r.memory_total_mib) == (2, 9100, 163118)


def test_probe_timeout(tmp_path: Path) -> None:
    # sleep runs as a child of sh and holds the pipes: the whole group must die.
    smi = fake_smi(tmp_path, "", "", body="#!/bin/sh\nsleep 30\n")
    start = time.monotonic()
    with pytest.raises(ProbeError, match=r"^nvidia-smi did not answer within 0\.5s$"):
        NvidiaSmiProbe(binary=str(smi), timeout_s=0.5).read()
    assert time.monotonic() - start < 5


def test_probe_nonzero_exit_reports_first_stderr_line(tmp_path: Path) -> None:
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    body = f'#!/bin/sh\necho "{msg}" >&2\necho "Make sure the driver is running." >&2\nexit 9\n'
    smi = fake_smi(tmp_path, "", "", body=body)
    with pytest.raises(ProbeError) as exc:
        NvidiaSmiProbe(binary=str(smi)).read()
    assert exc.value.message == f"nvidia-smi failed (exit 9): {msg}"


def test_probe_missing_binary_is_no_gpu_found(tmp_path: Path) -> None:
    with pytest.raises(NoGpuFound, match="not found"):
        NvidiaSmiProbe(binary=str(tmp_path / "nvidia-smi")).read()


def test_probe_unparseable_output_is_probe_error(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path, "0, GPU-a, 81559, 100, NVIDIA H100, [N/A], [N/A], [N/A]\n", "GPU-a, twelve, 5\n"
    )
    with pytest.raises(ProbeError, match="unexpected nvidia-smi output"):
        NvidiaSmiProbe(binary=str(smi)).read()


def test_probe_one_gpu_without_permission_is_unknown_the_other_as_it_is(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        "0, GPU-a, 81559, 100, NVIDIA H100, [N/A], [N/A], [N/A]\n1, GPU-b, [Insufficient Permissions], [Insufficient Permissions], NVIDIA H100, [N/A], [N/A], [N/A]\n",
        f"GPU-a, {NO_SUCH_PID}, 90\n",
    )
    r = NvidiaSmiProbe(binary=str(smi)).read()
    d0, d1 = r.devices
    assert (d0.memory_used_mib, d0.memory_total_mib, d0.unified) == (100, 81559, False)
    assert d1.error == "nvidia-smi: [Insufficient Permissions]" and not d1.unified
    assert (r.memory_used_mib, r.memory_total_mib, r.unified_memory) == (100, 81559, False)


def test_probe_no_gpu_readable_is_an_error(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        "0, GPU-a, [Insufficient Permissions], [Unknown Error], NVIDIA H100, [N/A], [N/A], [N/A]\n",
        "",
    )
    with pytest.raises(ProbeError, match="cannot read any GPU"):
        NvidiaSmiProbe(binary=str(smi)).read()


def test_probe_only_the_gpu_without_a_figure_is_unified(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        f"0, GPU-a, 81559, 9000, NVIDIA H100, [N/A], [N/A], [N/A]\n1, {GB10_UUID}, [N/A], [N/A], NVIDIA H100, [N/A], [N/A], [N/A]\n",
        f"GPU-a, {NO_SUCH_PID}, 8900\n{GB10_UUID}, {NO_SUCH_PID + 1}, 19135\n",
    )
    r = NvidiaSmiProbe(binary=str(smi), gpu_memory_mib=122880).read()
    d0, d1 = r.devices
    assert (d0.unified, d0.memory_used_mib, d0.memory_total_mib) == (False, 9000, 81559)
    assert (d1.unified, d1.memory_used_mib, d1.memory_total_mib) == (True, 19135, 122880)
    assert r.unified_memory is True and r.memory_total_mib == 81559 + 122880


def test_probe_reports_utilisation_temperature_and_power(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        "0, GPU-a, 81559, 100, NVIDIA H100 80GB HBM3, 37, 61, 312.45\n"
        "1, GPU-b, 81559, 0, NVIDIA H100 80GB HBM3, [N/A], [N/A], [N/A]\n",
        "",
    )
    d0, d1 = NvidiaSmiProbe(binary=str(smi)).read().devices
    assert (d0.name, d0.utilization_pct, d0.temperature_c, d0.power_w) == (
        "NVIDIA H100 80GB HBM3",
        37,
        61,
        312.45,
    )
    assert (d1.utilization_pct, d1.temperature_c, d1.power_w) == (None, None, None)


@pytest.mark.parametrize("value", ["101", "-5", "nan", "inf", "lots", "1e400"])
def test_view_figures_out_of_range_are_unknown(tmp_path: Path, value: str) -> None:
    (gpu,) = parse_query_gpu(f"0, GPU-a, 100, 10, X, {value}, {value}, {value}\n", QUERY_COLUMNS)
    assert gpu.utilization_pct is None
    if value not in ("101", "-5"):
        assert gpu.temperature_c is None and gpu.power_w is None


# --- properties: whatever nvidia-smi prints, a parse or a ValueError ------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_field = st.sampled_from(
    ["0", "1", "81559", "[N/A]", "[Not Supported]", "[Insufficient Permissions]", "nan",
     "inf", "-3", "1e400", "12 MiB", "37 %", "61.5 W", "", "GPU-a", "x,y", "\u00e9"]
) | st.text(max_size=6)  # fmt: skip


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(_field, min_size=1, max_size=9), max_size=4))
def test_any_query_gpu_output_parses_or_is_a_value_error(rows: list[list[str]]) -> None:
    text = "\n".join(", ".join(r) for r in rows)
    try:
        gpus = parse_query_gpu(text, QUERY_COLUMNS)
    except ValueError as e:
        assert str(e)
        return
    for g in gpus:
        assert g.utilization_pct is None or 0 <= g.utilization_pct <= 100
        assert g.power_w is None or g.power_w >= 0
        assert g.memory_total_mib is None or g.memory_total_mib >= 0
        assert g.memory_used_mib is None or g.memory_used_mib >= 0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(_field, min_size=1, max_size=4), max_size=4))
def test_any_compute_apps_output_parses_or_is_a_value_error(rows: list[list[str]]) -> None:
    text = "\n".join(", ".join(r) for r in rows)
    try:
        apps = parse_compute_apps(text)
    except ValueError as e:
        assert str(e)
        return
    assert all(a.pid >= 0 and (a.memory_mib is None or a.memory_mib >= 0) for a in apps)


@pytest.mark.parametrize(
    ("total", "used", "why"),
    [
        ("17592186044415", "17592186044415", "no memory figure"),  # 2^64-1 bytes in MiB
        ("81559", "17592186044415", "no memory figure"),
        ("0", "0", "total memory of 0"),
        ("81559", "90000", "more memory used"),
    ],
)
def test_probe_sentinel_memory_is_unknown_not_free_nor_unified(
    tmp_path: Path, total: str, used: str, why: str
) -> None:
    """The NVML sentinels as nvidia-smi prints them: 2^64-1 bytes in MiB was 16 EiB
    free, a total of 0 was taken for unified memory. That GPU is unknown."""
    smi = fake_smi(
        tmp_path,
        "0, GPU-a, 81559, 100, NVIDIA H100 80GB HBM3, 37, 61, 312.45\n"
        f"1, GPU-b, {total}, {used}, NVIDIA H100 80GB HBM3, [N/A], [N/A], [N/A]\n",
        "",
    )
    r = NvidiaSmiProbe(binary=str(smi), gpu_memory_mib=122880).read()
    d0, d1 = r.devices
    assert d0.readable and not d1.readable and not d1.unified
    assert d1.error is not None and why in d1.error
    assert (r.memory_total_mib, r.unified_memory) == (81559, False)


def test_probe_gb10_process_of_unknown_memory_makes_the_gpu_unknown(tmp_path: Path) -> None:
    """On unified memory "used" is the processes' sum: a [N/A] one is not 0."""
    smi = fake_smi(
        tmp_path,
        "0, GPU-g, [N/A], [N/A], NVIDIA GB10, [N/A], 35, 11.17\n",
        f"GPU-g, {NO_SUCH_PID}, 19135\nGPU-g, {NO_SUCH_PID + 1}, [N/A]\n",
    )
    with pytest.raises(ProbeError, match=f"pid {NO_SUCH_PID + 1}"):
        NvidiaSmiProbe(binary=str(smi), gpu_memory_mib=122880).read()
