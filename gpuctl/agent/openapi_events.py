"""The OpenAPI description of the journal's endpoints (``events_api``) and of the event
that rides on a record write (``core.events``)."""

from __future__ import annotations

from typing import Any

from gpuctl.agent.wire import MAX_EVENTS
from gpuctl.core.events import MAX_FIGURES, MAX_WHO, Cause, Kind
from gpuctl.core.record import TIME_MAX

MAX_ID = 2**62  # an event's id (SQLite's rowid is a signed 64-bit integer)
# One answer's events at most: an answer is built whole before it goes, and a client that
# never reads it keeps it in the agent's memory (100,000 events were some 100 MB of JSON).
# A reader pages on with ``after=next``.
PAGE_MAX = 2000
SINCE_PATTERN = r"^(?:[0-9]{1,12}(?:\.[0-9]{1,6})?[smhdw]){1,5}$|^[0-9]{1,12}(?:\.[0-9]{1,6})?$"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _text(most: int, description: str) -> dict[str, Any]:
    return {"type": "string", "maxLength": most, "description": description}


def event_schemas() -> dict[str, Any]:
    text = {"type": ["string", "null"], "maxLength": 500}
    out: dict[str, Any] = {
        "Event": {
            "type": "object",
            "additionalProperties": False,
            "required": ["at", "kind", "service"],
            "description": (
                "One thing gpuctl did or saw on the host (docs/reference/events.md). What "
                "the caller says of itself is its word only: the agent adds the peer and "
                "the token's role to who."
            ),
            "properties": {
                "at": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": TIME_MAX,
                    "description": "Unix time (to 2100).",
                },
                "kind": {"enum": [k.value for k in Kind]},
                "service": _text(64, "The service, or the gpuctl run job."),
                "host": {"type": ["string", "null"], "maxLength": 100},
                "cause": {"enum": [*(c.value for c in Cause), None], "description": "A stop's."},
                "job": {"type": "boolean"},
                "before": text,
                "after": text,
                "decision": text,
                "reason": text,
                "by": {**text, "description": "The other party (who preempted it)."},
                "command": {**text, "description": "Redacted."},
                "who": {
                    "type": ["object", "null"],
                    "maxProperties": MAX_WHO,
                    "propertyNames": {"maxLength": 32},
                    "additionalProperties": {"type": "string", "maxLength": 100},
                },
                "figures": {
                    "type": ["object", "null"],
                    "maxProperties": MAX_FIGURES,
                    "propertyNames": {"maxLength": 32},
                    "additionalProperties": {"type": "number"},
                },
            },
        },
    }
    event = out["Event"]
    # A row read back: the event with its id (the agent may have added to who).
    out["EventRow"] = {
        "type": "object",
        "required": ["id", *event["required"]],
        "properties": {"id": {"type": "integer"}, **event["properties"]},
    }
    return out


def events_paths(unauthorized: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    def err(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error}}}

    tally = {
        "type": "object",
        "required": ["day", "service", "user"],
        "properties": {
            "day": {"type": "string"},
            "service": {"type": "string"},
            "user": {"type": "string"},
        },
        "description": "A row's totals (gpuctl.core.usage.Tally), keyed by UTC day, service, user.",
    }
    return {
        "/usage": {
            "get": {
                "operationId": "getUsage",
                "summary": "What each service held and cost, by UTC day, service and user.",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "description": "A span back from now (7d, 30d) or a Unix time; 7d.",
                        "schema": {"type": "string", "pattern": SINCE_PATTERN},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "The rows.",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["since", "rows"],
                                    "properties": {
                                        "since": {"type": "number"},
                                        "rows": {"type": "array", "items": tally},
                                    },
                                }
                            }
                        },
                    },
                    "400": err("A bad since."),
                    "401": unauthorized,
                    "503": err("The agent has no state directory."),
                },
            }
        },
        "/events": {
            "get": {
                "operationId": "getEvents",
                "summary": (
                    "The host's journal, oldest first. ?follow=1 (not listed: a stream has "
                    "no JSON answer) serves the same as server-sent events, as written."
                ),
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "description": "A span back from now (2h, 7d) or a Unix time; 1h.",
                        "schema": {"type": "string", "pattern": SINCE_PATTERN},
                    },
                    {"name": "service", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "after",
                        "in": "query",
                        "description": "Only events after this id (to resume a stream).",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_ID},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "description": (
                            "A page: the oldest this many after `after`; `next` says where "
                            "the next page begins. Without it: the window's newest "
                            f"{PAGE_MAX}."
                        ),
                        "schema": {"type": "integer", "minimum": 1, "maximum": PAGE_MAX},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The events.",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["events", "next"],
                                    "properties": {
                                        "events": {
                                            "type": "array",
                                            "items": _ref("EventRow"),
                                            "maxItems": PAGE_MAX,
                                        },
                                        "next": {
                                            "type": ["integer", "null"],
                                            "description": (
                                                "The last id of a full page (read on with "
                                                "after=next); null: nothing more."
                                            ),
                                        },
                                    },
                                }
                            }
                        },
                    },
                    "400": err("A bad since, after or limit."),
                    "401": unauthorized,
                    "503": err("The agent has no state directory."),
                },
            },
            "post": {
                "operationId": "postEvents",
                "summary": "Journal events that ride on no record write (a refusal, a queue join).",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["events"],
                                "properties": {
                                    "events": {
                                        "type": "array",
                                        "maxItems": MAX_EVENTS,
                                        "items": _ref("Event"),
                                    }
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "How many were written (0: the journal could not be).",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["written"],
                                    "properties": {"written": {"type": "integer"}},
                                }
                            }
                        },
                    },
                    "400": err("A bad event."),
                    "401": unauthorized,
                    "403": err("The token is read-only."),
                    "413": err("The body is over the agent's limit."),
                    "503": err("The agent has no state directory."),
                },
            },
        },
    }
