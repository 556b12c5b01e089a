"""The code blocks of README, CONTRIBUTING and docs/ are what a newcomer pastes: each
Python block runs as written (no top-level ``await``, no ``[...]`` standing for an
argument, every name it imports from gpuctl exists), and a shell block holds commands,
not their output."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(lang: str, pages: list[Path] = PAGES) -> list[str]:
    found = [
        body for page in pages for kind, body in BLOCK.findall(page.read_text()) if kind == lang
    ]
    assert found, lang
    return found


def test_each_kind_of_block_is_where_a_reader_looks() -> None:
    """The snippets this file checks are where they were moved to, so no check runs empty."""
    assert blocks("sh", [ROOT / "README.md"])  # the demo and the test command
    assert blocks("python", [ROOT / "docs" / "how-to" / "python.md"])
    assert blocks("python", [ROOT / "docs" / "how-to" / "proxy.md"])


def test_python_blocks_run_as_pasted() -> None:
    for src in blocks("python"):
        compile(src, "<doc>", "exec")  # a SyntaxError for an `await` outside a function
        tree = ast.parse(src)
        for node in ast.walk(tree):
            # `messages=[...]` is a list holding Ellipsis: a TypeError in the client.
            if isinstance(node, ast.Constant) and node.value is Ellipsis:
                parent = next(p for p in ast.walk(tree) if node in list(ast.iter_child_nodes(p)))
                assert isinstance(parent, ast.Expr), f"an elided value in:\n{src}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpuctl"):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    assert hasattr(module, alias.name), (node.module, alias.name)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        bound = {
            *(a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names),
            *(t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)),
            *(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
            *(n.target.id for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)),
            *(i.optional_vars.id for n in ast.walk(tree) if isinstance(n, ast.With | ast.AsyncWith) for i in n.items if isinstance(i.optional_vars, ast.Name)),
        }  # fmt: skip
        unbound = names - bound - set(dir(builtins)) - {"__name__"}
        assert not unbound, f"{sorted(unbound)} used but never set in:\n{src}"


def test_shell_blocks_hold_commands_not_output() -> None:
    for src in blocks("sh"):
        for line in src.splitlines():
            assert not re.match(r"(: |data: |\.\.\.$)", line), f"output in a sh block: {line!r}"


def test_the_openai_snippet_does_not_wait_out_retry_after() -> None:
    """The proxy's 503 carries Retry-After: 30, and the client's two default retries
    honour it: a person at the prompt would wait a minute for a busy GPU's answer."""
    (snippet,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    assert "max_retries=0" in snippet, snippet
