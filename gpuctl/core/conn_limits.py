"""How many connections a server (the agent, the proxy) keeps, and for how long without
a request: the values and their defaults (``gpuctl agent`` options, ``[proxy]`` keys).
The rules they feed are ``gpuctl.agent.connections``'s."""

from __future__ import annotations

import msgspec

DEFAULT_MAX_TOTAL = 2048
# At least 64 from one address (tests, trials and 50 open web pages all come from
# loopback); 256 leaves room for a busy web view and a bench beside them.
DEFAULT_MAX_PER_PEER = 256
DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 5.0
MIN_PER_PEER = 64


class ConnectionLimits(msgspec.Struct, frozen=True):
    """How many connections a server keeps, and for how long without a request.

    Attributes:
        max_total: connections in all (the server cuts it to its descriptor limit).
        max_per_peer: connections from one address (an IPv6 /64); at least 64.
        head_timeout_s: a connection's whole request head must arrive within this,
            from its opening or from its last answer's end.
        idle_timeout_s: a kept-alive connection that sends nothing for this long after
            an answer is closed.
    """

    max_total: int = DEFAULT_MAX_TOTAL
    max_per_peer: int = DEFAULT_MAX_PER_PEER
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def check(self) -> list[str]:
        """What is wrong with these values, one sentence each (empty: nothing)."""
        bad = []
        if self.max_per_peer < MIN_PER_PEER:
            bad.append(
                f"max connections per peer is {self.max_per_peer}, under {MIN_PER_PEER}: "
                "the tests, the trials and the web view's pages all come from loopback"
            )
        if self.max_total < self.max_per_peer:
            bad.append(
                f"max connections ({self.max_total}) is under the per-peer bound "
                f"({self.max_per_peer})"
            )
        if not self.head_timeout_s > 0 or not self.idle_timeout_s > 0:
            bad.append("the header and idle timeouts must be longer than 0")
        return bad
