"""Every request body /openapi.json allows fits under the agent's body limit: a body the
schema allows never gets a 413 (it did: a 65,536-character ``log_tail`` with a 64 KiB
limit). The worst case is computed from the document a real agent serves, not from the
constants, so a bound added to the schema without the limit in mind fails here."""

# ruff: noqa: F811  (the tests take the imported `agent` fixture by name)

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gpuctl.adapters.store.agent import AgentStore
from gpuctl.agent import wire
from gpuctl.core.record import LOG_TAIL_MAX
from gpuctl.core.record_shapes import RecordUpdate, StartFailure
from tests.test_agent_wire import (
    AUTH,
    SVC,
    Agent,
    agent,  # noqa: F401  (the real agent on loopback)
)

# A character of a string at its worst in compact JSON: "\u0000" is 6 bytes.
ESCAPED = 6
_QUANT = re.compile(r"\{(\d+)(?:,(\d+))?\}")


def _pattern_max(pattern: str) -> int:
    """The longest string an anchored pattern of bounded repeats matches (ASCII)."""
    assert "*" not in pattern and "+" not in pattern, f"unbounded pattern {pattern}"
    body = pattern.strip("^$")
    total = sum(int(b or a) for a, b in _QUANT.findall(body))
    rest = _QUANT.sub("", re.sub(r"\[[^\]]*\]", "", body)).replace("\\", "")
    return total + len(re.sub(r"[()?|]", "", rest)) + body.count("[") - len(_QUANT.findall(body))


def worst(schema: dict[str, Any], defs: dict[str, Any]) -> int:
    """The most bytes of compact JSON any value ``schema`` allows can take."""
    if "$ref" in schema:
        return worst(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "allOf" in schema:  # one value meets them all: their fields merged
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            part = defs[part["$ref"].rsplit("/", 1)[1]] if "$ref" in part else part
            props = {**merged.get("properties", {}), **part.get("properties", {})}
            merged = {**merged, **part, "properties": props}
        return worst(merged, defs)
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return max(worst(s, defs) for s in schema[key])
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    out = 4 if "null" in types else 0
    if "boolean" in types:
        out = max(out, 5)
    if "integer" in types or "number" in types:
        out = max(out, 24)  # -1.2345678901234567e+308
    if "string" in types:
        if "maxLength" in schema:
            most = ESCAPED * schema["maxLength"]
        else:
            most = _pattern_max(schema["pattern"])  # unbounded: fails the assert
        out = max(out, 2 + most)
    if "array" in types:
        assert "maxItems" in schema, f"unbounded array {schema}"
        out = max(out, 2 + schema["maxItems"] * (worst(schema["items"], defs) + 1))
    if "object" in types or "properties" in schema:
        out = max(out, _worst_object(schema, defs))
    assert out, f"no bound found in {schema}"
    return out


def _worst_object(schema: dict[str, Any], defs: dict[str, Any]) -> int:
    props = schema.get("properties", {})
    members = sorted(
        (len(json.dumps(k)) + 1 + worst(v, defs) for k, v in props.items()), reverse=True
    )
    extra = schema.get("additionalProperties", False)
    most = schema.get("maxProperties", len(props))
    if extra is not False:
        assert "maxProperties" in schema, f"unbounded object {schema}"
        names = schema.get("propertyNames", {})
        key = 2 + ESCAPED * names["maxLength"]
        member = key + 1 + worst(extra, defs)
        members = sorted(members + [member] * most, reverse=True)
    taken = members[:most]
    return 2 + sum(taken) + max(0, len(taken) - 1)


def request_bodies(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            body = op.get("requestBody") if isinstance(op, dict) else None
            if body:
                yield f"{method.upper()} {path}", body["content"]["application/json"]["schema"]


def test_every_body_the_schema_allows_fits_under_the_body_limit(agent: Agent) -> None:
    doc = httpx.get(f"{agent.url}/openapi.json").json()
    defs = doc["components"]["schemas"]
    bodies = dict(request_bodies(doc))
    assert len(bodies) >= 10
    sizes = {op: worst(schema, defs) for op, schema in bodies.items()}
    over = {op: n for op, n in sizes.items() if n > wire.MAX_BODY_BYTES}
    assert not over, f"bodies the schema allows over {wire.MAX_BODY_BYTES} bytes: {over}"
    # The limit is the HTTP reader's, and a record file's.
    from gpuctl.adapters.store.codec import MAX_RECORD_BYTES
    from gpuctl.agent.http import MAX_BODY_BYTES

    assert wire.MAX_BODY_BYTES == MAX_BODY_BYTES == MAX_RECORD_BYTES


def _maximal_update() -> dict[str, Any]:
    wide = "\u0001" * wire.MAX_EXTRA_TEXT  # 6 bytes each in compact JSON
    extras = {f"{i:02d}" + "k" * 62: wide for i in range(32)}
    return {
        "phase": "failed",
        "attempt": {"error": "\u0001" * wire.MAX_TEXT, **extras},
        "failure": {"error": "\u0001" * wire.MAX_TEXT, "log_tail": "\u0001" * wire.MAX_TEXT},
    }


def test_a_maximal_body_is_answered_not_refused_as_too_big(agent: Agent) -> None:
    lease = agent.post(f"/records/{SVC}/lease", {"holder": {**_holder()}, "ttl_s": 60})
    assert lease.status_code == 200, lease.text
    body = {"holder": "h" * 128, "update": _maximal_update()}
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) > 300_000  # well past the old 64 KiB limit
    r = httpx.patch(
        f"{agent.url}/records/{SVC}",
        headers={**AUTH, "Content-Type": "application/json"},
        content=raw,
        timeout=30,
    )
    assert r.status_code != 413, r.text
    assert r.status_code in (200, 409), r.text


def _holder() -> dict[str, Any]:
    return {"id": "h" * 128, "host": "here", "boot_id": "b", "pid": 1234, "entry": "test"}


def test_a_long_log_tail_still_records_the_failure_through_the_agent(
    agent: Agent, tmp_path: Path
) -> None:
    """A launcher's log tail can be 64 KiB; the client cuts it to what the store keeps."""
    store = AgentStore(agent.url, token=AUTH["Authorization"].split()[1])
    holder = _holder()
    r = agent.post(f"/records/{SVC}/lease", {"holder": holder, "ttl_s": 60})
    assert r.status_code == 200, r.text
    tail = "x" * (70 * 1024 - 4) + "LAST"
    try:
        rec = store.update(
            SVC,
            holder["id"],
            RecordUpdate(failure=StartFailure("boom", tail)),
        )
    finally:
        store.close()
    assert rec.failure is not None and rec.failure.log_tail.endswith("LAST")
    assert len(rec.failure.log_tail) == LOG_TAIL_MAX
