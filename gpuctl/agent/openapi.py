"""The agent's ``/openapi.json``: the hand-written OpenAPI 3.1 document of every endpoint.

Long because it is one declarative document (paths and schemas) that reads best whole;
it holds no logic.
"""

from __future__ import annotations

from typing import Any

from gpuctl import __version__
from gpuctl.core.model import STATUS_SCHEMA
from gpuctl.core.names import NAME_PATTERN
from gpuctl.core.record import RECORD_SCHEMA, Phase


def openapi_document() -> dict[str, Any]:
    """The hand-written OpenAPI 3.1 description of every endpoint (DESIGN §5)."""
    error = {"$ref": "#/components/schemas/Error"}
    nullable_int = {"type": ["integer", "null"]}
    nullable_str = {"type": ["string", "null"]}

    def err(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error}}}

    unauthorized = {
        **err("Missing or wrong bearer token."),
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpuctl agent",
            "version": __version__,
            "description": (
                "The GPU host agent of gpuctl: who holds the GPU, at process level, and "
                "the host's state store (one record per service, with its lease). "
                "Every endpoint except /healthz and /openapi.json needs "
                "'Authorization: Bearer <token>' when the agent runs with a token."
            ),
        },
        "security": [{"bearerAuth": []}],
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "Liveness of the agent itself (not of the GPU).",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "The agent runs.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Health"}
                                }
                            },
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/status": {
                "get": {
                    "summary": "The GPU's processes and memory, cached for the agent's cache TTL.",
                    "parameters": [
                        {
                            "name": "match",
                            "in": "query",
                            "required": False,
                            "description": (
                                "Comma-separated keywords. Adds `starting`: host processes whose "
                                "command line contains one of them (case-insensitive) and that "
                                "hold no GPU memory yet."
                            ),
                            "schema": {"type": "string"},
                            "example": "vllm,translategemma",
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "What the probe saw.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Status"}
                                }
                            },
                        },
                        "400": err("A bad `match` parameter."),
                        "401": unauthorized,
                        "503": err("The GPU probe failed: the GPU state is unknown, not idle."),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": (
                        "Prometheus metrics: GPU and per-process memory, per-service phase, "
                        "lease and idle seconds, agent counters."
                    ),
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format 0.0.4.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": unauthorized,
                    },
                }
            },
            **_records_paths(unauthorized),
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "hint"],
                    "properties": {
                        "error": {"type": "string", "description": "What went wrong."},
                        "hint": {"type": "string", "description": "What fixes it (may be empty)."},
                    },
                },
                "Health": {
                    "type": "object",
                    "required": ["ok", "version"],
                    "properties": {"ok": {"const": True}, "version": {"type": "string"}},
                },
                "GpuProcess": {
                    "type": "object",
                    "required": [
                        "pid",
                        "command",
                        "memory_mib",
                        "user",
                        "container",
                        "gpu",
                        "on_gpu",
                        "sm_util_pct",
                    ],
                    "properties": {
                        "pid": {"type": "integer"},
                        "command": {
                            **nullable_str,
                            "description": "Full command line; null where it cannot be read.",
                        },
                        "memory_mib": {
                            **nullable_int,
                            "description": "null where the driver cannot tell.",
                        },
                        "user": nullable_str,
                        "container": {
                            **nullable_str,
                            "description": "Container id, null for a host process.",
                        },
                        "gpu": {"type": "integer", "description": "The GPU's index."},
                        "on_gpu": {
                            "type": "boolean",
                            "description": (
                                "false for a server of ours that holds no GPU memory yet "
                                "(listed for clients that classify by processes)."
                            ),
                        },
                        "sm_util_pct": {
                            **nullable_int,
                            "description": "SM utilisation over the last second; null: unknown.",
                        },
                    },
                },
                "GpuDevice": {
                    "type": "object",
                    "required": [
                        "index",
                        "name",
                        "uuid",
                        "memory_used_mib",
                        "memory_total_mib",
                        "unified",
                        "utilization_pct",
                        "temperature_c",
                        "power_w",
                        "error",
                    ],
                    "properties": {
                        "index": {"type": "integer"},
                        "name": nullable_str,
                        "uuid": nullable_str,
                        "memory_used_mib": nullable_int,
                        "memory_total_mib": nullable_int,
                        "unified": {
                            "type": "boolean",
                            "description": "The device has no memory figure of its own (GB10).",
                        },
                        "utilization_pct": {**nullable_int, "description": "null: unknown."},
                        "temperature_c": {**nullable_int, "description": "null: unknown."},
                        "power_w": {
                            "type": ["number", "null"],
                            "description": "null: unknown.",
                        },
                        "error": {
                            **nullable_str,
                            "description": "Why this GPU could not be read; null when it was.",
                        },
                    },
                },
                "StartingProcess": {
                    "type": "object",
                    "required": ["pid", "command", "user"],
                    "properties": {
                        "pid": {"type": "integer"},
                        "command": {"type": "string"},
                        "user": nullable_str,
                    },
                },
                "HostIdentity": {
                    "type": "object",
                    "required": ["hostname", "boot_id"],
                    "properties": {"hostname": {"type": "string"}, "boot_id": {"type": "string"}},
                },
                "Status": {
                    "type": "object",
                    "required": [
                        "schema",
                        "is_idle",
                        "memory_used_mib",
                        "memory_total_mib",
                        "unified_memory",
                        "probe",
                        "taken_at",
                        "gpus",
                        "devices",
                        "processes",
                        "host",
                        "state_dir",
                    ],
                    "properties": {
                        "schema": {"const": STATUS_SCHEMA},
                        "is_idle": {
                            "type": "boolean",
                            "description": (
                                "True exactly when `processes` is empty and every GPU "
                                "could be read."
                            ),
                        },
                        "memory_used_mib": nullable_int,
                        "memory_total_mib": {
                            **nullable_int,
                            "description": "From the device, else the configured --gpu-memory.",
                        },
                        "unified_memory": {"type": "boolean"},
                        "probe": {"type": "string", "examples": ["nvml", "nvidia-smi", "sim"]},
                        "taken_at": {
                            "type": "string",
                            "format": "date-time",
                            "description": "UTC, e.g. 2026-11-29T10:00:00Z.",
                        },
                        "gpus": {"type": "integer"},
                        "devices": {
                            "type": "array",
                            "description": (
                                "Per GPU: a service fits on one GPU, so admission reads these; "
                                "the memory fields above are their sums over readable GPUs."
                            ),
                            "items": {"$ref": "#/components/schemas/GpuDevice"},
                        },
                        "processes": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/GpuProcess"},
                        },
                        "host": {"$ref": "#/components/schemas/HostIdentity"},
                        "state_dir": nullable_str,
                        "starting": {
                            "type": "array",
                            "description": "With ?match= only: matching, not on the GPU yet.",
                            "items": {"$ref": "#/components/schemas/StartingProcess"},
                        },
                    },
                },
                **_records_schemas(),
            },
        },
    }


