"""The GPU host's state store: one JSON record per service, each changed only
under that service's file lock and written atomically.

One interface (``Store``, in ``base``), two implementations:

- ``DirectStore`` (``direct``): the files themselves, on the GPU host
  (``GPUCTL_STATE_DIR``). Imported from ``direct`` itself, only where the files are used:
  a client of an agent never loads it.
- ``AgentStore`` (``agent``): the same operations through the host agent's ``/records``
  endpoints, for callers elsewhere (and cron on the host, when an agent runs there). The
  agent serves them with a ``DirectStore``, so both paths work on the same files under
  the same locks, and even a mix of the two cannot double-start.

``codec`` turns record files and wire bodies into ``gpuctl.core.record`` data and back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuctl.adapters.store.agent import AgentStore
from gpuctl.adapters.store.base import _NAME, LOCK_TIMEOUT_S, Store, check_name, holder_here
from gpuctl.core.record import Holder

AGENT_STORE_TIMEOUT_S = LOCK_TIMEOUT_S + 5.0

if TYPE_CHECKING:
    import httpx

    from gpuctl.config import HostConfig


__all__ = [
    "LOCK_TIMEOUT_S",
    "_NAME",
    "AgentStore",
    "Holder",
    "Store",
    "check_name",
    "holder_here",
    "store_for",
]


def store_for(
    host: HostConfig, timeout_s: float | None = None, *, client: httpx.Client | None = None
) -> Store:
    """The host's store: through its agent, or the files here. ``timeout_s`` bounds each
    agent request (default: the host's timeout, at least ``AGENT_STORE_TIMEOUT_S``: a
    lease call may wait ``LOCK_TIMEOUT_S`` for a file lock on the host, and the agent
    must have the time to say so, naming the lock, rather than look hung), while reaching
    the agent takes at most the host's timeout; ``client`` is the command's shared HTTP
    client."""
    if host.agent:
        token = host.token()
        return AgentStore(
            host.agent,
            token,
            timeout_s=timeout_s
            if timeout_s is not None
            else max(host.timeout_s, AGENT_STORE_TIMEOUT_S),
            host_name=host.name,
            client=client,
            read_token=None if token else host.read_token(),
            connect_timeout_s=host.timeout_s,
        )
    from gpuctl.adapters.store.direct import DirectStore
    from gpuctl.config.paths import default_state_dir

    return DirectStore(default_state_dir())
