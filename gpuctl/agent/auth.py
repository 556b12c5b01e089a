"""Bearer tokens: the write token, and the read-only one that is good for GETs only.

Both are compared in constant time (``hmac.compare_digest``): the time an answer takes
must not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac

from gpuctl.agent.http import HttpError, Scope

_AUTH_HINT = (
    "send 'Authorization: Bearer <token>' with the token the agent was started with "
    "(GPUCTL_AGENT_TOKEN or --token-file on the GPU host)"
)


class Tokens:
    """The agent's tokens; None for the write token means no auth (loopback only)."""

    def __init__(self, token: str | None, read_token: str | None = None) -> None:
        self._token = token.encode() if token else None
        self._read_token = read_token.encode() if read_token else None

    def check(self, scope: Scope, *, write: bool) -> bool:
        """Pass, or raise the 401/403 HttpError; nothing to check on an agent without a token.

        Returns:
            Whether the caller may write (the write token, or an agent without one); False
            for the read-only token, which is shown records with their secrets masked.
        """
        if self._token is None:
            return True
        value: bytes | None = None
        for key, val in scope["headers"]:
            if key == b"authorization":
                value = bytes(val)
                break
        if value is None:
            raise HttpError(
                401,
                "this agent requires a bearer token",
                _AUTH_HINT,
                [(b"www-authenticate", b'Bearer realm="gpuctl"')],
            )
        scheme, _, credentials = value.partition(b" ")
        credentials = credentials.strip()
        if scheme.lower() == b"bearer":
            # compare_digest: the time taken must not tell how much of a guess was right.
            if hmac.compare_digest(credentials, self._token):
                return True
            if self._read_token is not None and hmac.compare_digest(credentials, self._read_token):
                if not write:
                    return False
                raise HttpError(
                    403,
                    "this token is read-only: it cannot change the store",
                    "use the agent's write token (GPUCTL_AGENT_TOKEN or --token-file) "
                    "for leases, updates and touches",
                )
        raise HttpError(
            401,
            "the bearer token is wrong",
            _AUTH_HINT,
            [(b"www-authenticate", b'Bearer realm="gpuctl", error="invalid_token"')],
        )