# The state store's endpoints (gpuctl.agent.store_api). Their errors carry "error" and,
# for store failures, a "hint".
SERVICE_NAME_PATTERN = NAME_PATTERN  # the one rule (gpuctl.core.names), matched in full


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _records_paths(unauthorized: dict[str, Any]) -> dict[str, Any]:
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
    common = {"400": bad, "401": unauthorized, "503": down}

    def op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"summary": summary, **extra, "responses": {**responses, **common}}

    record = ok("Record", "The record after the operation.")
    return {
        "/records": {
            "get": {
                "summary": "Every service's record (an expired or void lease reads as none).",
                "responses": {
                    "200": ok("RecordList", "The records, by service name."),
                    "401": unauthorized,
                    "503": down,
                },
            }
        },
        "/records/{service}": {
            "parameters": [service],
            "get": op(
                "One service's record; a service without one reads as stopped.",
                {"200": ok("Record", "The record (an expired or void lease reads as none).")},
            ),
            "patch": op(
                "Change the record, as the lease holder.",
                {"200": record, "409": conflict},
                requestBody=body("HolderUpdate", "Who asks, and what changes."),
            ),
        },
        "/records/{service}/lease": {
            "parameters": [service],
            "post": op(
                "Take the lease (the right to start or stop the service) unless another "
                "holder has a live one. A holder may take its own lease again.",
                {"200": ok("LeaseGrant", "Granted, or not, with the record as it stands.")},
                requestBody=body("LeaseRequest", "Who asks, and for how long."),
            ),
        },
        "/records/{service}/lease/renew": {
            "parameters": [service],
            "post": op(
                "Extend the lease, as its holder.",
                {"200": record, "409": conflict},
                requestBody=body("RenewRequest", "The holder's id and the new time to live."),
            ),
        },
        "/records/{service}/lease/release": {
            "parameters": [service],
            "post": op(
                "Apply an update and drop the lease, if the caller still holds it; "
                "otherwise nothing changes.",
                {"200": record},
                requestBody=body("ReleaseRequest", "The holder's id and a last update."),
            ),
        },
        "/records/{service}/touch": {
            "parameters": [service],
            "post": op(
                "Mark a use: last_used = now. Needs no lease.",
                {"200": record},
            ),
        },
        "/records/{service}/inflight": {
            "parameters": [service],
            "post": op(
                "Count the holder as using the service (its first request in flight) and mark "
                "a use. Refused (granted: false) while a stop or reclaim holds the lease.",
                {"200": ok("LeaseGrant", "Counted, or not, with the record as it stands.")},
                requestBody=body("LeaseRequest", "Who uses it, and how long the entry lives."),
            ),
        },
        "/records/{service}/inflight/renew": {
            "parameters": [service],
            "post": op(
                "Keep the holder's in-flight entry alive, and mark a use.",
                {"200": record},
                requestBody=body("LeaseRequest", "Who uses it, and how long the entry lives."),
            ),
        },
        "/records/{service}/inflight/end": {
            "parameters": [service],
            "post": op(
                "The holder has nothing in flight on the service any more.",
                {"200": record},
                requestBody=body("EndRequest", "The holder's id."),
            ),
        },
        "/records/_inflight": {
            "get": {
                "summary": "How many holders have requests in flight, per service.",
                "responses": {
                    "200": ok("InflightCounts", "Live holders per service (only those with some)."),
                    "401": unauthorized,
                    "503": down,
                },
            }
        },
    }


