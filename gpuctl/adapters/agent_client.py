"""The client of a GPU host's agent (docs/reference/agent.md), sync and async.

``AgentClient.status(["vllm"])`` is the same request as::

    curl -H "Authorization: Bearer $TOKEN" 'http://dgx:9400/status?match=vllm'

Whatever goes wrong becomes one error with the agent's URL in its message and the fix in
its hint, so the decision can say UNKNOWN and why (never "idle")::

    AgentUnavailable (exit 4)   refused, timed out, DNS, 5xx, not HTTP, HTML, not JSON,
     │                          JSON that breaks the status contract
     └── AgentAuthError         401 / 403: the agent refused our token

Both clients share ``status_request`` (what to send), ``transport_error`` (httpx
exceptions) and ``parse_response`` (status codes and bodies); only the I/O differs.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import httpx

from gpuctl import __version__
from gpuctl.adapters.http_clients import async_http_client, http_client
from gpuctl.adapters.pipeline import own_pipeline
from gpuctl.adapters.procinfo import host_identity, own_lineage
from gpuctl.core.snapshot import Snapshot
from gpuctl.core.status_wire import parse_status as snapshot_from_wire
from gpuctl.errors import AgentAuthError, AgentUnavailable

__all__ = [
    "AgentClient",
    "AsyncAgentClient",
    "async_http_client",
    "http_client",
    "parse_healthz",
    "parse_response",
    "parse_status",
    "transport_error",
]

_WRONG_PORT_HINT = "is this the right host and port for `gpuctl agent`?"


def _seconds(timeout_s: float) -> str:
    return f"{timeout_s:g}s"


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes (httpx wraps httpcore, which wraps the OSError)."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def transport_error(exc: httpx.HTTPError, url: str, timeout_s: float) -> AgentUnavailable:
    """Turn an httpx exception into one line naming the agent and a hint naming the fix."""
    causes = _chain(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        return AgentUnavailable(
            f"could not connect to the agent at {url} within {_seconds(timeout_s)}",
            hint="is the GPU host up and reachable (VPN, firewall)?",
        )
    if isinstance(exc, httpx.TimeoutException):
        return AgentUnavailable(
            f"the agent at {url} did not answer within {_seconds(timeout_s)}",
            hint="the agent or its GPU probe hangs; check `gpuctl agent` on that host "
            "(or raise the timeout)",
        )
    if isinstance(exc, httpx.ConnectError):
        if any(isinstance(c, socket.gaierror) for c in causes):
            host = httpx.URL(url).host
            return AgentUnavailable(
                f"cannot resolve the agent's host name {host!r} ({url})",
                hint="check the host's `agent` URL in the config, and DNS / your VPN",
            )
        if any(isinstance(c, ConnectionRefusedError) for c in causes):
            return AgentUnavailable(
                f"connection refused by {url}",
                hint="is `gpuctl agent` running on that host, on that port?",
            )
        return AgentUnavailable(
            f"cannot connect to the agent at {url}: {_reason(exc)}",
            hint="is the GPU host up and reachable (VPN, firewall)?",
        )
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return AgentUnavailable(
            f"the agent at {url} broke off or did not speak HTTP: {_reason(exc)}",
            hint=_WRONG_PORT_HINT,
        )
    return AgentUnavailable(
        f"request to the agent at {url} failed: {type(exc).__name__}: {_reason(exc)}",
        hint=_WRONG_PORT_HINT,
    )


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _looks_like_html(resp: httpx.Response) -> bool:
    if "html" in resp.headers.get("content-type", "").lower():
        return True
    head = resp.content[:512].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html", b"<head", b"<body"))


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return json.loads(resp.content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: nested deeper than Python's stack (a hostile or broken peer).
        return None


def parse_response(
    resp: httpx.Response,
    url: str,
    host_name: str | None,
    token_sent: bool,
    *,
    read_only: bool = False,
) -> Any:
    """The JSON body of a 2xx answer, or the AgentUnavailable that explains the answer.

    ``read_only``: the token sent was the host's read-only one, with a write; the agent's
    403 then means that (an AgentAuthError, exit 4 like every refused token).
    """
    code = resp.status_code
    if code in (401, 403):
        where = f"hosts.{host_name}" if host_name else "the host's"
        if host_name:
            fix = f"check hosts.{host_name}.token_env / token_file"
        else:
            fix = "check the host's token_env / token_file in the config"
        if read_only and code == 403:
            raise AgentAuthError(
                f"the agent at {url} refused a write with the read-only token (HTTP 403)",
                hint=f"ensure, touch and stop write: set {where}.token_env or token_file to "
                "the agent's token (the read token is enough for status and locks)",
            )
        if token_sent:
            message = f"the agent at {url} refused our token (HTTP {code})"
        else:
            message = f"the agent at {url} requires a token and we have none (HTTP {code})"
        raise AgentAuthError(message, hint=fix)
    if _looks_like_html(resp):
        raise AgentUnavailable(
            f"{url} answered with HTML (HTTP {code}), not the gpuctl agent API",
            hint=_WRONG_PORT_HINT,
        )
    data = _json_or_none(resp)
    if code >= 400:
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            hint = data.get("hint")
            raise AgentUnavailable(
                f"the agent at {url} answered HTTP {code}: {data['error']}",
                hint=hint
                if isinstance(hint, str) and hint
                else "see the agent's log on the GPU host",
            )
        raise AgentUnavailable(
            f"{url} answered HTTP {code} without the agent's JSON error",
            hint=_WRONG_PORT_HINT,
        )
    if data is None:
        raise AgentUnavailable(
            f"{url} answered something that is not JSON (HTTP {code})", hint=_WRONG_PORT_HINT
        )
    return data


def parse_status(
    resp: httpx.Response, url: str, host_name: str | None, token_sent: bool
) -> Snapshot:
    """A ``/status`` answer as a Snapshot; anything off-contract is AgentUnavailable."""
    data = parse_response(resp, url, host_name, token_sent)
    try:
        return snapshot_from_wire(data)
    except ValueError as err:
        raise AgentUnavailable(
            f"{url} answered something that is not the gpuctl status contract: {err}",
            hint=_WRONG_PORT_HINT + " Are the agent's and this gpuctl's versions compatible?",
        ) from err


def parse_healthz(
    resp: httpx.Response, url: str, host_name: str | None, token_sent: bool
) -> dict[str, Any]:
    data = parse_response(resp, url, host_name, token_sent)
    if not isinstance(data, dict) or data.get("ok") is not True:
        raise AgentUnavailable(
            f"{url} answered /healthz with something that is not the gpuctl agent's",
            hint=_WRONG_PORT_HINT,
        )
    return data


class _Base:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float,
        host_name: str | None,
        read_token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        # GETs only read: with no write token, the host's read-only token will do.
        self.read_token = self.token or read_token or None
        self.timeout_s = timeout_s
        self.host_name = host_name
        self._headers = {"user-agent": f"gpuctl/{__version__}", "accept": "application/json"}
        if self.read_token:
            self._headers["authorization"] = f"Bearer {self.read_token}"
        self._timeout = httpx.Timeout(timeout_s)

    @property
    def token_sent(self) -> bool:
        return self.read_token is not None

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    @staticmethod
    def _params(
        match: Sequence[str], pids: Sequence[int] = (), fresh: bool = False
    ) -> dict[str, str]:
        words = [m for m in match if m]
        if not words and not pids:
            return {"fresh": "1"} if fresh else {}
        # With pids and no keyword (a config without services, and a `gpuctl run` job
        # recorded), still ask with `match`: only then does the agent list the servers
        # its records name in `starting`, where a job not on the GPU yet counts at its
        # budget (without it, two jobs admitted a moment apart could share the memory).
        # Our own process tree (the shell or cron job that runs us names the service)
        # and our pipeline (`| cat | tee X.log`): the agent leaves them out of `starting`
        # when it runs on this same machine. Not the `pipes=` of our stdio: a background
        # job writing into the same pipe is a server, not our pipeline.
        params = {
            "match": ",".join(words),
            "exclude": ",".join(str(p) for p in dict.fromkeys([*own_lineage(), *own_pipeline()])),
            "boot_id": host_identity().boot_id,
        }
        if pids:
            params["pids"] = ",".join(str(p) for p in pids)
        if fresh:
            params["fresh"] = "1"
        return params


class AgentClient(_Base):
    """A keep-alive client of one agent.

    Args:
        base_url: the agent, like ``http://100.64.0.10:9400``.
        token: the bearer token, or None for an agent without one (loopback).
        timeout_s: for connecting and for each read.
        host_name: the config's name of the host, named in auth hints.
        transport: an httpx transport, for tests.
        client: a shared client (``http_client``) to send through; the caller closes it.
        read_token: the host's read-only token, sent when there is no ``token``.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float = 3.0,
        *,
        host_name: str | None = None,
        transport: httpx.BaseTransport | None = None,
        client: httpx.Client | None = None,
        read_token: str | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout_s, host_name, read_token)
        self._owned = client is None
        self._client = client if client is not None else http_client(timeout_s, transport=transport)

    def _get(self, path: str, params: dict[str, str] | None = None) -> httpx.Response:
        url = self._url(path)
        try:
            return self._client.get(
                url, params=params, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url, self.timeout_s) from exc

    def status(
        self, match: Sequence[str] = (), pids: Sequence[int] = (), fresh: bool = False
    ) -> Snapshot:
        """``GET /status[?match=...]`` as a Snapshot; ``fresh``: bypass the agent's cache.

        ``curl -H 'Authorization: Bearer …' 'http://dgx:9400/status?match=vllm&fresh=1'``

        Raises:
            AgentUnavailable: the agent did not give a valid answer (AgentAuthError for 401/403).
        """
        resp = self._get("/status", self._params(match, pids, fresh))
        return parse_status(resp, self.base_url, self.host_name, self.token_sent)

    def healthz(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"ok": true, "version": ...}``."""
        resp = self._get("/healthz")
        return parse_healthz(resp, self.base_url, self.host_name, self.token_sent)

    def close(self) -> None:
        if self._owned:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncAgentClient(_Base):
    """The async twin of ``AgentClient`` (same arguments, an ``httpx.AsyncBaseTransport``)."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float = 3.0,
        *,
        host_name: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: httpx.AsyncClient | None = None,
        read_token: str | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout_s, host_name, read_token)
        self._owned = client is None
        self._client = (
            client if client is not None else async_http_client(timeout_s, transport=transport)
        )

    async def _get(self, path: str, params: dict[str, str] | None = None) -> httpx.Response:
        url = self._url(path)
        try:
            return await self._client.get(
                url, params=params, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url, self.timeout_s) from exc

    async def status(self, match: Sequence[str] = (), pids: Sequence[int] = ()) -> Snapshot:
        """``GET /status[?match=...]`` as a Snapshot (see ``AgentClient.status``)."""
        resp = await self._get("/status", self._params(match, pids))
        return parse_status(resp, self.base_url, self.host_name, self.token_sent)

    async def healthz(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"ok": true, "version": ...}``."""
        resp = await self._get("/healthz")
        return parse_healthz(resp, self.base_url, self.host_name, self.token_sent)

    async def aclose(self) -> None:
        if self._owned:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
