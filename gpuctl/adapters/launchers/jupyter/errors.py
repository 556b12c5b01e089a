"""What a Jupyter server's refusals mean, as ``LauncherError``s with a hint naming the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpuctl.errors import LauncherError


class JupyterUnreachable(LauncherError):
    """The Jupyter server did not answer (refused, timed out, reset)."""


def unreachable(
    base_url: str, host_name: str, timeout_s: float, e: BaseException
) -> JupyterUnreachable:
    if isinstance(e, httpx.TimeoutException | TimeoutError):
        what = f"JupyterLab at {base_url} did not answer within {timeout_s:g}s"
    else:
        what = f"cannot reach JupyterLab at {base_url}: is it running?"
    return JupyterUnreachable(
        f"{what} ({type(e).__name__}: {e})" if str(e) else what,
        hint=f"start it on {host_name}, or fix hosts.{host_name}.jupyter",
    )


def refused(client: httpx.Client, base_url: str, host_name: str, has_token: bool) -> LauncherError:
    """A 401/403: our token, or (when even ``GET /api`` is refused) the Host header."""
    try:
        # GET /api needs no token: refused even there means the Host check refused us.
        open_status = client.get("/api").status_code
    except httpx.HTTPError:
        open_status = 0
    if open_status == 403:
        host = urlsplit(base_url).hostname
        return LauncherError(
            f"Jupyter at {base_url} refused the Host header {host!r} "
            "(it listens on loopback and accepts only local names)",
            hint="start Jupyter with --ServerApp.allow_remote_access=True",
        )
    h = host_name
    if not has_token:
        return LauncherError(
            f"Jupyter at {base_url} wants a token and we have none",
            hint=f"set hosts.{h}.jupyter_token_env or hosts.{h}.jupyter_token_file",
        )
    return LauncherError(
        f"Jupyter at {base_url} refused our token",
        hint=f"check hosts.{h}.jupyter_token_env / jupyter_token_file "
        "(a 403 \"'_xsrf' argument missing\" means the same)",
    )


def unexpected(base_url: str, r: httpx.Response, method: str, path: str) -> LauncherError:
    return LauncherError(
        f"Jupyter at {base_url} answered HTTP {r.status_code} to {method} {path}: {message(r)}",
        hint="is the URL a Jupyter server (with any /user/<name> prefix)?",
    )


def json_body(r: httpx.Response) -> Mapping[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def message(r: httpx.Response) -> str:
    msg = json_body(r).get("message")
    return str(msg) if msg else r.reason_phrase
