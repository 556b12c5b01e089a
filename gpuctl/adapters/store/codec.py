"""Record files and wire bodies to ``core.record`` data and back."""

from __future__ import annotations

import json
from typing import Any

from gpuctl.core.record import Failure, Holder, Lease, Phase, Record


def encode_record(record: Record) -> str:
    """The record file's text (sorted keys, so diffs and fixtures read well)."""
    return json.dumps(record.to_dict(), sort_keys=True, indent=1)


def decode_record(d: Any) -> Record:
    """Parse a stored record; raises ValueError (or KeyError/TypeError) when it is broken."""
    if not isinstance(d, dict) or "service" not in d:
        raise ValueError("not a gpuctl record")
    handle = d.get("handle")
    attempts = d.get("attempts") or []
    if not isinstance(attempts, list):
        raise ValueError("attempts is not a list")
    return Record(
        service=str(d["service"]),
        phase=Phase(d.get("phase", "stopped")),
        since=float(d.get("since") or 0.0),
        last_used=float(d["last_used"]) if d.get("last_used") is not None else None,
        lease=decode_lease(d["lease"]) if d.get("lease") else None,
        handle=handle if isinstance(handle, dict) else None,
        attempts=tuple(a for a in attempts if isinstance(a, dict)),
        failure=decode_failure(d["failure"]) if d.get("failure") else None,
        recovered=d.get("recovered") if isinstance(d.get("recovered"), str) else None,
    )


def decode_lease(d: dict[str, Any]) -> Lease:
    return Lease(
        str(d["holder"]),
        str(d.get("host", "")),
        str(d.get("boot_id", "")),
        int(d.get("pid", 0)),
        float(d["pid_start"]) if d.get("pid_start") is not None else None,
        str(d.get("entry", "?")),
        float(d.get("granted", 0.0)),
        float(d["expires"]),
    )


def decode_failure(d: dict[str, Any]) -> Failure:
    return Failure(
        at=float(d["at"]),
        error=str(d.get("error", "")),
        log_tail=str(d.get("log_tail", "")),
        count=int(d.get("count", 1)),
        backoff_until=float(d.get("backoff_until", 0.0)),
    )


def decode_holder(d: Any) -> Holder:
    if not isinstance(d, dict):
        raise ValueError("holder must be an object")
    return Holder(
        id=str(d["id"]),
        host=str(d.get("host", "")),
        boot_id=str(d.get("boot_id", "")),
        pid=int(d.get("pid", 0)),
        pid_start=float(d["pid_start"]) if d.get("pid_start") is not None else None,
        entry=str(d.get("entry", "?")),
    )
