"""One renderer per flow result: the text a person reads (on stderr, status lines) and
the versioned JSON envelope a script reads (on stdout).

Every JSON object carries ``schema`` (its version) and ``exit_code``; keys are sorted
when printed. No Rich here: ``ensure --json`` pays for the standard library only.

``ensure --json`` (schema 1)::

    {"schema": 1, "service": "vllm", "host": "dgx", "outcome": "ready", "exit_code": 0,
     "reason": "…", "decision": "IDLE", "launched": true, "waited_s": 312.5,
     "attempt": {…} | null, "log_tail": "", "handle": {…} | null, "notes": [],
     "hint": null}                     # or what to do about a refusal

``stop --json`` (schema 1)::

    {"schema": 1, "service": "vllm", "host": "dgx", "stopped": ["pid 4242"],
     "reason": "stopped pid 4242", "exit_code": 0}
"""

from __future__ import annotations

from typing import Any

from gpuctl.errors import GpuctlError
from gpuctl.flows.op_results import EnsureResult, Outcome, StopResult, TouchResult

SCHEMA = 1


def ensure_to_json(result: EnsureResult) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "service": result.service,
        "host": result.host,
        "outcome": result.outcome.value,
        "exit_code": int(result.exit_code),
        "reason": result.reason,
        "decision": result.decision,
        "launched": result.launched,
        "waited_s": round(result.waited_s, 3),
        "attempt": result.attempt,
        "log_tail": result.log_tail,
        "handle": result.handle,
        "notes": list(result.notes),
        "hint": result.hint or None,  # null for no hint, as in status --json
        "pool": list(result.pool or (result.host,)),
    }


def ensure_text(result: EnsureResult) -> list[str]:
    """``vllm: BUSY: needs …`` then notes, the log's last lines and a ``hint:`` line.

    A refusal of a PREEMPTABLE service (outcome ``busy``, exit 3, as the JSON keeps it)
    reads ``chat: PREEMPTABLE: …``, as ``gpuctl status`` calls it: "BUSY" told the user
    nothing could be done, while the reason names what ``--preempt`` would stop.
    """
    quiet = (Outcome.READY, Outcome.STARTED, Outcome.LOADING)
    mark = result.outcome.value if result.outcome in quiet else result.outcome.value.upper()
    if result.outcome is Outcome.BUSY and result.decision == "PREEMPTABLE":
        mark = "PREEMPTABLE"
    # A pooled service says which host of its pool the answer is about.
    where = f" on {result.host}" if len(result.pool) > 1 else ""
    lines = [f"{result.service}: {mark}{where}: {result.reason}"]
    lines += [f"  {n}" for n in result.notes if not n.startswith("hint: ")]
    if result.log_tail and result.outcome is not Outcome.READY:
        lines.append("  last lines of its log:")
        lines += [f"    {ln}" for ln in result.log_tail.splitlines()[-10:]]
    if result.hint:
        lines.append(f"  hint: {result.hint}")
    return lines


def stop_to_json(result: StopResult) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "service": result.service,
        "host": result.host,
        "stopped": list(result.stopped),
        "reason": result.reason,
        "exit_code": int(result.exit_code),
    }


def stop_error_to_json(service: str, host: str, err: GpuctlError) -> dict[str, Any]:
    """A stop that could not be made (the agent down: exit 4), in stop's own shape, so
    ``--json`` prints its object whatever happened, as every command does."""
    reason = err.message + (f" (hint: {err.hint})" if err.hint else "")
    return {
        "schema": SCHEMA,
        "service": service,
        "host": host,
        "stopped": [],
        "reason": reason,
        "exit_code": int(err.exit_code),
    }


def stop_text(result: StopResult) -> list[str]:
    return [f"{result.service}: {result.reason}"]


def touch_text(result: TouchResult) -> list[str]:
    """``vllm: marked as used``, noting when its record says it is not running (a touch
    only postpones reclaim; it starts nothing)."""
    phase = result.record.phase.value
    done = f"{result.service}: marked as used" + (f" on {result.host}" if result.host else "")
    if phase in ("stopped", "preempted", "failed"):
        return [f"{done} (it is not running: {phase}; `gpuctl ensure {result.service}` starts it)"]
    return [done]
