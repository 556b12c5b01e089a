"""The agent's ``/openapi.json``: the OpenAPI 3.1 document of every endpoint. The ``/status``
components are generated from the Structs that declare the wire (``gpuctl.core.status_wire``)."""

from __future__ import annotations

from typing import Any

import msgspec

from gpuctl import __version__
from gpuctl.agent import query
from gpuctl.agent.openapi_events import event_schemas, events_paths
from gpuctl.core.status_wire import STATUS_COMPONENTS

__all__ = ["SERVICE_NAME_PATTERN", "openapi_document"]
from gpuctl.agent.openapi_records import (
    SERVICE_NAME_PATTERN,
    records_paths,
    records_schemas,
)
from gpuctl.agent.openapi_ui import ui_paths

# Keys the agent sends only on request; every other key of /status it always sends (the
# Structs' defaults are for parsing older agents, not optional keys of this one).
_SOMETIMES = {"Status": {"starting"}}


def status_components() -> dict[str, Any]:
    """The ``Status`` schema and the ones it refers to, from the wire's Structs."""
    _, components = msgspec.json.schema_components(
        STATUS_COMPONENTS, ref_template="#/components/schemas/{name}"
    )
    for name, schema in components.items():
        props = schema.get("properties", {})
        schema["required"] = [k for k in props if k not in _SOMETIMES.get(name, ())]
        for prop in props.values():
            prop.pop("default", None)
    return components


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of every endpoint (``GET /openapi.json``)."""
    error = {"$ref": "#/components/schemas/Error"}

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
                        "Prometheus metrics: GPU memory, temperature and power, memory per service, phase, "
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
            **events_paths(unauthorized, {"$ref": "#/components/schemas/Error"}),
            **ui_paths(unauthorized, {"$ref": "#/components/schemas/Error"}),
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
                **status_components(),
                **records_schemas(),
                **event_schemas(),
            },
        },
    }
