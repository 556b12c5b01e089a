"""The documentation site: it builds with ``mkdocs build --strict`` (no broken link or
anchor, no page left out of the nav), README stays a front page, and the reference pages
cover what the code has: every command, every key ``gpuctl config init`` writes, every
metric, every JSON Schema, every agent endpoint."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from gpuctl.cli.app import create_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_is_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (./scripts/test does)")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    cli = (tmp_path / "reference" / "cli" / "index.html").read_text()
    assert "gpuctl sim model-server" in cli and "--preemptible" in cli
    assert (
        "/records/{service}/lease"
        in (tmp_path / "reference" / "agent-api" / "index.html").read_text()
    )


def test_every_page_is_in_the_nav() -> None:
    """MkDocs only notes (INFO) a page missing from the nav; a reader never finds it."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M)]
    assert not missing, missing


def test_readme_is_a_front_page() -> None:
    """At most 300 lines: what it is, the two commands of "Try it", one config, links."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 300
    try_it = readme[readme.index("## Try it") :]
    assert "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/gpuctl demo" in try_it
    assert "\n./scripts/test\n" in try_it
    assert (ROOT / "scripts" / "test").stat().st_mode & 0o111
    for link in re.findall(r"\]\(((?:docs/|CHANGELOG|CONTRIBUTING)[^)#]*)", readme):
        assert (ROOT / link).exists(), link


def test_changelog_and_contributing_exist_and_are_shown() -> None:
    for name in ("CHANGELOG.md", "CONTRIBUTING.md"):
        assert (ROOT / name).read_text().startswith("# ")
        page = DOCS / name.lower()
        assert page.read_text().strip() == f'--8<-- "{name}"', page
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for topic in ("## Layers", "ruff.toml", "tests/test_layers.py", "## The test harness",
                  "python -m pytest tests/", "git worktree", "git stash"):  # fmt: skip
        assert topic in contributing, topic


def _init_keys(text: str) -> set[str]:
    """The keys of a starter config, set or commented out (``# memory = "80GiB"``)."""
    return set(re.findall(r"^#? ?([a-z_]+) = ", text, re.M))


def test_every_key_config_init_writes_is_explained(tmp_path: Path) -> None:
    """Each key of the starter config, in both its shapes (this machine has the GPU, or an
    agent has it), commented out or not, has its row in a key table of the reference."""
    from gpuctl.config.starter import starter_text

    path = tmp_path / "config.toml"
    r = CliRunner().invoke(create_app(), ["config", "init", "--config", str(path)])
    assert r.exit_code == 0, r.output
    keys = _init_keys(path.read_text())
    for gpu_here in (False, True):
        text = starter_text("box", gpu_here=gpu_here, agent="http://127.0.0.1:9400",
                            token_file=tmp_path / "box.token")  # fmt: skip
        keys |= _init_keys(text)
    assert {"idle_timeout", "memory", "probe", "token_file", "agent"} <= keys, keys
    page = (DOCS / "reference" / "configuration.md").read_text()
    rows = re.findall(r"^\| ([^|]+) \|", page, re.M)
    explained = {k for row in rows for k in re.findall(r"`([a-z_]+)`", row)}
    assert keys <= explained, sorted(keys - explained)


def test_every_config_key_is_explained() -> None:
    from gpuctl.config.parse import DEFAULTS_KEYS, HOST_KEYS, SERVICE_KEYS
    from gpuctl.config.proxy_fields import PROXY_KEYS

    page = (DOCS / "reference" / "configuration.md").read_text()
    tables = {
        name: page[page.index(f"### `[{name}]`") :].split("\n### ", 1)[0]
        for name in ("defaults", "hosts.NAME", "services.NAME", "proxy")
    }
    for name, keys in (
        ("defaults", DEFAULTS_KEYS),
        ("hosts.NAME", HOST_KEYS),
        ("services.NAME", SERVICE_KEYS),
        ("proxy", PROXY_KEYS),
    ):
        rows = re.findall(r"^\| ([^|]+) \|", tables[name], re.M)
        explained = {k for row in rows for k in re.findall(r"`([a-z_]+)`", row)}
        assert set(keys) <= explained, (name, sorted(set(keys) - explained))


def test_every_metric_is_on_the_metrics_page() -> None:
    page = (DOCS / "reference" / "metrics.md").read_text()
    names: set[str] = set()
    for src in ("gpuctl/agent/metrics.py", "gpuctl/proxy/metrics.py"):
        names |= set(re.findall(r"\b(gpuctl_[a-z_]+)\b", (ROOT / src).read_text()))
    names -= {"gpuctl_"}
    assert len(names) >= 20, sorted(names)
    assert not [n for n in sorted(names) if f"`{n}`" not in page]


def test_the_generated_references_cover_the_code() -> None:
    """The hook renders every visible command, every schema file and every endpoint."""
    h = hooks()
    cli = h.cli_reference()
    for path in h.command_paths():
        assert f"## `{' '.join(('gpuctl', *path))}`" in cli, path
    assert "\x1b[" not in cli  # no colour codes in the page
    schemas = h.schemas_reference()
    for path in sorted((ROOT / "schemas").glob("*.schema.json")):
        assert f"`schemas/{path.name}`" in schemas
    from gpuctl.agent.openapi import openapi_document

    api = h.agent_api()
    for route, item in openapi_document()["paths"].items():
        for method in item:
            if method in {"get", "put", "post", "patch", "delete"}:
                assert f"### `{method.upper()} {route}`" in api, (method, route)
    with pytest.raises(KeyError, match="no renderer"):
        h.render("<!-- gpuctl:nothing -->")


def test_every_marker_in_docs_has_a_renderer() -> None:
    h = hooks()
    for page in DOCS.rglob("*.md"):
        for name in h.MARKER.findall(page.read_text()):
            assert name in h.RENDERERS, (page, name)


def test_mkdocs_is_in_the_docs_extra() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    extra = text[text.index("\ndocs = [") :].split("]", 1)[0]
    for package in ("mkdocs", "mkdocs-material"):
        assert f'"{package}>=' in extra, package
    assert "'.[test,docs]'" in (ROOT / "scripts" / "test").read_text()
    assert shutil.which("bash")
