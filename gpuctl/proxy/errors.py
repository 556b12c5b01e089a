"""Refusals in OpenAI's JSON error shape, so OpenAI clients raise their usual errors;
``Refusal`` and ``ClientGone``, how a request's way through the proxy ends early.

::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}
"""

from __future__ import annotations

import json
import math
from typing import Any


def error_body(message: str, kind: str, code: str, *, holder: str | None = None) -> bytes:
    err: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": code}
    if holder:
        err["gpuctl_holder"] = holder
    return json.dumps({"error": err}, separators=(",", ":")).encode()


def retry_after(seconds: float) -> bytes:
    return str(max(1, math.ceil(seconds))).encode()


def sse_error_event(message: str, kind: str, code: str) -> bytes:
    """The event that ends a stream the upstream (or the start) failed."""
    return b"data: " + error_body(message, kind, code) + b"\n\n"


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
