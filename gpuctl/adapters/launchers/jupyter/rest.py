"""The Jupyter server's REST API and terminal websockets, with its refusals mapped.

``curl -H 'Authorization: token …' http://host:8888/api/terminals`` and friends; every
transport error or refusal becomes a ``LauncherError`` naming the fix.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from gpuctl.adapters.launchers.jupyter.errors import (
    JupyterUnreachable,
    json_body,
    message,
    refused,
    unexpected,
    unreachable,
)
from gpuctl.adapters.launchers.jupyter.script import SCRIPT_DIR
from gpuctl.adapters.launchers.jupyter.terminal import Terminal
from gpuctl.errors import LauncherError, StartFailed

# A log larger than this is tailed over the terminal, not downloaded whole.
CONTENTS_MAX_BYTES = 1 << 20

__all__ = ["CONTENTS_MAX_BYTES", "JupyterApi", "JupyterUnreachable"]


class JupyterApi:
    """One Jupyter server, as gpuctl talks to it.

    Args:
        base_url: e.g. ``http://100.64.0.10:8888`` (with any ``/user/<name>`` prefix).
        token: sent as ``Authorization: token …`` on every request (so no XSRF is needed).
        host_name: the config's host name, for error messages and hints.
        timeout_s: for each HTTP request, the websocket handshake and each typed line.
    """

    def __init__(self, base_url: str, token: str | None, host_name: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.host_name = host_name
        self.timeout_s = timeout_s

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    @contextmanager
    def client(self) -> Iterator[httpx.Client]:
        with httpx.Client(
            base_url=self.base_url, headers=self.headers(), timeout=self.timeout_s
        ) as client:
            yield client

    def request(
        self, client: httpx.Client, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        """One request; transport errors and refusals become ``LauncherError``."""
        try:
            r = client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None
        if r.status_code in (401, 403):
            raise refused(client, self.base_url, self.host_name, self.token is not None)
        return r

    def unreachable(self, e: BaseException) -> JupyterUnreachable:
        return unreachable(self.base_url, self.host_name, self.timeout_s, e)

    def put(self, client: httpx.Client, path: str, model: dict[str, Any]) -> None:
        r = self.request(client, "PUT", "/api/contents/" + quote(path), json=model)
        if r.status_code not in (200, 201):
            raise StartFailed(
                f"Jupyter at {self.base_url} would not write {path}: "
                f"HTTP {r.status_code} {message(r)}",
                hint=f"the launcher keeps scripts in {SCRIPT_DIR}/ under Jupyter's root_dir; "
                "it must be a writable folder",
            )

    def read_contents(self, client: httpx.Client, rel: str) -> str | None:
        """The text of a root_dir file; '' when missing, None when too big for the API."""
        path = "/api/contents/" + quote(rel)
        r = self.request(client, "GET", path, params={"content": "0", "type": "file"})
        if r.status_code in (400, 404):
            return ""
        if r.status_code != 200:
            raise unexpected(self.base_url, r, "GET", path)
        size = json_body(r).get("size")
        if isinstance(size, int) and size > CONTENTS_MAX_BYTES:
            return None
        # No format: the server sends text, or base64 when the bytes are not UTF-8.
        r = self.request(client, "GET", path, params={"content": "1", "type": "file"})
        if r.status_code in (400, 404):
            return ""
        if r.status_code != 200:
            raise unexpected(self.base_url, r, "GET", path)
        body = json_body(r)
        content = body.get("content")
        if not isinstance(content, str):
            return ""
        if body.get("format") == "base64":
            return base64.b64decode(content).decode("utf-8", errors="replace")
        return content

    @contextmanager
    def terminal(self, client: httpx.Client, name: str) -> Iterator[Terminal]:
        """The named terminal (created if missing) with an open websocket."""
        # websockets is imported here, not at module level: keep CLI start fast.
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        self._ensure_terminal(client, name)
        split = urlsplit(self.base_url)
        scheme = "wss" if split.scheme == "https" else "ws"
        url = f"{scheme}://{split.netloc}{split.path}/terminals/websocket/{name}"
        stack = ExitStack()
        try:
            # Entered as a context manager: websockets 17.1 deprecates the bare call, and
            # a later release may open the connection in __enter__ instead of connect().
            ws = stack.enter_context(
                connect(
                    url,
                    additional_headers=self.headers(),
                    open_timeout=self.timeout_s,
                    close_timeout=2,
                    max_size=None,
                )
            )
        except InvalidStatus as e:
            code = e.response.status_code
            if code in (401, 403):
                raise refused(
                    client, self.base_url, self.host_name, self.token is not None
                ) from None
            raise LauncherError(
                f"Jupyter at {self.base_url} refused the websocket of terminal {name!r} "
                f"(HTTP {code})",
                hint="the terminal may have just closed: try again",
            ) from None
        except (OSError, TimeoutError, WebSocketException) as e:
            raise self.unreachable(e) from None
        with stack:
            term = Terminal(ws, name, self.base_url, self.timeout_s)
            term.send(["set_size", 50, 250])
            yield term

    def _ensure_terminal(self, client: httpx.Client, name: str) -> None:
        # POST with an existing name does not fail: it orphans the old shell. GET first.
        r = self.request(client, "GET", f"/api/terminals/{name}")
        if r.status_code == 200:
            return
        if r.status_code != 404:
            raise unexpected(self.base_url, r, "GET", f"/api/terminals/{name}")
        r = self.request(client, "POST", "/api/terminals", json={"name": name})
        if r.status_code == 404:
            raise LauncherError(
                f"the Jupyter server at {self.base_url} has no terminals",
                hint="pip install jupyter_server_terminals on the host (and do not set "
                "ServerApp.terminals_enabled=False); check the URL's path prefix too",
            )
        if r.status_code != 200:
            raise unexpected(self.base_url, r, "POST", "/api/terminals")
