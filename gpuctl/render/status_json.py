"""The ``gpuctl status --json`` object (schema 1). No Rich here: scripts pay for JSON only.

::

    {
      "schema": 1,
      "taken_at": "2026-11-29T10:00:00.000Z",   # ISO-8601 UTC, milliseconds, everywhere
      "ok": true,                       # every host answered
      "hosts": [{
        "name": "dgx", "source": "http://…:9400", "ok": true,
        "error": null, "hint": null,
        "probe": "nvml", "memory_used_mib": 8234, "memory_total_mib": 131072,
        "memory_promised_mib": 73686,   # promised beyond what is held, to loading services
        "unified_memory": true, "is_idle": false, "taken_at": "…",
        "host": {"hostname": "…", "boot_id": "…"}, "state_dir": "/var/lib/gpuctl",
        "notes": [],                    # the probe's, for a person (sim: gpu.json wins)
        "devices": [{"index": 0, "name": "NVIDIA GB10", "uuid": "GPU-…",
                     "memory_used_mib": 8234, "memory_total_mib": 131072,
                     "memory_promised_mib": 73686, "unified": true,
                     "utilization_pct": 37, "temperature_c": 41, "power_w": 12.5,
                     "error": null,     # per GPU; null figures are unknown, never 0
                     "mig": []}],       # MIG on: [{"id", "uuid", "memory_used_mib",
                                        # "memory_total_mib"}], one room each
        "processes": [{"pid": 1, "command": "…", "memory_mib": 8200, "user": "me",
                       "container": null, "gpu": 0, "on_gpu": true, "sm_util_pct": 12,
                       "mig": null, "service": "vllm"}],
        "starting":  [{"pid": 2, "command": "…", "user": "me", "service": "vllm"}],
        "others":    [{"name": "chat", "in_config": false, "phase": "starting",
                       "budget_mib": 81920, "priority": 100, "kind": "server",
                       "devices": null, "promise_known": true, "pids": [3],
                       "memory_mib": 2048, "reason": "…"}]   # only other configs name it
      }],
      "services": [{
        "name": "vllm", "host": "dgx", "decision": "LOADING", "reason": "…",
        "health": "refused", "memory_mib": 8200, "budget_mib": 81920,
        "pids": [1, 2], "priority": 100,
        "gpu": null,                    # the GPU it fits on (IDLE, FITS), else null
        "yields": false,                # idle past its yield_after: any preempting start stops it
        "idle_s": null,                 # with yields: how long it has been idle
        "victims": [{"name": "chat", "gpu": 0, "frees_mib": 81920, "priority": 100,
                     "job": false, "idle_s": 720.0}],  # PREEMPTABLE: what it would stop
        "pool": null                    # a pooled service: its hosts (one row per host)
      }]
    }

A host that did not answer has ``ok: false``, its ``error`` and ``hint``, null figures
and empty lists; its services are UNKNOWN (or READY if they answer health).
"""

from __future__ import annotations

from typing import Any

from gpuctl.core.decision import Decision
from gpuctl.core.snapshot import GpuProcess
from gpuctl.core.timestamps import normalise_iso
from gpuctl.flows.results import HostReport, OtherService, StatusReport
from gpuctl.render.others import other_reason

SCHEMA = 1


# The decisions whose holders are the answer to "who holds the GPU" (FITS lists the
# processes it fits beside in its reason only).
_NAMES_HOLDERS = (Decision.BUSY, Decision.PREEMPTABLE)


def _holder(h: HostReport, p: GpuProcess) -> dict[str, Any]:
    """Who holds memory a service needs: the process (its command as the probe read it,
    redacted there, as in ``processes``) and, when it is ours, the service or run job and
    its priority."""
    owner = h.owner(p.pid, p.command)
    return {
        "pid": p.pid,
        "command": p.command,
        "memory_mib": p.memory_mib,
        "gpu": p.gpu,
        "user": p.user,
        "service": owner.name if owner else None,
        "priority": owner.priority if owner else None,
    }


