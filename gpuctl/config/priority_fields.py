"""Validation of the keys that say how a service shares the GPU by priority.

``yield_after``: unused this long, a server is a victim for any start or job that asks
to preempt, whatever the priorities (``gpuctl.core.plan.yields``).
"""

from __future__ import annotations

from gpuctl.config.table import Table


def yield_after(s: Table, kind: str, default: float | None) -> float | None:
    """How long unused before it yields; None (never) for a batch. A batch answers no
    requests, so it would look idle while it works: ``[defaults]``' value passes it by,
    and a ``yield_after`` of its own (other than "never") is refused, not ignored.

    Raises:
        ConfigError: not a duration or "never", or a duration on a batch.
    """
    value = s.timeout_or_never("yield_after", default)
    if kind != "batch":
        return value
    if s.get("yield_after") is not None and value is not None:
        raise s.fail(
            "yield_after",
            "a batch never yields: it answers no requests, so it would look idle while it works",
            hint='drop yield_after (or set it to "never"), or set kind = "server"',
        )
    return None
