"""MkDocs hook: the reference pages that are rendered from the code, at build time.

A page holds a marker (``<!-- gpuctl:cli -->``) and the build puts the rendering in its
place. The CLI reference comes from the Typer app's own ``--help``, the agent's API from
its ``/openapi.json`` document, the JSON Schemas from ``schemas/``: generated each build,
so they cannot drift from the code, and there is no generated file to commit or to keep
in step when a command, an endpoint or a schema changes.

Run it alone to see a page: ``python scripts/docs_hooks.py cli|agent-api|schemas``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The pages describe this checkout, whichever gpuctl is installed (or none: `mkdocs` from
# another environment still finds the app).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
MARKER = re.compile(r"<!-- gpuctl:([\w-]+) -->")
# Help is rendered at a fixed width and without colour, so a build gives the same page
# on every machine and terminal.
HELP_ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}


def _walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not sub.hidden:
            yield from _walk(sub, (*path, name))


def command_paths() -> list[tuple[str, ...]]:
    """Every visible command of the app, ``()`` for ``gpuctl`` itself, groups first."""
    import typer.main

    from gpuctl.cli.app import create_app

    return [path for path, _ in _walk(typer.main.get_command(create_app()))]


def cli_reference() -> str:
    """Each command's ``--help`` as the app prints it, one section per command."""
    from typer.testing import CliRunner

    from gpuctl.cli.app import create_app

    runner = CliRunner()
    out: list[str] = []
    for path in command_paths():
        result = runner.invoke(create_app(), [*path, "--help"], env=HELP_ENV)
        if result.exit_code != 0:
            raise RuntimeError(f"gpuctl {' '.join(path)} --help: exit {result.exit_code}")
        title = " ".join(("gpuctl", *path))
        text = "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())
        out += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(out)


def _type(schema: dict[str, Any], at: str = "") -> str:
    """A schema's type in a few words: ``string``, ``integer or null``, a link to ``Record``.

    ``at`` prefixes the anchors a ``$ref`` links to: two schemas may each define a
    ``handle``, and each link must reach its own.
    """
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{at}{name.lower()})"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return " or ".join(_type(s, at) for s in schema[key])
    kind = schema.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    words = []
    for k in kinds:
        if k == "array" and isinstance(schema.get("items"), dict):
            words.append(f"array of {_type(schema['items'], at)}")
        else:
            words.append(str(k))
    return " or ".join(words)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _properties(schema: dict[str, Any], at: str = "") -> list[str]:
    props: dict[str, Any] = schema.get("properties", {})
    if not props:
        return []
    required = set(schema.get("required", ()))
    rows = ["| key | type | required | meaning |", "|---|---|---|---|"]
    for name, sub in props.items():
        mark = "yes" if name in required else ""
        rows.append(
            f"| `{name}` | {_type(sub, at)} | {mark} | {_cell(sub.get('description', ''))} |"
        )
    return [*rows, ""]


def agent_api() -> str:
    """The agent's endpoints and components, from the document ``GET /openapi.json`` serves."""
    from gpuctl.agent.openapi import openapi_document

    doc = openapi_document()
    out = [f"OpenAPI {doc['openapi']}, {doc['info']['title']} {doc['info']['version']}.", ""]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method not in {"get", "put", "post", "patch", "delete", "head"}:
                continue
            out += [f"### `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [_cell(op["summary"]), ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            if op.get("security") == []:
                out += ["No token needed.", ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | meaning |", "|---|---|---|---|"]
                for p in params:
                    out.append(
                        f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} "
                        f"| {_cell(p.get('description', ''))} |"
                    )
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            for media, spec in body.items():
                out += [f"Request body ({media}): {_type(spec.get('schema', {}))}.", ""]
            out += ["| status | meaning | body |", "|---|---|---|"]
            for code, resp in op.get("responses", {}).items():
                kinds = [
                    f"{media}: {_type(spec.get('schema', {}))}"
                    for media, spec in resp.get("content", {}).items()
                ]
                out.append(
                    f"| {code} | {_cell(resp.get('description', ''))} | {'; '.join(kinds)} |"
                )
            out.append("")
    out += ["## Components", ""]
    for name, schema in doc["components"].get("schemas", {}).items():
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [_cell(schema["description"]), ""]
        rows = _properties(schema)
        out += rows or [f"Type: {_type(schema)}.", ""]
    return "\n".join(out)


def schema_files() -> list[Path]:
    return sorted((ROOT / "schemas").glob("*.schema.json"))


def _schema_section(schema: dict[str, Any], at: str, depth: int, seen: set[str]) -> list[str]:
    """A property table, then one section per nested object and per definition."""
    out = _properties(schema, at)
    for name, sub in schema.get("properties", {}).items():
        inner = sub.get("items", sub) if isinstance(sub.get("items"), dict) else sub
        inner = next(
            (s for s in inner.get("anyOf", inner.get("oneOf", [])) if s.get("properties")),
            inner,
        )
        if inner.get("properties") and name not in seen:
            out += [f"{'#' * depth} `{name}`", ""]
            out += _schema_section(inner, at, min(depth + 1, 6), seen | {name})
    for key in ("$defs", "definitions"):
        for name, sub in schema.get(key, {}).items():
            out += [f"{'#' * depth} `{name}` {{#{at}{name.lower()}}}", ""]
            if sub.get("description"):
                out += [_cell(sub["description"]), ""]
            out += _schema_section(sub, at, min(depth + 1, 6), seen | {name})
    return out


def schemas_reference() -> str:
    """Each ``schemas/*.schema.json``: its title, what it describes, and every key."""
    out: list[str] = []
    for path in schema_files():
        schema = json.loads(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        out += [f"## `{schema.get('title', path.stem)}`", ""]
        out += [f"`{rel}` (`{schema.get('$id', '')}`). {_cell(schema.get('description', ''))}", ""]
        at = path.name.split(".")[0] + "-"
        out += _schema_section(schema, at, 3, set())
    return "\n".join(out)


RENDERERS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "agent-api": agent_api,
    "schemas": schemas_reference,
}


def render(markdown: str) -> str:
    """The page with each marker replaced by its rendering; an unknown marker is an error."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in RENDERERS:
            raise KeyError(f"no renderer for <!-- gpuctl:{name} --> (known: {sorted(RENDERERS)})")
        return RENDERERS[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs' hook for each page's Markdown, before it is converted."""
    return render(markdown)


if __name__ == "__main__":
    print(RENDERERS[sys.argv[1]]())