def _other(o: OtherService) -> dict[str, Any]:
    """A service only another config names, at its record's promise (nulls: an older
    release wrote the record, and what it promised is unknown)."""
    p = o.promise
    return {
        "name": o.name,
        "in_config": False,
        "phase": o.phase,
        "budget_mib": p.memory_mib if p else None,
        "priority": p.priority if p else None,
        "kind": p.kind if p else None,
        "devices": list(p.devices) if p and p.devices is not None else None,
        "promise_known": p is not None,
        "pids": list(o.pids),
        "memory_mib": o.memory_mib,
        "reason": other_reason(o),
    }


def status_to_json(report: StatusReport) -> dict[str, Any]:
    hosts: list[dict[str, Any]] = []
    services: list[dict[str, Any]] = []
    for h in report.hosts:
        snap = h.snapshot
        entry: dict[str, Any] = {
            "name": h.name,
            "source": h.source,
            "ok": h.ok,
            "error": h.error,
            "hint": h.hint,
            "probe": snap.probe if snap else None,
            "memory_used_mib": snap.memory_used_mib if snap else None,
            "memory_total_mib": h.total_mib,
            "unified_memory": snap.unified_memory if snap else None,
            "is_idle": snap.is_idle if snap else None,
            "memory_promised_mib": sum(m.promised_mib for m in h.memory)
            if snap and not any(m.unknown_promises for m in h.memory)
            else None,
            "taken_at": normalise_iso(snap.taken_at) if snap else None,
            "host": snap.host.to_wire() if snap and snap.host else None,
            "state_dir": snap.state_dir if snap else None,
            "notes": list(snap.notes) if snap else [],
            "devices": [],
            "processes": [],
            "starting": [],
            "others": [_other(o) for o in h.others],
        }
        if snap:
            promised = {
                m.gpu if m.gpu is not None else 0: None if m.unknown_promises else m.promised_mib
                for m in h.memory
            }
            for d in snap.device_list():
                entry["devices"].append(
                    {**d.to_wire(), "memory_promised_mib": promised.get(d.index)}
                )
            for p in snap.processes:
                owner = h.owner(p.pid, p.command)
                entry["processes"].append({**p.to_wire(), "service": owner.name if owner else None})
            for s in snap.starting or ():
                owner = h.owner(s.pid, s.command)
                entry["starting"].append({**s.to_wire(), "service": owner.name if owner else None})
        hosts.append(entry)
        for svc, v, hh in zip(h.services, h.verdicts, h.health, strict=True):
            services.append(
                {
                    "name": svc.name,
                    "host": h.name,
                    "decision": v.decision.value,
                    "reason": f"{v.reason} (hint: {v.hint})" if v.hint else v.reason,
                    "health": hh.state,
                    # An Ollama model has no process: its server says what it holds.
                    "memory_mib": v.own_memory_mib
                    if v.own or hh.memory_mib is None
                    else hh.memory_mib,
                    "budget_mib": svc.memory_mib,
                    "priority": svc.priority,
                    "pids": [p.pid for p in v.own] + [s.pid for s in v.starting],
                    "gpu": v.gpu,
                    "yields": svc.name in h.yielding,
                    "idle_s": h.yielding.get(svc.name),
                    "hint": v.hint or None,
                    "victims": [
                        {
                            "name": x.name,
                            "gpu": x.gpu,
                            "frees_mib": x.frees_mib,
                            "priority": x.priority,
                            "job": x.job,
                            "idle_s": x.idle_s,
                        }
                        for x in (v.plan.victims if v.plan else ())
                    ],
                    "holders": [_holder(h, p) for p in v.holders]
                    if v.decision in _NAMES_HOLDERS
                    else [],
                    "pool": list(svc.hosts) if svc.pooled else None,
                }
            )
    return {
        "schema": SCHEMA,
        "taken_at": report.taken_at,
        "ok": all(h.ok for h in report.hosts),
        "hosts": hosts,
        "services": services,
    }
