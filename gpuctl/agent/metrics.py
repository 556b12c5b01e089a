"""The agent's ``/metrics``: the Prometheus text exposition, built by a pure function."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from gpuctl import __version__
from gpuctl.core.durations import StartTally
from gpuctl.core.record import Phase, Record
from gpuctl.core.record_pids import recorded_servers
from gpuctl.core.snapshot import HostIdentity, ProbeReading, device_figures


def _label(value: str) -> str:
    """Escape a Prometheus label value (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value: integers in full (``:g`` would print 1.12795e+06), floats exactly."""
    if isinstance(value, int):
        return str(int(value))  # int(): a bool prints as 1 or 0
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render_metrics(
    reading: ProbeReading | None,
    *,
    probe_up: bool,
    probe_name: str,
    probe_errors_total: int,
    requests_total: dict[str, int],
    host: HostIdentity,
    gpu_memory_mib: int | None,
    records: Sequence[Record] | None = None,
    store_up: bool | None = None,
    unreadable_records: int = 0,
    now: float | None = None,
    servers: Mapping[int, str] | None = None,
    journal: Mapping[str, float] | None = None,
    starts: StartTally | None = None,
) -> str:
    """The Prometheus text exposition of one reading, the services' records and the
    agent's counters.

    Gauges that the probe could not measure are left out rather than reported as 0:
    a missing sample is "unknown", a zero is "free". ``records`` (None: the agent has no
    state directory, or it could not be read, see ``store_up``) gives each service's
    phase, lease and idle seconds (``now`` minus its ``last_used``). ``servers``: whose
    each server process is, as ``/status`` names them (by handle, start nonce, or as a
    child of one); without it, the handles' pids. ``journal``: the journal's counters
    (``adapters.journal.counters``, with ``write_failures``), for the events this
    agent wrote. ``starts``: the successful starts this agent has seen in the records,
    kept across reads (``core.durations.StartTally``), so the start histogram never goes
    down; without it, one is folded from ``records`` for this read alone.
    """
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    metric(
        "gpuctl_agent_info",
        "gauge",
        "The agent's version, probe and host (always 1).",
        [
            (
                f'{{version="{_label(__version__)}",probe="{_label(probe_name)}",'
                f'hostname="{_label(host.hostname)}"}}',
                1,
            )
        ],
    )
    metric(
        "gpuctl_probe_up",
        "gauge",
        "1 when the last GPU probe succeeded.",
        [("", 1 if probe_up else 0)],
    )
    if reading is not None:
        _gpu_metrics(reading, gpu_memory_mib, records, metric, servers)
    if store_up is not None:
        metric(
            "gpuctl_store_up",
            "gauge",
            "1 when the agent could read the records in its state directory.",
            [("", 1 if store_up else 0)],
        )
        metric(
            "gpuctl_store_unreadable_records",
            "gauge",
            "Record files the agent could not read (set aside by the store, or broken).",
            [("", unreadable_records)],
        )
    if records is not None:
        at = time.time() if now is None else now
        # A state set (OpenMetrics' stateset, in 0.0.4 text as a gauge): one sample per
        # phase for every service with a record, 1 for its phase and 0 for the others,
        # so a stopped service has samples and `== 1` selects the current phase.
        metric(
            "gpuctl_service_phase",
            "gauge",
            "A service's phase as a state set: one sample per phase (stopped, starting, "
            "running, sleeping, stopping, preempted, failed), 1 for the current one.",
            [
                (
                    f'{{service="{_label(r.service)}",phase="{phase.value}"}}',
                    1 if r.phase is phase else 0,
                )
                for r in records
                for phase in Phase
            ],
        )
        idle = [(r.service, r.idle_for(at)) for r in records]
        metric(
            "gpuctl_service_idle_seconds",
            "gauge",
            "Seconds since a service was last used (services never used have no sample).",
            [(f'{{service="{_label(svc)}"}}', round(s, 3)) for svc, s in idle if s is not None],
        )
        if starts is None:
            starts = StartTally()
            starts.fold(records)
        _start_durations(starts, lines)
        metric(
            "gpuctl_service_lease_held",
            "gauge",
            "1 while a live lease on the service is held (it is being started or stopped).",
            [(f'{{service="{_label(r.service)}"}}', 1 if r.lease else 0) for r in records],
        )
    metric(
        "gpuctl_probe_errors_total",
        "counter",
        "GPU probe scans that failed.",
        [("", probe_errors_total)],
    )
    metric(
        "gpuctl_agent_requests_total",
        "counter",
        "HTTP requests by endpoint ('/records' for every store path, 'other' for unknown ones).",
        [(f'{{path="{_label(path)}"}}', n) for path, n in sorted(requests_total.items())],
    )
    if journal is not None:
        _journal_metrics(journal, metric)
    return "\n".join(lines) + "\n"


def _journal_metrics(counts: Mapping[str, float], metric: Callable[..., None]) -> None:
    metric(
        "gpuctl_journal_write_failures_total",
        "counter",
        "Journal events this agent could not write (the starts and stops went on).",
        [("", int(counts.get("write_failures", 0)))],
    )
    metric(
        "gpuctl_starts_total",
        "counter",
        "Launches journaled through this agent.",
        [("", int(counts.get("starts", 0)))],
    )
    stops = sorted((k.split(":", 1)[1], n) for k, n in counts.items() if k.startswith("stops:"))
    metric(
        "gpuctl_stops_total",
        "counter",
        "Stops journaled through this agent, by cause.",
        [(f'{{cause="{_label(cause)}"}}', int(n)) for cause, n in stops],
    )
    metric(
        "gpuctl_cold_start_seconds_total",
        "counter",
        "Cold-start seconds journaled through this agent (ready events).",
        [("", round(float(counts.get("cold_start_seconds", 0.0)), 3))],
    )
    metric(
        "gpuctl_cold_starts_total",
        "counter",
        "Cold starts journaled through this agent.",
        [("", int(counts.get("cold_starts", 0)))],
    )


MIB = 1 << 20


def _gpu_metrics(
    reading: ProbeReading,
    gpu_memory_mib: int | None,
    records: Sequence[Record] | None,
    metric: Callable[[str, str, str, list[tuple[str, float]]], None],
    servers: Mapping[int, str] | None = None,
) -> None:
    """Per-GPU memory in bytes, temperature and power, labelled ``gpu``, ``uuid``,
    ``model`` (gpuctl's own labels; docs/reference/metrics.md maps them to DCGM's and
    nvidia_gpu_exporter's), and the memory each service's processes hold.

    A GPU that could not be read has ``gpuctl_gpu_up 0`` and no memory samples: a missing
    sample is "unknown", a zero would be "free".
    """
    devices = device_figures(reading, gpu_memory_mib)
    labels = {
        d.index: f'gpu="{d.index}",uuid="{_label(d.uuid or "")}",model="{_label(d.name or "")}"'
        for d in devices
    }
    metric(
        "gpuctl_gpu_up",
        "gauge",
        "1 when this GPU could be read.",
        [(f"{{{labels[d.index]}}}", 1 if d.readable else 0) for d in devices],
    )
    metric(
        "gpuctl_gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use, bytes (unified memory: what its processes hold).",
        [
            (f"{{{labels[d.index]}}}", d.memory_used_mib * MIB)
            for d in devices
            if d.readable and d.memory_used_mib is not None
        ],
    )
    metric(
        "gpuctl_gpu_memory_total_bytes",
        "gauge",
        "GPU memory in total, bytes (unified memory: the configured --gpu-memory).",
        [
            (f"{{{labels[d.index]}}}", d.memory_total_mib * MIB)
            for d in devices
            if d.readable and d.memory_total_mib is not None
        ],
    )
    metric(
        "gpuctl_gpu_utilization_ratio",
        "gauge",
        "GPU utilisation over the last sample period, 0 to 1 (no sample: unknown).",
        [
            (f"{{{labels[d.index]}}}", round(d.utilization_pct / 100, 4))
            for d in devices
            if d.readable and d.utilization_pct is not None
        ],
    )
    metric(
        "gpuctl_gpu_memory_free_bytes",
        "gauge",
        "GPU memory free, bytes: total less used (no sample where either is unknown).",
        [
            (f"{{{labels[d.index]}}}", max(0, d.memory_total_mib - d.memory_used_mib) * MIB)
            for d in devices
            if d.readable and d.memory_used_mib is not None and d.memory_total_mib is not None
        ],
    )
    metric(
        "gpuctl_gpu_temperature_celsius",
        "gauge",
        "GPU core temperature, degrees Celsius (no sample where the probe gives none).",
        [
            (f"{{{labels[d.index]}}}", d.temperature_c)
            for d in devices
            if d.readable and d.temperature_c is not None
        ],
    )
    metric(
        "gpuctl_gpu_power_watts",
        "gauge",
        "GPU power draw, watts (no sample where the probe gives none).",
        [
            (f"{{{labels[d.index]}}}", d.power_w)
            for d in devices
            if d.readable and d.power_w is not None
        ],
    )
    on_gpu = [p for p in reading.processes if p.on_gpu]
    metric("gpuctl_gpu_processes", "gauge", "Processes that hold GPU memory.", [("", len(on_gpu))])
    # Per service and GPU, never per pid: a pid label would open a new series with every
    # start. Which process holds what is /status's. The service is the one a record names;
    # never the command line: label values must come from a small set, and command lines
    # can carry secrets.
    services = {**(servers or {}), **recorded_servers(records or ())}
    held: dict[tuple[int, str], int] = {}
    for p in on_gpu:
        if p.memory_mib is not None:
            key = (p.gpu, services.get(p.pid, ""))
            held[key] = held.get(key, 0) + p.memory_mib
    metric(
        "gpuctl_process_memory_bytes",
        "gauge",
        "GPU memory held by a service's processes on one GPU, bytes; service is empty for "
        "the processes no record names.",
        [
            (f'{{gpu="{gpu}",service="{_label(svc)}"}}', mib * MIB)
            for (gpu, svc), mib in sorted(held.items())
        ],
    )


def _start_durations(starts: StartTally, lines: list[str]) -> None:
    """``gpuctl_start_duration_seconds``: each service's successful starts seen by this
    agent (a counter's rules: it only grows while the agent runs)."""
    name = "gpuctl_start_duration_seconds"
    lines.append(
        f"# HELP {name} How long a service's successful starts took, seconds (those this "
        "agent has seen in the records since it started)."
    )
    lines.append(f"# TYPE {name} histogram")
    for service, buckets, total, n in starts.histograms():
        svc = _label(service)
        for le, count in buckets:
            lines.append(f'{name}_bucket{{service="{svc}",le="{le}"}} {count}')
        lines.append(f'{name}_sum{{service="{svc}"}} {_number(round(total, 3))}')
        lines.append(f'{name}_count{{service="{svc}"}} {n}')
