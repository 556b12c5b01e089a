"""The proxy's ``/openapi.json``: an OpenAPI 3.1 document of its own endpoints.

It describes what the proxy itself answers: its routes, the models and services it
fronts (from the route table, so a client or a fuzzer sees the names it accepts), and
its refusals in OpenAI's error shape. A forwarded request's answer is the service's
own, whatever its status: the document leaves it open (``default``). Declarative only.
"""

from __future__ import annotations

from typing import Any

from gpuctl import __version__

_MODEL_PATHS = {
    "/v1/chat/completions": "A chat completion (streamed as SSE with stream = true).",
    "/v1/completions": "A text completion.",
    "/v1/embeddings": "Embeddings.",
}


def openapi_document(models: list[str], services: list[str]) -> dict[str, Any]:
    """The document for a proxy that routes ``models`` and passes ``services`` through."""
    error = {"$ref": "#/components/schemas/Error"}
    retry_after = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}}}

    def err(description: str, *, retry: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": error}},
        }
        if retry:
            out["headers"] = retry_after
        return out

    upstream = {
        "description": "The service's own answer, passed through as it came (any status).",
        "content": {"*/*": {"schema": {}}},
    }
    refusals = {
        "400": err(
            "No model in the body (code model_missing), or a body that is not JSON, not a "
            "JSON object, or whose model is not a string (code invalid_request)."
        ),
        "401": err("A missing or wrong client key (when the proxy has keys)."),
        "404": err("A model no service lists (GET /v1/models lists them)."),
        "413": err("A body over the proxy's max_body."),
        "429": err("The service's max_concurrent requests are in flight.", retry=True),
        "431": err("Request headers over 64 KiB."),
        "502": err("The service's start failed, or its server refused the connection."),
        "503": err("BUSY, PREEMPTABLE without permission, UNKNOWN, or still loading.", retry=True),
        "504": err("The service's server did not answer in time."),
    }
    # Only what the proxy itself checks: the rest of the body is the service's to judge.
    model_body = {
        "type": "object",
        "required": ["model"],
        "properties": {"model": {"enum": models}},
    }

    def routed(summary: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary + " Routed by its model to the service that lists it.",
                "requestBody": {"required": True, "content": content},
                "responses": {**refusals, "default": upstream},
            }
        }

    paths: dict[str, Any] = {
        "/healthz": {
            "get": {
                "summary": "Liveness of the proxy itself.",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The proxy runs.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document.",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "401": refusals["401"],
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text: requests, in flight, cold starts, waits, latency.",
                "responses": {
                    "200": {
                        "description": "Prometheus text format 0.0.4",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "401": refusals["401"],
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "Every configured model, whether its server runs or not.",
                "responses": {
                    "200": {
                        "description": "OpenAI's model list.",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ModelList"}
                            }
                        },
                    },
                    "401": refusals["401"],
                },
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "The server's own card when it answers, else the proxy's.",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"enum": models}}
                ],
                "responses": {
                    "200": {
                        "description": "A model card.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "401": refusals["401"],
                    "404": refusals["404"],
                },
            }
        },
        **{
            p: routed(s, {"application/json": {"schema": model_body}})
            for p, s in _MODEL_PATHS.items()
        },
        "/v1/audio/transcriptions": routed(
            "Whisper's upload; its model is a form field.",
            {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["model"],  # the file is the service's to ask for
                        "properties": {
                            "model": {"enum": models},
                            "file": {"type": "string", "format": "binary"},
                        },
                    }
                }
            },
        ),
    }
    passthrough = {
        "summary": "Any path passed through to the service (for servers that do not speak "
        "OpenAI); '.' and '..' segments are refused.",
        "parameters": [
            {"name": "name", "in": "path", "required": True, "schema": {"enum": services}},
            {"name": "path", "in": "path", "required": True, "schema": {"type": "string"}},
        ],
        "responses": {
            "400": err("A '.' or '..' segment in the path."),
            "401": refusals["401"],
            "404": err("No such service behind this proxy."),
            **{c: refusals[c] for c in ("413", "429", "431", "502", "503", "504")},
            "default": upstream,
        },
    }
    paths["/services/{name}/{path}"] = {
        "get": passthrough,
        "post": {**passthrough, "requestBody": {"content": {"*/*": {"schema": {}}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpuctl proxy",
            "version": __version__,
            "description": (
                "An OpenAI-compatible front that starts the right server on demand. "
                "Every endpoint except /healthz needs 'Authorization: Bearer <key>' when "
                "the proxy has client keys. Refusals are OpenAI error objects; a forwarded "
                "request's answer is the service's own."
            ),
        },
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                },
                "ModelList": {
                    "type": "object",
                    "required": ["object", "data"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "object", "owned_by"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"const": "model"},
                                    "created": {"type": "integer"},
                                    "owned_by": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    }
