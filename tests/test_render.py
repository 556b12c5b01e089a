"""The renderers on fixed results and reports: the JSON envelopes keep every documented
key, each refusal ends with a hint, and the status view draws what the decisions count,
in 80 columns, in ASCII where the terminal cannot take Unicode."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from msgspec.structs import replace
from rich.console import Console

from gpuctl.core.decision import Decision, Health, Verdict
from gpuctl.core.snapshot import GpuDevice, GpuProcess, HostIdentity, Snapshot, StartingProcess
from gpuctl.errors import ExitCode
from gpuctl.flows.op_results import (
    EnsureResult,
    LocksReport,
    Outcome,
    SimClaim,
    SimListing,
    StopResult,
)
from gpuctl.flows.results import HostReport, MemoryUse, StatusReport
from gpuctl.flows.status import filtered
from gpuctl.render.locks import locks_to_json
from gpuctl.render.results import ensure_text, ensure_to_json, stop_to_json
from gpuctl.render.sim_view import sim_ls_text, sim_ls_to_json
from gpuctl.render.status_json import status_to_json
from gpuctl.render.status_view import (
    ASCII,
    UNICODE,
    MemoryHistory,
    glyphs,
    render_status,
    short_command,
)
from tests.flow_fakes import GIB, config

ISO_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
VENV_PY = "/home/ana/projects/photos/.venv/bin/python3"


def _report(tmp_path: Path, *, util: int | None = None) -> StatusReport:
    conf = config(
        tmp_path,
        '[hosts.dgx]\nagent = "http://127.0.0.1:9"\n'
        '[services.vllm]\nhost = "dgx"\nmatch = ["vllm"]\nmemory = "80GiB"\n'
        '[services.photos]\nhost = "dgx"\nmatch = ["photo-batch"]\nmemory = "30GiB"\n',
    )
    services = tuple(conf.services_on("dgx"))
    snap = Snapshot(
        memory_used_mib=20 * GIB,
        memory_total_mib=128 * GIB,
        unified_memory=False,
        probe="nvml",
        taken_at="2027-01-15T08:00:00Z",  # an older agent's form, without milliseconds
        processes=(
            GpuProcess(
                101, f"{VENV_PY} photo-batch.py --album summer-2026 --size 4k", 20 * GIB, "ana"
            ),
        ),
        starting=(StartingProcess(202, "/opt/venv/bin/vllm serve big-model", "bob", 12.0),),
        host=HostIdentity("dgx", "boot"),
    )
    verdicts = (
        Verdict("vllm", Decision.LOADING, "pid 202 starting (not on the GPU yet)"),
        Verdict(
            "photos",
            Decision.BUSY,
            "needs 30.0 GiB but only 28.0 GiB of 128.0 GiB free; held by vllm (starting)",
        ),
    )
    return StatusReport(
        hosts=(
            HostReport(
                name="dgx",
                source="http://dgx:9400",
                snapshot=snap,
                verdicts=verdicts,
                services=services,
                health=(Health("refused", "no"), Health("none")),
                memory=(MemoryUse(None, 20 * GIB, 80 * GIB, 128 * GIB, utilization_pct=util),),
            ),
        ),
        taken_at="2027-01-15T08:00:00.123Z",
    )


def _text(renderable: object, width: int = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(renderable)
    return out.getvalue()


# ---- ensure, stop


ENSURE_KEYS = {
    "schema",
    "service",
    "host",
    "outcome",
    "exit_code",
    "reason",
    "decision",
    "launched",
    "waited_s",
    "attempt",
    "log_tail",
    "handle",
    "notes",
    "hint",
    "pool",
}


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (Outcome.READY, 0),
        (Outcome.STARTED, 0),
        (Outcome.LOADING, 0),
        (Outcome.FAILED, 1),
        (Outcome.BUSY, 3),
        (Outcome.UNKNOWN, 4),
        (Outcome.TIMEOUT, 5),
        (Outcome.INTERRUPTED, 130),
    ],
)
def test_ensure_json_envelope_and_exit_codes(outcome: Outcome, code: int) -> None:
    r = EnsureResult("vllm", "dgx", outcome, "why", "IDLE", waited_s=1.23456)
    obj = ensure_to_json(r)
    assert set(obj) == ENSURE_KEYS
    assert obj["schema"] == 1 and obj["outcome"] == outcome.value
    assert obj["exit_code"] == code == r.exit_code
    assert obj["waited_s"] == 1.235
    json.dumps(obj)  # plain JSON types only


def test_exit_codes_are_the_documented_contract() -> None:
    assert {e.name: int(e) for e in ExitCode} == {
        "OK": 0,
        "FAILED": 1,
        "USAGE": 2,
        "BUSY": 3,
        "UNKNOWN": 4,
        "TIMEOUT": 5,
        "INTERRUPTED": 130,
    }


@pytest.mark.parametrize(
    "outcome", [Outcome.BUSY, Outcome.UNKNOWN, Outcome.FAILED, Outcome.TIMEOUT]
)
def test_every_refusal_ends_with_a_hint(outcome: Outcome) -> None:
    r = EnsureResult(
        "vllm", "dgx", outcome, "needs 80 GiB", "BUSY", hint="wait and try again", log_tail="a\nb"
    )
    lines = ensure_text(r)
    assert lines[0] == f"vllm: {outcome.value.upper()}: needs 80 GiB"
    assert lines[-1] == "  hint: wait and try again"


def test_preemptable_refusal_says_preemptable_and_keeps_its_json() -> None:
    """`ensure chat` refused as PREEMPTABLE printed 'chat: BUSY: …' while `status` said
    PREEMPTABLE; the text now names the decision, the JSON keeps outcome busy (exit 3)."""
    r = EnsureResult(
        "chat",
        "dgx",
        Outcome.BUSY,
        "needs 80.0 GiB but only 28.0 GiB free; fits once photos (priority 50, 30.0 GiB) stops",
        "PREEMPTABLE",
        hint="`gpuctl ensure chat --preempt` stops photos to make room",
    )
    lines = ensure_text(r)
    assert lines[0].startswith("chat: PREEMPTABLE: needs 80.0 GiB"), lines
    assert lines[-1] == "  hint: `gpuctl ensure chat --preempt` stops photos to make room"
    obj = ensure_to_json(r)
    assert obj["outcome"] == "busy" and obj["decision"] == "PREEMPTABLE" and obj["exit_code"] == 3
    # A PREEMPTABLE start that then failed or ran out of time says so, not PREEMPTABLE.
    for outcome in (Outcome.FAILED, Outcome.TIMEOUT):
        r = EnsureResult("chat", "dgx", outcome, "the memory did not come back", "PREEMPTABLE")
        assert ensure_text(r)[0].startswith(f"chat: {outcome.value.upper()}: "), outcome


def test_ready_text_has_no_log_and_no_hint() -> None:
    r = EnsureResult("vllm", "dgx", Outcome.READY, "answers", "READY", log_tail="x")
    assert ensure_text(r) == ["vllm: ready: answers"]


def test_interrupted_result_says_the_server_keeps_loading() -> None:
    r = EnsureResult.interrupted("vllm", "dgx")
    assert r.exit_code == ExitCode.INTERRUPTED == 130
    assert "keeps loading" in r.reason and r.hint


def test_stop_json() -> None:
    obj = stop_to_json(StopResult("vllm", "dgx", ["pid 1"], "stopped pid 1"))
    assert obj == {
        "schema": 1,
        "service": "vllm",
        "host": "dgx",
        "stopped": ["pid 1"],
        "reason": "stopped pid 1",
        "exit_code": 0,
    }


# ---- status JSON


def test_status_json_keeps_every_documented_key_in_one_time_form(tmp_path: Path) -> None:
    obj = status_to_json(_report(tmp_path))
    assert set(obj) == {"schema", "taken_at", "ok", "hosts", "services"}
    (host,) = obj["hosts"]
    assert {
        "name",
        "source",
        "ok",
        "error",
        "hint",
        "probe",
        "memory_used_mib",
        "memory_total_mib",
        "unified_memory",
        "is_idle",
        "taken_at",
        "host",
        "state_dir",
        "processes",
        "starting",
    } <= set(host)
    assert ISO_MS.match(obj["taken_at"]) and ISO_MS.match(host["taken_at"])
    assert host["taken_at"] == "2027-01-15T08:00:00.000Z"
    assert host["memory_promised_mib"] == 80 * GIB
    # the JSON keeps the full command line
    assert host["processes"][0]["command"].startswith(VENV_PY)
    assert host["starting"][0]["service"] == "vllm"
    assert [s["decision"] for s in obj["services"]] == ["LOADING", "BUSY"]


# ---- status view


def test_memory_bar_shows_held_and_promised_so_it_agrees_with_the_decisions(
    tmp_path: Path,
) -> None:
    text = _text(render_status(_report(tmp_path)))
    assert "█" * 5 + "▓" in text  # held, then promised, stacked
    assert "held 20.0 GiB" in text
    assert "promised 80.0 GiB" in text
    assert "free 28.0 GiB" in text  # the same 28 GiB the BUSY reason names


def test_view_fits_80_columns(tmp_path: Path) -> None:
    text = _text(render_status(_report(tmp_path), width=80), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80


def test_command_column_is_short_and_wide_is_full(tmp_path: Path) -> None:
    narrow = _text(render_status(_report(tmp_path)), width=80)
    assert "python3 photo-batch.py --album summer-2026" in narrow
    assert ".venv/bin" not in narrow
    wide = _text(render_status(_report(tmp_path), wide=True), width=200)
    assert f"{VENV_PY} photo-batch.py --album summer-2026 --size 4k" in wide


def test_short_command() -> None:
    assert short_command("/a/b/.venv/bin/python3 -m vllm serve x") == "python3 -m vllm serve x"
    assert short_command("vllm") == "vllm"
    assert short_command("") == ""


def test_utilisation_unknown_is_never_zero(tmp_path: Path) -> None:
    unknown = _text(render_status(_report(tmp_path, util=None)))
    assert "util ?" in unknown and "util 0%" not in unknown
    assert "util 37%" in _text(render_status(_report(tmp_path, util=37)))


def test_ascii_drawing_where_unicode_cannot_go(tmp_path: Path) -> None:
    assert glyphs("ascii") is ASCII and glyphs("utf-8") is UNICODE and glyphs(None) is ASCII
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    console = Console(file=out, width=60, color_system=None, legacy_windows=False)
    g = glyphs(console.encoding)
    console.print(render_status(_report(tmp_path), False, console.width, g=g))
    out.flush()
    text = raw.getvalue().decode("ascii")  # raised above, had anything not been ASCII
    assert "#####+" in text  # held, promised
    assert "~" in text  # a cut command
    assert "+--" in text  # Rich's own box, swapped for ASCII by the console


def test_watch_header_and_sparkline(tmp_path: Path) -> None:
    report = _report(tmp_path)
    history = MemoryHistory(points=5, every_s=30.0)
    for _ in range(7):
        history.add(report)
    # 20 of 128 GiB held; the 80 GiB only promised to a loading service is not "used".
    assert history.sparkline("dgx") == "▂" * 5
    text = _text(render_status(report, history=history, interval_s=2.0))
    assert "every 2s" in text and "Ctrl-C to quit" in text
    assert "▂▂▂▂▂" in text and "last 2m" in text  # 5 readings, 30 s apart


def test_sparkline_shows_unknown_as_a_gap(tmp_path: Path) -> None:
    history = MemoryHistory()
    history.add(_report(tmp_path))
    history.add(StatusReport((HostReport("dgx", "x", None, error="down"),)))
    assert history.sparkline("dgx") == "▂ "


# ---- filters


def test_only_and_user_filter_rows_but_not_memory(tmp_path: Path) -> None:
    report = _report(tmp_path)
    only = filtered(report, only=["vllm"]).hosts[0]
    assert [s.name for s in only.services] == ["vllm"]
    assert only.snapshot is not None
    assert [p.pid for p in only.snapshot.processes] == []
    assert [s.pid for s in only.snapshot.starting or ()] == [202]
    assert only.memory == report.hosts[0].memory
    by_user = filtered(report, users=["ana"]).hosts[0]
    assert by_user.snapshot is not None
    assert [p.pid for p in by_user.snapshot.processes] == [101]
    assert list(by_user.snapshot.starting or ()) == []
    assert len(by_user.services) == 2
    assert filtered(report) is report
    text = _text(render_status(filtered(report, users=["nobody"])))
    assert "showing user nobody" in text and "no process matches the filter" in text
    assert "held 20.0 GiB" in text  # the memory figures stay the whole host's


# ---- locks, sim ls


def test_locks_json_times_in_the_one_form() -> None:
    from gpuctl.core.record import Record

    rec = Record(service="vllm", since=1_800_000_000.5, last_used=1_800_000_001.0)
    obj = locks_to_json(LocksReport([("dgx", rec, None), ("b", None, "down")], 1_800_000_010.0))
    first = obj["records"][0]
    assert first["since"] == "2027-01-15T08:00:00.500Z"
    assert ISO_MS.match(first["last_used"])
    assert obj["records"][1] == {"host": "b", "error": "down"}
    assert obj["ok"] is False


def test_sim_ls_text_and_json() -> None:
    listing = SimListing("/tmp/sim", 128 * GIB, (SimClaim(7, "comfyui", 20 * GIB, 0, "python x"),))
    assert sim_ls_text(listing)[0] == "simulated GPU /tmp/sim: 20.0 GiB used of 128.0 GiB"
    assert sim_ls_text(listing)[-1].split() == ["7", "comfyui", "20.0", "GiB", "python", "x"]
    obj = sim_ls_to_json(listing)
    assert obj["memory_used_mib"] == 20 * GIB and obj["claims"][0]["name"] == "comfyui"
    assert sim_ls_text(SimListing("/s", None, ()))[-1] == "no claims: the GPU is idle"


# ---- several GPUs


def _two_gpus(tmp_path: Path) -> StatusReport:
    base = _report(tmp_path)
    h = base.hosts[0]
    assert h.snapshot is not None
    snap = replace(
        h.snapshot,
        processes=(
            GpuProcess(101, "python photo-batch.py", 20 * GIB, "ana", gpu=1, sm_util_pct=63),
            GpuProcess(102, "python other.py", 1 * GIB, "bob", gpu=0),
        ),
        gpus=2,
        devices=(
            GpuDevice(0, 1 * GIB, 80 * GIB, name="H100", utilization_pct=None),
            GpuDevice(
                1,
                20 * GIB,
                80 * GIB,
                name="H100",
                utilization_pct=55,
                temperature_c=61,
                power_w=312.4,
            ),
        ),
    )
    memory = (
        MemoryUse(0, 1 * GIB, 80 * GIB, 80 * GIB, name="H100"),
        MemoryUse(
            1,
            20 * GIB,
            0,
            80 * GIB,
            utilization_pct=55,
            name="H100",
            temperature_c=61,
            power_w=312.4,
        ),
    )
    return replace(base, hosts=(replace(h, snapshot=snap, memory=memory),))


def test_each_gpu_has_its_bar_and_processes_their_gpu(tmp_path: Path) -> None:
    text = _text(render_status(_two_gpus(tmp_path)), width=100)
    assert "GPU 0 memory" in text and "GPU 1 memory" in text
    assert "promised 80.0 GiB" in text  # the starting service counts on the GPU it may take
    header = next(line for line in text.splitlines() if "PID" in line)
    assert " GPU " in header and " SM " in header
    row = next(line for line in text.splitlines() if "photo-batch.py" in line)
    assert " 1 " in row and "63%" in row
    other = next(line for line in text.splitlines() if "other.py" in line)
    assert "?" in other  # its SM share is unknown, not 0
    assert "util ?" in text and "util 55%" in text


def test_wide_shows_temperature_power_and_name(tmp_path: Path) -> None:
    text = _text(render_status(_two_gpus(tmp_path), wide=True), width=160)
    assert "61°C" in text and "312 W" in text and "H100" in text
    assert "temperature ?  power ?" in text  # GPU 0 has neither figure: unknown, never 0


def test_locks_json_and_text_list_set_aside_files() -> None:
    from gpuctl.core.record import Record, SetAside
    from gpuctl.render.locks import render_locks

    kept = SetAside("x", "x.json.corrupt-1", 1_800_000_000.0, 25, "at $: not JSON")
    old = SetAside("x", "x.json.corrupt-0", 1_700_000_000.0, 10, "at $.pid: too big")
    rec = Record(
        service="x", recovered="record was unreadable (at $: not JSON); kept as x.json.corrupt-1"
    )
    report = LocksReport([("a", rec, None)], 1_800_000_010.0, [("a", old), ("a", kept)])
    obj = locks_to_json(report)
    assert obj["ok"] is True
    assert [a["file"] for a in obj["set_aside"]] == ["x.json.corrupt-0", "x.json.corrupt-1"]
    assert obj["set_aside"][1]["at"] == "2027-01-15T08:00:00.000Z"
    text = _text(render_locks(report), width=100)
    assert "kept as x.json.corrupt-1" in text  # the newest, on its row's note
    assert "kept unreadable record x.json.corrupt-0" in text  # older copies listed below


def test_locks_text_says_retry_in_only_while_the_back_off_runs() -> None:
    """The failure cell counts the failures and, while the back-off runs, says when the
    next try comes (judged at the report's ``now``, so no clock is read here)."""
    from gpuctl.core.record import Failure, Phase, Record
    from gpuctl.render.locks import render_locks

    now = 1_800_000_010.0
    failure = Failure(at=now - 2, error="exited while loading", count=1, backoff_until=now + 8)
    rec = Record(service="x", phase=Phase.FAILED, failure=failure)
    text = _text(render_locks(LocksReport([("a", rec, None)], now, [])), width=160)
    assert "exited while loading (1x, retry in 8s)" in text
    later = _text(render_locks(LocksReport([("a", rec, None)], now + 60, [])), width=160)
    assert "exited while loading (1x)" in later and "retry in" not in later


def test_a_long_command_takes_the_room_that_is_left(tmp_path: Path) -> None:
    base = _report(tmp_path)
    h = base.hosts[0]
    assert h.snapshot is not None
    long = "python3 serve.py " + " ".join(f"--option-{i} value-{i}" for i in range(20))
    snap = replace(h.snapshot, processes=(GpuProcess(7, long, 1 * GIB, "ana"),), starting=())
    text = _text(render_status(replace(base, hosts=(replace(h, snapshot=snap),)), width=80), 80)
    (row,) = [line for line in text.splitlines() if "serve.py" in line]
    assert len(row) <= 80 and row.rstrip(" │").endswith("…")
    assert len(row.rstrip(" │")) >= 76  # cut at the border, not short of it


def test_reasons_in_ascii_cut_with_the_tables_marker_and_keep_brackets(tmp_path: Path) -> None:
    """A reason's own "…" (a cut command) is drawn as the ASCII table's "~", not "?"; and a
    reason is text, not Rich markup: "[services.vllm]" or a command's "[x]" stay."""
    report = _report(tmp_path)
    (h,) = report.hosts
    reason = "pid 202 (vllm serve --tag [big] mod…)"
    h = replace(h, verdicts=(replace(h.verdicts[0], reason=reason), h.verdicts[1]))
    report = replace(report, hosts=(h,))
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="replace")
    console = Console(file=out, width=100, color_system=None, legacy_windows=False)
    console.print(render_status(report, False, console.width, g=glyphs(console.encoding)))
    out.flush()
    text = raw.getvalue().decode("ascii")
    assert "(vllm serve --tag [big] mod~)" in text, text
    assert "?" not in text.replace("util ?", ""), text


