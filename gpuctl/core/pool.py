"""A pool's pure rules: a host's identity, the pool's coordinator, and which host a start
goes to (``gpuctl.flows.ensure.pool`` acts on them).

A host is known by what its agent reports, never by what a config calls it: two laptops
may list a pool's hosts in other orders, under other names, and must still agree on one
coordinator and see one copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

# The pool's record on its coordinator: its lease is the pool's start lock, and its
# ``runs_on`` names the host the copy was started on.
POOL_RECORD_PREFIX = "_pool."


def pool_record(service: str) -> str:
    """The store name of ``service``'s pool record (``_pool.NAME``)."""
    return f"{POOL_RECORD_PREFIX}{service}"


def host_key(hostname: str, boot_id: str, state_dir: str | None) -> str:
    """A host by identity: 32 hex digits of a digest of its agent's hostname, boot id and
    state folder. The state folder tells apart two agents on one machine (each keeps its
    own store); the same agent gives the same key to every caller."""
    text = "\0".join((hostname, boot_id, state_dir or ""))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def identity_order(hostname: str, boot_id: str, state_dir: str | None) -> tuple[str, str, str]:
    """The order the coordinator is chosen by: the host whose identity sorts first."""
    return (hostname, boot_id, state_dir or "")


def room_left(free_mib: int | None, need_mib: int | None) -> float:
    """What a host has left once the service starts there (the tightest fit goes first,
    so the roomiest hosts stay whole); a host that cannot tell sorts last."""
    if free_mib is None:
        return float("inf")
    return float(free_mib - (need_mib or 0))


def pool_service(name: str) -> str | None:
    """The pooled service whose pool record ``name`` is (None: not a pool record)."""
    return name[len(POOL_RECORD_PREFIX) :] if name.startswith(POOL_RECORD_PREFIX) else None


def pool_of(pools: Mapping[str, Sequence[str]], name: str) -> list[str] | None:
    """The ``pool`` of a row about ``name`` (a service, or its pool's record) in the
    ``--json`` outputs: its pool's hosts, None for a service on one host."""
    hosts = pools.get(pool_service(name) or name)
    return list(hosts) if hosts is not None else None


def gathered(
    rows: Iterable[T],
    place: Callable[[T], tuple[str, str]],
    pools: Mapping[str, Sequence[str]],
) -> list[T]:
    """``rows`` with each pooled service's rows together, where its first row was, in
    its pool's host order (rows of one host keep theirs); every other row stays where it
    was. ``place``: a row's service and host; ``pools``: each pooled service's hosts.
    One service read host by host reads as one service, as ``status`` groups it."""
    slots: list[list[T]] = []
    groups: dict[str, list[T]] = {}
    for row in rows:
        service = place(row)[0]
        if service not in pools:
            slots.append([row])
        elif service in groups:
            groups[service].append(row)
        else:
            groups[service] = [row]
            slots.append(groups[service])
    for service, group in groups.items():
        order = {host: i for i, host in enumerate(pools[service])}
        group.sort(key=lambda row: order.get(place(row)[1], len(order)))
    return [row for slot in slots for row in slot]
