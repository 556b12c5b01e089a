"""Refusals in OpenAI's JSON error shape, so OpenAI clients raise their usual errors;
``Refusal`` and ``ClientGone``, how a request's way through the proxy ends early.

::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}
"""

from __future__ import annotations

import json
import math
from typing import Any


def error_body(
    message: str,
    kind: str,
    code: str,
    *,
    holder: str | None = None,
    status: int | None = None,
    retry_s: float | None = None,
) -> bytes:
    err: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": code}
    if holder:
        err["gpuctl_holder"] = holder
    if status is not None:
        err["status"] = status
    if retry_s is not None:
        err["retry_after"] = int(retry_after(retry_s))
    return json.dumps({"error": err}, separators=(",", ":")).encode()


def retry_after(seconds: float) -> bytes:
    return str(max(1, math.ceil(seconds))).encode()


def sse_error_event(
    message: str, kind: str, code: str, *, status: int | None = None, retry_s: float | None = None
) -> bytes:
    """The event that ends a stream the upstream (or the start) failed.

    Its status line went already (a 200), and a client raises a stream's error event
    without one (the openai client: a bare ``APIError``). So the event carries what the
    status and ``Retry-After`` would have said: ``status``, and for a refusal that may be
    retried, ``retry_after`` (seconds) and a message that says so in words.
    """
    if retry_s is not None:
        message += (
            f" (this may be retried: send the request again in {int(retry_after(retry_s))} s)"
        )
    body = error_body(message, kind, code, status=status, retry_s=retry_s)
    return b"data: " + body + b"\n\n"


class ClientGone(Exception):
    """The client went away while its request was held."""


class Refusal(Exception):
    """Answer with ``status`` and an OpenAI error body (or an error event mid-stream)."""

    def __init__(
        self, status: int, message: str, kind: str, code: str, *, retry_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.retry_s = retry_s


def shutting_down() -> Refusal:
    # A restarted proxy (systemd, a supervisor) answers in seconds: clients that honour
    # Retry-After (the openai client does) come back then.
    return Refusal(
        503,
        "the proxy is shutting down; send the request again (to a proxy that runs)",
        "service_unavailable",
        "proxy_shutting_down",
        retry_s=2,
    )
