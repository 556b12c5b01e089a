"""A record with its secrets masked: how it is shown to anyone but the store's writers.

A record holds what its writer was given: a health URL with a password or a
``?token=`` (a server behind an authenticating proxy), and a failed start's error and
log tail (a server's log can print its own ``--api-key``). The agent's read-only token,
and every record gpuctl prints (``gpuctl locks``, ``--json``), see those masked. The
store itself, and the write token's client that fetches that health URL, keep them.
"""

from __future__ import annotations

from msgspec.structs import replace

from gpuctl.core.record import Record
from gpuctl.core.redact import redact_lines, show_url


def masked(record: Record) -> Record:
    """``record`` with its health URL shown as ``core.redact.show_url`` shows URLs, and its
    failure's and attempts' texts redacted line by line."""
    failure = record.failure
    if failure is not None:
        failure = replace(
            failure, error=redact_lines(failure.error), log_tail=redact_lines(failure.log_tail)
        )
    attempts = tuple(
        {**a, "error": redact_lines(a["error"])} if isinstance(a.get("error"), str) else a
        for a in record.attempts
    )
    return replace(
        record,
        health=show_url(record.health) if record.health else record.health,
        failure=failure,
        attempts=attempts,
    )
