"""The web view's endpoints in the OpenAPI document (``gpuctl.agent.ui``)."""

from __future__ import annotations

from typing import Any

from gpuctl.agent.openapi_records import SERVICE_NAME_PATTERN
from gpuctl.agent.ui import ACTIONS, static_paths


def ui_paths(unauthorized: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    def err(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error}}}

    out: dict[str, Any] = {}
    for path, media in static_paths():
        name = "Page" if path == "/ui" else path.rsplit("/", 1)[1].replace(".", " ").title()
        out[path] = {
            "get": {
                "operationId": "getUi" + name.replace(" ", ""),
                "summary": "The live web view: a static file, no data (no token needed).",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The file, under a strict Content-Security-Policy.",
                        "content": {media: {"schema": {"type": "string"}}},
                    }
                },
            }
        }
    out["/ui/state"] = {
        "get": {
            "operationId": "getUiState",
            "summary": (
                "Everything the web view draws: the config's view (status --json), else "
                "the agent's snapshot; the records' phases and times; the wait queue; an "
                "hour of GPU memory readings; and the caller's token role."
            ),
            "responses": {
                "200": {
                    "description": "The view.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": [
                                    "role",
                                    "config",
                                    "actions",
                                    "now",
                                    "status",
                                    "snapshot",
                                    "records",
                                    "queue",
                                    "history",
                                ],
                                "properties": {
                                    "role": {"enum": ["write", "read", "open"]},
                                    "config": {"type": "boolean"},
                                    "actions": {"type": "boolean"},
                                    "now": {"type": "number"},
                                    "status": {"type": ["object", "null"]},
                                    "snapshot": {"type": ["object", "null"]},
                                    "records": {"type": "array", "items": {"type": "object"}},
                                    "queue": {"type": "array", "items": {"type": "object"}},
                                    "history": {"type": "object"},
                                },
                            }
                        }
                    },
                },
                "401": unauthorized,
                "503": err("The GPU probe or the status failed."),
            },
        }
    }
    body = {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["service"],
                    "additionalProperties": False,
                    "properties": {"service": {"type": "string", "pattern": SERVICE_NAME_PATTERN}},
                }
            }
        },
    }
    result = {
        "description": "The flow ran; ``ok`` says whether it did what was asked.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["ok", "message"],
                    "properties": {"ok": {"type": "boolean"}, "message": {"type": "string"}},
                }
            }
        },
    }
    for op in ACTIONS:
        out[f"/actions/{op}"] = {
            "post": {
                "operationId": f"{op}Service",
                "summary": (
                    f"`gpuctl {op}` for the web view (write token): the CLI's flow, the "
                    "journal naming `ui` as the actor. Ensure and resume do not wait."
                ),
                "requestBody": body,
                "responses": {
                    "200": result,
                    "400": err("Not a service name."),
                    "401": unauthorized,
                    "403": err("The read-only token cannot act."),
                    "404": result | {"description": "Not a service this agent may act on."},
                    "409": result
                    | {"description": "The flow refused (a lease), or this agent runs none."},
                },
            }
        }
    return out
