"""The proxy's ``/openapi.json``: an OpenAPI 3.1 document of its own endpoints.

It describes what the proxy itself answers: its routes, the models and services it
fronts (from the route table, so a client or a fuzzer sees the names it accepts), and
its refusals in OpenAI's error shape. A forwarded request's answer is the service's
own, whatever its status: the document leaves it open (``default``). Declarative only;
its paths are ``routes.ROUTES``, the table the router serves, and every operation has
its own ``operationId`` for generated clients.
"""

from __future__ import annotations

from typing import Any

from gpuctl import __version__
from gpuctl.proxy.routes import MODEL_IN_BODY

# The routed paths (``routes.MODEL_IN_BODY``): each one's operationId and summary.
_MODEL_OPS = {
    "/v1/chat/completions": (
        "createChatCompletion",
        "A chat completion (streamed as SSE with stream = true).",
    ),
    "/v1/completions": ("createCompletion", "A text completion."),
    "/v1/embeddings": ("createEmbedding", "Embeddings."),
    "/v1/audio/transcriptions": (
        "createTranscription",
        "Whisper's upload, transcribed; its model is a form field.",
    ),
    "/v1/audio/translations": (
        "createTranslation",
        "Whisper's upload, translated into English; its model is a form field.",
    ),
    "/v1/rerank": ("createRerank", "Documents ranked against a query."),
    "/v1/score": ("createScore", "Similarity scores of text pairs."),
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
    form_body = {
        "type": "object",
        "required": ["model"],  # the file is the service's to ask for
        "properties": {
            "model": {"enum": models},
            "file": {"type": "string", "format": "binary"},
        },
    }
    bodies = {
        "json": {"application/json": {"schema": model_body}},
        "form": {"multipart/form-data": {"schema": form_body}},
    }

    def routed(path: str) -> dict[str, Any]:
        operation_id, summary = _MODEL_OPS[path]
        return {
            "post": {
                "operationId": operation_id,
                "summary": summary + " Routed by its model to the service that lists it.",
                "requestBody": {"required": True, "content": bodies[MODEL_IN_BODY[path]]},
                "responses": {**refusals, "default": upstream},
            }
        }

    paths: dict[str, Any] = {
        "/healthz": {
            "get": {
                "operationId": "getHealth",
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
                "operationId": "getOpenapi",
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
                "operationId": "getMetrics",
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
                "operationId": "listModels",
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
                "operationId": "getModel",
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
        **{path: routed(path) for path in MODEL_IN_BODY},
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
        "get": {"operationId": "getServicePath", **passthrough},
        "post": {
            "operationId": "postServicePath",
            **passthrough,
            "requestBody": {"content": {"*/*": {"schema": {}}}},
        },
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
