"""The /records part of the agent's OpenAPI document: the state store's paths and schemas.

The request schemas say exactly what the agent accepts (``gpuctl.agent.wire`` and the
store's record schema, ``gpuctl.adapters.store.codec``), bounds included, so a client
generated from them never sends what the agent refuses, and schemathesis can hold the
agent to them (``tests/test_agent_schemathesis.py``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gpuctl.adapters.store import codec
from gpuctl.agent import job_stop, wire
from gpuctl.core import record_shapes as shapes
from gpuctl.core.names import NAME_PATTERN
from gpuctl.core.pids import PID_MAX
from gpuctl.core.promise import MAX_DEVICE_INDEX
from gpuctl.core.record import DURATION_MAX, INFLIGHT_TTL_MAX_S, RECORD_SCHEMA, Phase

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


def shaped_schemas() -> dict[str, Any]:
    """The components of the shapes declared once in ``core.record_shapes``, generated.

    A handle and an attempt are open objects: their known fields as their Struct types
    them, and at most ``MAX_EXTRA_KEYS`` more short scalars (``shapes.ExtraValue``), as
    ``wire.shaped`` checks them. A lease request's promise is the store's ``Promise``.
    """
    template = "#/components/schemas/{name}"
    named = (
        shapes.LeaseRequest,
        shapes.RenewRequest,
        shapes.HolderUpdate,
        shapes.ReleaseRequest,
        shapes.Handle,
        shapes.Attempt,
    )
    [extra], _ = msgspec.json.schema_components([shapes.ExtraValue], ref_template=template)
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
    out["LeaseRequest"]["properties"]["promise"] = {
        "anyOf": [_ref("Promise"), {"type": "null"}],
        "description": "What the start this lease is for promises (kept in the record).",
    }
    out["Phase"]["enum"] = [p.value for p in Phase]  # in the lifecycle's order
    out["Holder"]["description"] = "Who asks for a lease: a fresh id per call, and its process."
    out["RecordUpdate"]["description"] = "Changes to a record; every key is optional."
    return out


def records_schemas() -> dict[str, Any]:
    """The schemas of the /records endpoints (``gpuctl.core.record``; the request bodies
    and what they carry are generated: ``shaped_schemas``)."""
    number = {"type": "number"}
    nullable_number = {"type": ["number", "null"]}
    epoch = {**number, "description": "Seconds since the epoch."}
    ttl = {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": wire.MAX_TTL_S,
        "description": "Seconds until the lease expires by itself (finite, at most a week).",
    }
    holder_id = {
        "type": "string",
        "minLength": 1,
        "maxLength": wire.MAX_SHORT_TEXT,
        "description": "The holder's id (Holder.id).",
    }
    inflight_id = {
        "type": "string",
        "pattern": f"^{wire.INFLIGHT_ID.pattern}$",
        "description": "The holder's id: it names the entry's file (uuid hex does).",
    }
    queue_id = {
        "type": "string",
        "pattern": f"^{codec.QUEUE_ID.pattern}$",
        "description": "The waiter's holder id: it names the entry's file (uuid hex does).",
    }
    pid = {"type": "integer", "minimum": 1, "maximum": PID_MAX}

    def text(most: int, least: int = 0) -> dict[str, Any]:
        return {"type": "string", "minLength": least, "maxLength": most}

    def nullable(schema: dict[str, Any]) -> dict[str, Any]:
        return {"oneOf": [schema, {"type": "null"}]}

    return {
        **shaped_schemas(),
        "StoreError": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"type": "string", "description": "What went wrong."},
                "hint": {"type": "string", "description": "What fixes it (may be empty)."},
            },
        },
        "Lease": {
            "type": "object",
            "description": "The right to start (or stop) a service; only the holder launches.",
            "required": [
                "holder",
                "host",
                "boot_id",
                "pid",
                "pid_start",
                "entry",
                "granted",
                "expires",
            ],
            "properties": {
                "holder": holder_id,
                "host": {"type": "string", "description": "The holder's hostname."},
                "boot_id": {"type": "string", "description": "The holder's kernel boot id."},
                "pid": {"type": "integer"},
                "pid_start": {
                    **nullable_number,
                    "description": "The holder process's start time: a reused pid is not it.",
                },
                "entry": {"type": "string", "description": "ensure, proxy, cron, …"},
                "granted": epoch,
                "expires": epoch,
            },
        },
        "Failure": {
            "type": "object",
            "required": ["at", "error", "log_tail", "count", "backoff_until"],
            "properties": {
                "at": epoch,
                "error": {"type": "string"},
                "log_tail": {"type": "string"},
                "count": {"type": "integer", "description": "Consecutive failed starts."},
                "backoff_until": {
                    **epoch,
                    "description": "No new start before this (10 s, doubling, at most 300 s).",
                },
            },
        },
        "Record": {
            "type": "object",
            "description": "A service's record on this host: its phase, lease, handle and history.",
            "required": [
                "schema",
                "service",
                "phase",
                "since",
                "last_used",
                "lease",
                "handle",
                "attempts",
                "failure",
                "recovered",
                "start_nonce",
                "health",
                "promise",
            ],
            "properties": {
                "schema": {"const": RECORD_SCHEMA},
                "service": {"type": "string"},
                "phase": _ref("Phase"),
                "since": {**epoch, "description": "When the phase last changed."},
                "last_used": {**nullable_number, "description": "When it was last used."},
                "lease": {
                    "oneOf": [_ref("Lease"), {"type": "null"}],
                    "description": "A live lease, else null (expired and void ones read as null).",
                },
                "handle": {
                    "type": ["object", "null"],
                    "description": "What the launcher needs to find the server again.",
                },
                "attempts": {
                    "type": "array",
                    "items": {"type": "object"},
                    "description": "The last start attempts (at most 10).",
                },
                "failure": {"oneOf": [_ref("Failure"), {"type": "null"}]},
                "recovered": {
                    "type": ["string", "null"],
                    "description": "Set once when a broken record file was set aside.",
                },
                "start_nonce": {
                    "type": ["string", "null"],
                    "pattern": "^[0-9a-f]{8,64}$",
                    "description": "The last start's GPUCTL_START_NONCE (finds its server).",
                },
                "health": {
                    "type": ["string", "null"],
                    "description": "The URL that tells the server answers (http or https).",
                },
                "promise": {
                    "oneOf": [_ref("Promise"), {"type": "null"}],
                    "description": "What its last start promised; null from an older release.",
                },
            },
        },
        "Promise": {
            "type": "object",
            "description": (
                "What a start promises the host, written with its lease: every client counts "
                "the service at these figures, whatever its own config says of it."
            ),
            "additionalProperties": False,
            "required": ["memory_mib", "priority"],
            "properties": {
                "memory_mib": {
                    **nullable({"type": "integer", "minimum": 1, "maximum": 1 << 40}),
                    "description": "Its memory budget in MiB; null: none.",
                },
                "priority": {
                    "type": "integer",
                    "minimum": -codec.PRIORITY_MAX,
                    "maximum": codec.PRIORITY_MAX,
                },
                "devices": {
                    **nullable(
                        {
                            "type": "array",
                            "items": {
                                "type": "integer",
                                "minimum": 0,
                                "maximum": MAX_DEVICE_INDEX,
                            },
                            "minItems": 1,
                            "uniqueItems": True,
                            "maxItems": MAX_DEVICE_INDEX + 1,
                        }
                    ),
                    "description": "The GPUs it may land on; null: any one.",
                },
                "kind": {"enum": ["server", "batch"]},
                "resume": {"type": "boolean"},
                "health_timeout_s": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": DURATION_MAX,
                },
                "yield_after_s": {
                    **nullable({"type": "number", "minimum": 0, "maximum": DURATION_MAX}),
                    "description": "Unused this long, it yields to a preempting start; null: never.",
                },
            },
        },
        "SetAside": {
            "type": "object",
            "description": "A record file that failed validation, kept beside the records.",
            "required": ["service", "file", "at", "size", "why"],
            "properties": {
                "service": {"type": "string"},
                "file": {"type": "string", "description": "Its name in records/."},
                "at": {**epoch, "description": "When it was set aside."},
                "size": {"type": "integer", "minimum": 0},
                "why": {"type": "string", "description": "Where it failed the schema."},
            },
        },
        "Voided": {
            "type": "object",
            "description": "A lease or entry found forged (`gpuctl locks` shows it).",
            "required": list(codec.VOIDED_FIELDS),
            "properties": {
                "kind": {"type": "string", "enum": list(codec.VOIDED_KINDS)},
                "service": {"type": "string", "minLength": 1, "maxLength": 255},
                "file": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 300,
                    "description": "Where it is, under the state folder.",
                },
                "host": {"type": "string", "maxLength": 255, "description": "Its holder's."},
                "pid": {"type": "integer", "minimum": 0, "maximum": PID_MAX},
                "at": {**epoch, "description": "When it was set aside (or granted)."},
                "why": {"type": "string", "maxLength": 4096},
            },
        },
        "VoidedList": {
            "type": "object",
            "required": ["voided"],
            "properties": {"voided": {"type": "array", "items": _ref("Voided")}},
        },
        "RecordList": {
            "type": "object",
            "required": ["records"],
            "properties": {
                "records": {"type": "array", "items": _ref("Record")},
                "set_aside": {"type": "array", "items": _ref("SetAside")},
            },
        },
        "LeaseGrant": {
            "type": "object",
            "required": ["granted", "record"],
            "properties": {
                "granted": {
                    "type": "boolean",
                    "description": "false: someone else holds a live lease (see record.lease).",
                },
                "record": _ref("Record"),
            },
        },
        "TouchRequest": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ready": {
                    "type": "boolean",
                    "description": (
                        "The caller saw the server answer: a record still starting becomes "
                        "running (a stopped one stays stopped)."
                    ),
                },
                "promise": {
                    **nullable(_ref("Promise")),
                    "description": (
                        "The caller's figures for the service: written only into a record "
                        "that has none (one an older release wrote)."
                    ),
                },
            },
        },
        "JobStopRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["holder", "pid", "pid_start"],
            "properties": {
                "holder": holder_id,
                "pid": {**pid, "maximum": PID_MAX},
                "pid_start": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": wire.MAX_EPOCH_S,
                    "description": "The pid's start time, as the job's record names it.",
                },
                "grace_s": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": job_stop.MAX_GRACE_S,
                    "description": "Seconds between SIGTERM and SIGKILL (default 10).",
                },
            },
        },
        "JobStopped": {
            "type": "object",
            "required": ["killed"],
            "properties": {
                "killed": {
                    "type": "boolean",
                    "description": "It outlived the grace period and got SIGKILL.",
                }
            },
        },
        "InflightEnd": {
            "type": "object",
            "additionalProperties": False,
            "required": ["holder"],
            "properties": {"holder": inflight_id},
        },
        "InflightRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["holder", "ttl_s"],
            "properties": {
                "holder": {
                    "allOf": [_ref("Holder"), {"properties": {"id": inflight_id}}],
                    "description": "As for a lease; the id names the entry's file.",
                },
                "ttl_s": {
                    **ttl,
                    "maximum": INFLIGHT_TTL_MAX_S,
                    "description": "Seconds until the entry lapses unless renewed (at most "
                    f"{INFLIGHT_TTL_MAX_S:g}).",
                },
            },
        },
        "Waiter": {
            "type": "object",
            "description": "One caller in the wait queue.",
            "required": ["name", "priority", "memory_mib", "seq", "since", "holder"],
            "properties": {
                "name": {"type": "string", "description": "The job's record name (run.<name>)."},
                "priority": {"type": "integer", "description": "Higher is served first."},
                "memory_mib": {"type": "integer", "minimum": 1},
                "seq": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Arrival order on this host (first come, first served "
                    "among equal priorities).",
                },
                "since": {**epoch, "description": "When it joined."},
                "holder": {
                    **_ref("Lease"),
                    "description": "Who waits; `expires` is its heartbeat's term.",
                },
            },
        },
        "QueueList": {
            "type": "object",
            "required": ["queue"],
            "properties": {"queue": {"type": "array", "items": _ref("Waiter")}},
        },
        "QueueJoin": {
            "type": "object",
            "additionalProperties": False,
            "required": ["holder", "ttl_s", "name", "priority", "memory_mib"],
            "properties": {
                "holder": {
                    "allOf": [_ref("Holder"), {"properties": {"id": queue_id}}],
                    "description": "As for a lease; the id names the entry's file.",
                },
                "ttl_s": {
                    **ttl,
                    "maximum": codec.QUEUE_TTL_MAX_S,
                    "description": "Seconds until the entry lapses unless renewed (at most "
                    "five minutes).",
                },
                "name": {"type": "string", "pattern": SERVICE_NAME_PATTERN},
                "priority": {
                    "type": "integer",
                    "minimum": -codec.PRIORITY_MAX,
                    "maximum": codec.PRIORITY_MAX,
                },
                "memory_mib": {"type": "integer", "minimum": 1, "maximum": codec.MEMORY_MAX_MIB},
            },
        },
        "QueueJoined": {
            "type": "object",
            "required": ["waiter", "queue"],
            "properties": {
                "waiter": _ref("Waiter"),
                "queue": {"type": "array", "items": _ref("Waiter")},
            },
        },
        "QueueLeave": {
            "type": "object",
            "additionalProperties": False,
            "required": ["holder"],
            "properties": {"holder": queue_id},
        },
        "QueueLeft": {
            "type": "object",
            "required": ["left"],
            "properties": {"left": {"type": "boolean"}},
        },
        "InflightList": {
            "type": "object",
            "required": ["inflight"],
            "properties": {
                "inflight": {
                    "type": "object",
                    "description": "Requests in flight, by service.",
                    "additionalProperties": {"type": "integer", "minimum": 1},
                }
            },
        },
    }
