"""The agent's answers from its state store, each declared once as a msgspec Struct.

They are the ``/records`` responses of the agent's OpenAPI document
(``gpuctl.agent.openapi_records``, generated with ``msgspec.json.schema_components``):
what they carry is the store's own shapes (``core.store_shapes``). An answer may grow a
field, so none of them forbids unknown ones.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import UNSET, Meta, Struct, UnsetType

from gpuctl.core.store_shapes import Record, SetAside, Voided, Waiter

__all__ = [
    "InflightList",
    "JobStopped",
    "LeaseGrant",
    "QueueJoined",
    "QueueLeft",
    "QueueList",
    "RecordList",
    "StoreError",
    "VoidedList",
]


class StoreError(Struct):
    """A refused or failed store call."""

    error: Annotated[str, Meta(description="What went wrong.")]
    hint: Annotated[str, Meta(description="What fixes it (may be empty).")] | UnsetType = UNSET


class RecordList(Struct):
    """Every service's record, and the record files set aside."""

    records: list[Record]
    set_aside: list[SetAside] | UnsetType = UNSET


class LeaseGrant(Struct):
    """A lease (or an in-flight entry) granted, or not, with the record as it stands."""

    granted: Annotated[
        bool, Meta(description="false: someone else holds a live lease (see record.lease).")
    ]
    record: Record


class JobStopped(Struct):
    """A job stopped (or it had ended already)."""

    killed: Annotated[bool, Meta(description="It outlived the grace period and got SIGKILL.")]


class VoidedList(Struct):
    """Leases and entries found forged, oldest first."""

    voided: list[Voided]


class InflightList(Struct):
    """Live in-flight holders per service."""

    inflight: Annotated[
        dict[str, Annotated[int, Meta(ge=1)]],
        Meta(description="Requests in flight, by service."),
    ]
    lingering: Annotated[
        dict[str, Annotated[float, Meta(ge=0)]],
        Meta(
            description="Services with lingering entries (no request in flight, but "
            "reclaim keeps them and a preemption waits): seconds until the last lapses."
        ),
    ] = {}


class QueueList(Struct):
    """The waiters, first to be served first."""

    queue: list[Waiter]


class QueueJoined(Struct):
    """The caller's entry and the whole queue."""

    waiter: Waiter
    queue: list[Waiter]


class QueueLeft(Struct):
    """Whether the caller was in the queue."""

    left: bool