def test_wide_header_fits_80_columns(tmp_path: Path) -> None:
    """--wide at 80 columns: the bar keeps its line; name, temperature and power get one
    of their own, labelled (unknown as "?"), instead of wrapping off the bar's end."""
    lines = _text(render_status(_two_gpus(tmp_path), wide=True), width=80).splitlines()
    bars = [i for i, ln in enumerate(lines) if "util " in ln]
    assert bars
    for i in bars:
        assert lines[i].rstrip(" │").endswith(("%", "?")), lines[i]
        assert "temperature " in lines[i + 1] and "power " in lines[i + 1], lines[i + 1]
    assert "temperature 61°C  power 312 W" in "\n".join(lines)


def test_locks_a_long_job_name_is_cut_not_squeezing_the_other_columns() -> None:
    """One `run --name` of 84 characters emptied every other column of `gpuctl locks` at
    80 columns (newcomer review): the name folds in its own cell, the rest stays whole."""
    from gpuctl.core.record import Phase, Record
    from gpuctl.render.locks import render_locks

    long = "run." + "x" * 84
    rows = [("dgx", Record(long, Phase.STOPPED, since=1_800_000_000.0), None)]
    rows.append(("dgx", Record("chat", Phase.RUNNING, since=1_800_000_000.0), None))
    text = _text(render_locks(LocksReport(rows, 1_800_000_010.0, [])), width=80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    (row,) = [line for line in lines if "run.xxx" in line]
    assert "dgx" in row and "stopped" in row and "01-15 08:00" in row and "…" not in text, text
    assert text.count("x") - text.count("dgx") == 84  # every x of the name, folded
    # Its row (the note under the table, "dgx/chat: …", says its record has no promise).
    (chat,) = [line for line in lines if line.startswith("dgx ") and "chat" in line]
    assert "running" in chat and "never" in chat, text