def _records_schemas() -> dict[str, Any]:
    """The schemas of the /records endpoints (``gpuctl.core.record``, ``Holder``)."""
    number = {"type": "number"}
    nullable_number = {"type": ["number", "null"]}
    epoch = {**number, "description": "Seconds since the epoch."}
    ttl = {
        "type": "number",
        "exclusiveMinimum": 0,
        "description": "Seconds until the lease expires by itself (finite).",
    }
    holder_id = {"type": "string", "description": "The holder's id (Holder.id)."}
    return {
        "StoreError": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"type": "string", "description": "What went wrong."},
                "hint": {"type": "string", "description": "What fixes it (may be empty)."},
            },
        },
        "Phase": {"type": "string", "enum": [p.value for p in Phase]},
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
            "description": "A service's state on this host (DESIGN §3).",
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
        "RecordList": {
            "type": "object",
            "required": ["records"],
            "properties": {
                "records": {"type": "array", "items": _ref("Record")},
                "set_aside": {"type": "array", "items": _ref("SetAside")},
            },
        },
        "Holder": {
            "type": "object",
            "description": "Who asks for a lease: a fresh id per call, and its process.",
            "required": ["id", "host", "boot_id", "pid", "entry"],
            "additionalProperties": False,
            "properties": {
                "id": {"type": "string", "minLength": 1, "maxLength": 128},
                "host": {"type": "string", "maxLength": 255},
                "boot_id": {"type": "string", "maxLength": 64},
                "pid": {"type": "integer", "minimum": 1, "maximum": 4194304},
                "pid_start": nullable_number,
                "entry": {"type": "string", "maxLength": 64},
            },
        },
        "RecordUpdate": {
            "type": "object",
            "description": "Changes to a record; every key is optional.",
            "additionalProperties": False,
            "properties": {
                "phase": _ref("Phase"),
                "handle": {"type": ["object", "null"], "description": "null clears it."},
                "attempt": {"type": "object", "description": "Appended to the attempts."},
                "failure": {
                    "type": ["object", "null"],
                    "description": (
                        "A failed start: phase failed, count + 1, a back-off. null clears it."
                    ),
                    "properties": {"error": {"type": "string"}, "log_tail": {"type": "string"}},
                },
                "touch": {"type": "boolean", "description": "true: last_used = now."},
                "start_nonce": {
                    "type": ["string", "null"],
                    "pattern": "^[0-9a-f]{8,64}$",
                    "description": "The nonce a start puts in its server's environment.",
                },
                "health": {
                    "type": ["string", "null"],
                    "description": "The URL that tells the server answers (http or https).",
                },
            },
        },
        "EndRequest": {
            "type": "object",
            "required": ["holder"],
            "properties": {"holder": {**holder_id, "minLength": 1}},
        },
        "InflightCounts": {
            "type": "object",
            "required": ["inflight"],
            "properties": {
                "inflight": {
                    "type": "object",
                    "description": "Service name -> live in-flight holders.",
                    "additionalProperties": {"type": "integer", "minimum": 1},
                }
            },
        },
        "LeaseRequest": {
            "type": "object",
            "required": ["holder", "ttl_s"],
            "properties": {"holder": _ref("Holder"), "ttl_s": ttl},
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
        "RenewRequest": {
            "type": "object",
            "required": ["holder", "ttl_s"],
            "properties": {"holder": holder_id, "ttl_s": ttl},
        },
        "HolderUpdate": {
            "type": "object",
            "required": ["holder", "update"],
            "properties": {"holder": holder_id, "update": _ref("RecordUpdate")},
        },
        "ReleaseRequest": {
            "type": "object",
            "required": ["holder"],
            "properties": {"holder": holder_id, "update": _ref("RecordUpdate")},
        },
    }
