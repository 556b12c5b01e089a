"""The agent's ``/openapi.json``: the hand-written OpenAPI 3.1 document of every endpoint."""

from __future__ import annotations

from typing import Any

from gpuctl import __version__
from gpuctl.agent import query
from gpuctl.core.snapshot import STATUS_SCHEMA

__all__ = ["SERVICE_NAME_PATTERN", "openapi_document"]
from gpuctl.agent.openapi_records import (
    SERVICE_NAME_PATTERN,
    records_paths,
    records_schemas,
)


def openapi_document() -> dict[str, Any]:
    """The hand-written OpenAPI 3.1 description of every endpoint (``GET /openapi.json``)."""
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
                    "operationId": "getHealth",
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
                    "operationId": "getOpenapi",
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
                    "operationId": "getStatus",
                    "summary": "The GPU's processes and memory, cached for the agent's cache TTL.",
                    "parameters": [
                        {
                            "name": "match",
                            "in": "query",
                            "required": False,
                            "description": (
                                "Comma-separated keywords. Adds `starting`: host processes whose "
                                "command line contains one of them (case-insensitive) and that "
                                "hold no GPU memory yet; never one that names a file of the "
                                "agent's state directory (`tail -f …/logs/vllm.log`)."
                            ),
                            # At most 32 keywords of at most 200 characters (query.py).
                            "schema": {"type": "string", "pattern": query.MATCH_PATTERN},
                            "example": "vllm,translategemma",
                        },
                        {
                            "name": "fresh",
                            "in": "query",
                            "required": False,
                            "description": "1: read the GPU and the processes now, not from the "
                            "reading cache.",
                            "schema": {"type": "string", "enum": list(query.FRESH_VALUES)},
                        },
                        {
                            "name": "pids",
                            "in": "query",
                            "required": False,
                            "description": "With `match`: servers the records name, listed under "
                            "`starting` whatever their command line (at most 32).",
                            "schema": {"type": "string", "pattern": query.PIDS_PATTERN},
                        },
                        {
                            "name": "exclude",
                            "in": "query",
                            "required": False,
                            "description": "With `match` and this host's `boot_id`: the caller's "
                            "own process tree, left out of `starting`.",
                            "schema": {"type": "string", "pattern": query.EXCLUDE_PATTERN},
                        },
                        {
                            "name": "pipes",
                            "in": "query",
                            "required": False,
                            "description": "With `match` and this host's `boot_id`: the pipe "
                            "inodes of the caller's pipeline; their other ends are left out.",
                            "schema": {"type": "string", "pattern": query.PIPES_PATTERN},
                        },
                        {
                            "name": "boot_id",
                            "in": "query",
                            "required": False,
                            "description": "The caller's kernel boot id: `exclude` and `pipes` "
                            "count only on the same machine.",
                            "schema": {"type": "string"},
                        },
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
                        "400": err("A bad query parameter."),
                        "401": unauthorized,
                        "503": err("The GPU probe failed: the GPU state is unknown, not idle."),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "getMetrics",
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
            **records_paths(unauthorized),
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
                        "mig",
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
                        "mig": {
                            **nullable_int,
                            "description": (
                                "The MIG instance (GPU instance id) it runs in; null with "
                                "MIG off, or where the driver does not say."
                            ),
                        },
                    },
                },
                "MigInstance": {
                    "type": "object",
                    "required": ["id", "uuid", "memory_used_mib", "memory_total_mib"],
                    "properties": {
                        "id": {"type": "integer", "description": "The GPU instance id."},
                        "uuid": nullable_str,
                        "memory_used_mib": nullable_int,
                        "memory_total_mib": nullable_int,
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
                        "mig",
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
                        "mig": {
                            "type": "array",
                            "description": (
                                "With MIG on, its instances: a service fits on one instance "
                                "(a service's devices = [0] means any instance of GPU 0), "
                                "and the device's own memory figures are not admitted on. "
                                "Empty with MIG off."
                            ),
                            "items": {"$ref": "#/components/schemas/MigInstance"},
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
                        "servers",
                        "notes",
                    ],
                    "properties": {
                        "schema": {"const": STATUS_SCHEMA},
                        "is_idle": {
                            "type": "boolean",
                            "description": (
                                "True only when `processes` is empty, every GPU could be "
                                "read, no GPU holds more than the driver's reserve "
                                "(1024 MiB) that no process accounts for, and no record "
                                "of the host's store holds a lease or says `starting` "
                                "(read at each answer). So it can be false with "
                                "`processes` empty: a start between taking its lease and "
                                "its server existing, or memory held by processes this "
                                "agent cannot see (MIG, another PID namespace)."
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
                        "servers": {
                            "type": "array",
                            "description": (
                                "Whose each server process is: the pids the records name "
                                "(by the launcher's handle, or a start's GPUCTL_START_NONCE "
                                "in /proc/<pid>/environ) and the processes they forked, "
                                "whatever their command lines say."
                            ),
                            "items": {
                                "type": "object",
                                "required": ["pid", "service"],
                                "properties": {
                                    "pid": {"type": "integer", "minimum": 1},
                                    "service": {"type": "string"},
                                },
                            },
                        },
                        "notes": {
                            "type": "array",
                            "description": (
                                "What the probe wants a person to know about this reading, "
                                "e.g. a simulated GPU whose gpu.json is not the "
                                "--gpu-memory asked for. Never part of a decision."
                            ),
                            "items": {"type": "string"},
                        },
                    },
                },
                **records_schemas(),
            },
        },
    }
