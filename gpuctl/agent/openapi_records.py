"""The /records part of the agent's OpenAPI document: the state store's paths and schemas.

Every component is generated from the Structs the agent's checks and the store's codec
are built from (``core.record_shapes``, ``core.store_shapes``, ``core.answer_shapes``), so
the request schemas say exactly what the agent accepts, bounds included: a client
generated from them never sends what the agent refuses, and schemathesis can hold the
agent to them (``tests/test_agent_schemathesis.py``).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from gpuctl.agent import wire
from gpuctl.core import answer_shapes as answers
from gpuctl.core import record_shapes as shapes
from gpuctl.core import store_shapes as stored
from gpuctl.core.names import NAME_PATTERN
from gpuctl.core.record import Phase

# The state store's endpoints (gpuctl.agent.store_api). Their errors carry "error" and,
# for store failures, a "hint".
SERVICE_NAME_PATTERN = NAME_PATTERN  # the one rule (gpuctl.core.names), matched in full


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def records_paths(unauthorized: dict[str, Any]) -> dict[str, Any]:
    """The /records paths: list, read, lease (take, renew, release), patch, touch."""

    def err(description: str) -> dict[str, Any]:
        return {
            "description": description,
            "content": {"application/json": {"schema": _ref("StoreError")}},
        }

    def body(schema: str, description: str) -> dict[str, Any]:
        return {
            "required": True,
            "description": description,
            "content": {"application/json": {"schema": _ref(schema)}},
        }

    def ok(schema: str, description: str) -> dict[str, Any]:
        return {
            "description": description,
            "content": {"application/json": {"schema": _ref(schema)}},
        }

    service = {
        "name": "service",
        "in": "path",
        "required": True,
        "description": "The service's name, as in the config.",
        "schema": {"type": "string", "pattern": SERVICE_NAME_PATTERN},
    }
    bad = err("A bad service name or request body.")
    down = err(
        "The store cannot be used: no state directory (agent started without one), "
        "or it cannot be read, written or locked."
    )
    conflict = err("The caller does not hold the lease (any more): it expired, or was voided.")
    # The agent reads the body of every /records request, a GET's too, before it routes.
    too_big = err(f"The request body is over the agent's limit ({wire.MAX_BODY_BYTES} bytes).")
    read_only = err("The token is read-only: it cannot change the store.")
    common = {"400": bad, "401": unauthorized, "413": too_big, "503": down}
    reads = {"401": unauthorized, "413": too_big, "503": down}

    def op(name: str, summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
        # Every operation with a body writes: the read-only token gets 403 (an operation's
        # own 403, the job stop's, says more and wins).
        writes = {"403": read_only} if "requestBody" in extra else {}
        answers = {**writes, **responses, **common}
        return {"operationId": name, "summary": summary, **extra, "responses": answers}

    record = ok("Record", "The record after the operation.")
    return {
        "/records": {
            "get": {
                "operationId": "listRecords",
                "summary": "Every service's record (an expired or void lease reads as none).",
                "responses": {
                    "200": ok("RecordList", "The records, by service name."),
                    **reads,
                },
            }
        },
        "/records/{service}": {
            "parameters": [service],
            "get": op(
                "getRecord",
                "One service's record; a service without one reads as stopped.",
                {"200": ok("Record", "The record (an expired or void lease reads as none).")},
            ),
            "patch": op(
                "updateRecord",
                "Change the record, as the lease holder.",
                {"200": record, "409": conflict},
                requestBody=body("HolderUpdate", "Who asks, and what changes."),
            ),
        },
        "/records/{service}/lease": {
            "parameters": [service],
            "post": op(
                "takeLease",
                "Take the lease (the right to start or stop the service) unless another "
                "holder has a live one. A holder may take its own lease again.",
                {"200": ok("LeaseGrant", "Granted, or not, with the record as it stands.")},
                requestBody=body("LeaseRequest", "Who asks, and for how long."),
            ),
        },
        "/records/{service}/lease/renew": {
            "parameters": [service],
            "post": op(
                "renewLease",
                "Extend the lease, as its holder.",
                {"200": record, "409": conflict},
                requestBody=body("RenewRequest", "The holder's id and the new time to live."),
            ),
        },
        "/records/{service}/lease/release": {
            "parameters": [service],
            "post": op(
                "releaseLease",
                "Apply an update and drop the lease, if the caller still holds it; "
                "otherwise nothing changes.",
                {"200": record},
                requestBody=body("ReleaseRequest", "The holder's id and a last update."),
            ),
        },
        "/records/{service}/touch": {
            "parameters": [service],
            "post": op(
                "touchRecord",
                "Mark a use: last_used = now. Needs no lease.",
                {"200": record},
                requestBody={
                    **body("TouchRequest", "Whether the caller saw it answer."),
                    "required": False,
                },
            ),
        },
        "/records/{service}/inflight": {
            "parameters": [service],
            "post": op(
                "beginInflight",
                "Count the caller as using the service (requests in flight), and mark a use; "
                "refused while a stop holds the lease.",
                {"200": ok("LeaseGrant", "Counted, or not, with the record as it stands.")},
                requestBody=body("InflightRequest", "Who uses it, and for how long at most."),
            ),
        },
        "/records/{service}/inflight/renew": {
            "parameters": [service],
            "post": op(
                "renewInflight",
                "Keep the caller's in-flight entry alive, and mark a use.",
                {"200": record},
                requestBody=body("InflightRequest", "Who uses it, and for how long at most."),
            ),
        },
        "/records/{service}/inflight/end": {
            "parameters": [service],
            "post": op(
                "endInflight",
                "The caller has nothing in flight on the service any more.",
                {"200": record},
                requestBody=body("InflightEnd", "The holder's id."),
            ),
        },
        "/records/{service}/stop": {
            "parameters": [service],
            "post": op(
                "stopJob",
                "Stop a `gpuctl run --preemptible` job whose CMD runs on this agent's "
                "machine, as the holder of its lease: SIGTERM to its process group, the "
                "grace period, SIGKILL. Only the pid and start time its live record names; "
                "a pid now used by another process is never signalled. The caller then "
                "releases the lease with phase preempted.",
                {
                    "200": ok("JobStopped", "Stopped (or it had ended already)."),
                    "403": err(
                        "The job was not started with --preemptible, or this agent may not "
                        "signal it (another user's process); or the token is read-only."
                    ),
                    "404": err("No running run job by that name (records run.NAME)."),
                    "409": err(
                        "The record names another pid or start time, or another machine; "
                        "or the caller does not hold the job's lease."
                    ),
                },
                requestBody=body("JobStopRequest", "The lease holder, the pid, the grace."),
            ),
        },
        "/records/_inflight": {
            "get": {
                "operationId": "listInflight",
                "summary": "Live in-flight holders per service (services that have some).",
                "responses": {
                    "200": ok("InflightList", "Counts by service."),
                    **reads,
                },
            }
        },
        "/records/_voided": {
            "get": {
                "operationId": "listVoided",
                "summary": "Leases and in-flight and queue entries found forged (a term longer "
                "than their kind's, a holder at pid 1 or without a start time on this host): "
                "they count for nothing, and are kept for a person (`gpuctl locks`).",
                "responses": {
                    "200": ok("VoidedList", "Oldest first; one `more` row counts the rest."),
                    **reads,
                },
            }
        },
        "/records/_queue": {
            "get": {
                "operationId": "listQueue",
                "summary": "The host's wait queue (`gpuctl run --wait`): live waiters, in the "
                "order they will be served (priority, then arrival).",
                "responses": {
                    "200": ok("QueueList", "The waiters, first to be served first."),
                    **reads,
                },
            },
            "post": {
                "operationId": "joinQueue",
                "summary": "Join the wait queue, or renew the caller's entry (same holder id: "
                "it keeps its place). An entry lapses at its expiry, or at once when its "
                "holder's process is dead on this host.",
                "requestBody": body("QueueJoin", "Who waits, for how long at most, and what."),
                "responses": {
                    "200": ok("QueueJoined", "The caller's entry and the whole queue."),
                    "400": bad,
                    "403": read_only,
                    **reads,
                },
            },
        },
        "/records/_queue/leave": {
            "post": {
                "operationId": "leaveQueue",
                "summary": "Leave the wait queue (admitted, gave up, interrupted).",
                "requestBody": body("QueueLeave", "The holder's id."),
                "responses": {
                    "200": ok("QueueLeft", "Whether the caller was in the queue."),
                    "400": bad,
                    "403": read_only,
                    **reads,
                },
            }
        },
    }


# The request bodies (``core.record_shapes``), the store's shapes (``core.store_shapes``)
# and the answers (``core.answer_shapes``): every /records component is one of them, or
# a type their fields name (Holder, Phase, Lease, Record, …).
REQUESTS: Final = (
    shapes.LeaseRequest,
    shapes.RenewRequest,
    shapes.HolderUpdate,
    shapes.ReleaseRequest,
    shapes.TouchRequest,
    shapes.InflightRequest,
    shapes.InflightEnd,
    shapes.QueueJoin,
    shapes.QueueLeave,
    shapes.JobStopRequest,
)
ANSWERS: Final = (
    answers.StoreError,
    answers.RecordList,
    answers.LeaseGrant,
    answers.JobStopped,
    answers.VoidedList,
    answers.InflightList,
    answers.QueueList,
    answers.QueueJoined,
    answers.QueueLeft,
)
# The store writes every field of these (a default is what a reader fills in where a
# file an older release wrote lacks it), so an answer's schema requires them all.
WRITTEN_WHOLE: Final = (stored.Record, stored.Lease, stored.QueueLease, stored.Failure)


def records_schemas() -> dict[str, Any]:
    """The components of the /records endpoints, generated from the Structs declared once
    (``REQUESTS``, ``ANSWERS``, and what they name) with ``msgspec.json.schema_components``.

    What msgspec cannot say is added after, here and only here:

    - a handle and an attempt are open objects: their known fields as their Struct types
      them, and at most ``MAX_EXTRA_KEYS`` more short scalars (``shapes.ExtraValue``), as
      ``wire.shaped`` checks them;
    - a body's ``event`` is the journal's ``Event`` (``core.events`` checks it);
    - a promise's GPUs are each listed once (``uniqueItems``; the codec's ``_devices``);
    - the store writes every field of a record, a lease and a failure (``WRITTEN_WHOLE``);
    - ``Phase`` lists the phases in the lifecycle's order.
    """
    template = "#/components/schemas/{name}"
    [extra], _ = msgspec.json.schema_components([shapes.ExtraValue], ref_template=template)
    named = (*REQUESTS, shapes.Handle, shapes.Attempt, *ANSWERS)
    _, out = msgspec.json.schema_components(named, ref_template=template)
    update = out["RecordUpdate"]["properties"]
    for name, known in shapes.FREE_OBJECTS.items():
        shown = out.pop(known.__name__)
        loose = update[name]
        nullable = "anyOf" in loose
        free = next(s for s in loose["anyOf"] if s.get("type") == "object") if nullable else loose
        free = {
            "type": "object",
            "description": free["description"],
            "properties": shown["properties"],
            "additionalProperties": extra,
            "propertyNames": free["propertyNames"],
            "maxProperties": free["maxProperties"],
        }
        update[name] = {"anyOf": [free, {"type": "null"}]} if nullable else free
    for body in ("LeaseRequest", "HolderUpdate", "ReleaseRequest"):
        out[body]["properties"]["event"] = {
            **_ref("Event"),
            "description": "The journal's event for this write (kept if it lands).",
        }
    devices = out["Promise"]["properties"]["devices"]
    next(s for s in devices["anyOf"] if s.get("type") == "array")["uniqueItems"] = True
    for whole in WRITTEN_WHOLE:
        out[whole.__name__]["required"] = list(out[whole.__name__]["properties"])
    out["Phase"]["enum"] = [p.value for p in Phase]  # in the lifecycle's order
    out["Holder"]["description"] = "Who asks for a lease: a fresh id per call, and its process."
    out["RecordUpdate"]["description"] = "Changes to a record; every key is optional."
    return out
