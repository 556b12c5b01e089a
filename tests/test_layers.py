"""The house holds: each layer's fence (its folder's ruff.toml, rule TID251 banned-api) fails
a deliberate bad import written into a file of that layer, the real tree passes them, the
core and the sim import nothing but the standard library and gpuctl.core (the core msgspec
too), no package imports in a cycle."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gpuctl"
RUFF = str(Path(sys.executable).with_name("ruff"))

# The folders with a fence. The proxy's is checked once gpuctl/proxy/ exists.
FENCED = (
    "core",
    "config",
    "adapters",
    "flows",
    "wiring",
    "demo",
    "agent",
    "render",
    "sim",
    "proxy",
    "cli",
)


def _tree_copy(tmp: Path) -> Path:
    """A copy of the lint configuration (root and every folder's ruff.toml) and nothing else,
    so a bad file written there is linted exactly as it would be in the real tree."""
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    for cfg in PKG.rglob("ruff.toml"):
        dest = tmp / cfg.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(cfg, dest)
    return tmp


def _ruff_file(tmp: Path, rel: str, source: str) -> subprocess.CompletedProcess[str]:
    """Write ``source`` as ``rel`` in a copy of the tree and run the real ``ruff check`` on it
    (every rule of the config; the tests look for TID251)."""
    root = _tree_copy(tmp)
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return subprocess.run(
        [RUFF, "check", "--no-cache", "--output-format", "concise", rel],
        capture_output=True,
        text=True,
        cwd=root,
        check=False,
    )


BANNED = [
    ("core", "from gpuctl.adapters import procinfo", "gpuctl.adapters"),
    ("core", "from gpuctl import adapters", "gpuctl.adapters"),
    ("core", "import gpuctl.flows.ensure", "gpuctl.flows"),
    ("core", "from gpuctl.agent import app", "gpuctl.agent"),
    ("core", "from gpuctl.render import status_view", "gpuctl.render"),
    ("core", "from gpuctl.sim import gpu", "gpuctl.sim"),
    ("core", "from gpuctl import api", "gpuctl.api"),
    ("core", "from gpuctl.errors import GpuctlError", "gpuctl.errors"),
    ("core", "from gpuctl.config import load_config", "gpuctl.config"),
    ("core", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("core", "from gpuctl.proxy import app", "gpuctl.proxy"),
    ("core", "import websockets", "websockets"),
    ("core", "import pynvml", "pynvml"),
    ("core", "import httpx", "httpx"),
    ("core", "import platformdirs", "platformdirs"),
    ("core", "import typer", "typer"),
    ("core", "from rich.table import Table", "rich"),
    ("core", "import subprocess", "subprocess"),
    ("adapters", "from gpuctl.flows import ensure", "gpuctl.flows"),
    ("adapters", "from gpuctl.cli import common", "gpuctl.cli"),
    ("adapters", "from gpuctl.agent import app", "gpuctl.agent"),
    ("adapters", "from gpuctl.render.status_view import render_status", "gpuctl.render"),
    ("adapters/probes", "from gpuctl.flows.results import Outcome", "gpuctl.flows"),
    ("adapters/store", "import gpuctl.cli.app", "gpuctl.cli"),
    ("adapters", "import rich", "rich"),
    ("flows", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("flows", "from gpuctl.render.results import ensure_text", "gpuctl.render"),
    ("flows", "from gpuctl.agent.app import create_app", "gpuctl.agent"),
    ("flows", "import rich", "rich"),
    ("flows", "from gpuctl.adapters.procinfo import host_identity", "gpuctl.adapters.procinfo"),
    ("flows", "from gpuctl.adapters import procinfo", "gpuctl.adapters.procinfo"),
    ("flows", "from gpuctl.adapters.job_cmd import stop_job", "gpuctl.adapters.job_cmd"),
    ("flows", "from gpuctl.adapters.vllm import origin", "gpuctl.adapters.vllm"),
    ("flows", "from gpuctl.adapters.store import holder_here", "gpuctl.adapters.store.holder_here"),
    ("flows", "from gpuctl.adapters.store import AgentStore", "gpuctl.adapters.store.AgentStore"),
    (
        "flows",
        "from gpuctl.adapters.store.direct import DirectStore",
        "gpuctl.adapters.store.direct",
    ),
    (
        "flows/ensure",
        "from gpuctl.adapters.store.inflight import stopping",
        "gpuctl.adapters.store.inflight",
    ),
    ("flows", "import gpuctl.adapters.launchers.process", "gpuctl.adapters.launchers.process"),
    ("flows", "from gpuctl.adapters.probes.factory import make_probe", "gpuctl.adapters.probes"),
    ("render", "from gpuctl.adapters.store.direct import DirectStore", "gpuctl.adapters"),
    ("render", "import gpuctl.adapters.procinfo", "gpuctl.adapters"),
    ("render", "import httpx", "httpx"),
    ("sim", "import httpx", "httpx"),
    ("sim", "import platformdirs", "platformdirs"),
    ("sim", "from gpuctl.adapters import procinfo", "gpuctl.adapters"),
    ("sim", "from gpuctl.adapters.probes.sim import SimProbe", "gpuctl.adapters"),
    ("sim", "from gpuctl.errors import GpuctlError", "gpuctl.errors"),
    ("sim", "from gpuctl.config import load_config", "gpuctl.config"),
    ("sim", "from gpuctl.flows import ensure", "gpuctl.flows"),
    ("flows", "from gpuctl.wiring.build import deps_for", "gpuctl.wiring"),
    ("flows", "from gpuctl.demo import tour", "gpuctl.demo"),
    ("flows", "from gpuctl.proxy.app import ProxyApp", "gpuctl.proxy"),
    ("config", "from gpuctl.adapters.store.direct import DirectStore", "gpuctl.adapters"),
    ("config", "from gpuctl.flows.status import status", "gpuctl.flows"),
    ("config", "from gpuctl.render.config_view import show", "gpuctl.render"),
    ("config", "import httpx", "httpx"),
    ("wiring", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("wiring", "from gpuctl.render.results import ensure_text", "gpuctl.render"),
    ("wiring", "from gpuctl.agent.app import create_app", "gpuctl.agent"),
    ("wiring", "from gpuctl.proxy import app", "gpuctl.proxy"),
    ("wiring", "import rich", "rich"),
    ("demo", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("demo", "import rich", "rich"),
    ("agent", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("agent", "from gpuctl.render.status_view import render_status", "gpuctl.render"),
    ("agent", "from gpuctl.wiring.build import deps_for", "gpuctl.wiring"),
    ("agent", "from gpuctl.proxy import app", "gpuctl.proxy"),
    ("agent", "import typer", "typer"),
    ("cli", "import docker", "docker"),
    ("cli", "import pynvml", "pynvml"),
    ("cli", "from gpuctl.core.decision import classify", "gpuctl.core.decision"),
    ("proxy", "from gpuctl.cli.common import say", "gpuctl.cli"),
    ("proxy", "from gpuctl.render.results import ensure_text", "gpuctl.render"),
    ("proxy", "import rich", "rich"),
]

ALLOWED = [
    ("core", "from gpuctl.core.units import format_mib"),
    ("core", "import dataclasses"),
    ("adapters", "from gpuctl.core.snapshot import Snapshot"),
    ("adapters", "import httpx"),
    ("flows", "from gpuctl.adapters.store.base import Store"),
    ("flows", "from gpuctl.adapters.launchers.base import Handle, Launcher"),
    ("render", "from rich.table import Table"),
    ("render", "from gpuctl.flows.results import StatusReport"),
    ("sim", "from gpuctl.core.units import parse_size_mib"),
    ("sim", "import fcntl"),
    ("proxy", "from gpuctl.flows import ensure"),
    ("config", "from gpuctl.core.units import parse_size_mib"),
    ("wiring", "from gpuctl.adapters.store.direct import DirectStore"),
    ("wiring", "from gpuctl.flows.deps import EnsureDeps"),
    ("demo", "from gpuctl.wiring.build import gather_status"),
    ("agent", "from gpuctl.adapters.store.direct import DirectStore"),
    ("cli", "from rich.table import Table"),
    ("cli", "from gpuctl.wiring.build import deps_for"),
]


def _needs_layer(layer: str) -> None:
    if not (PKG / layer.split("/", maxsplit=1)[0]).is_dir():
        pytest.skip(f"gpuctl/{layer} does not exist yet")


@pytest.mark.parametrize(("layer", "line", "banned"), BANNED)
def test_a_bad_import_fails_ruff(tmp_path: Path, layer: str, line: str, banned: str) -> None:
    _needs_layer(layer)
    r = _ruff_file(tmp_path, f"gpuctl/{layer}/fence_probe.py", f"{line}\n\n__all__ = []\n")
    assert r.returncode == 1, (layer, line, r.stdout, r.stderr)
    assert f"TID251 `{banned}` is banned" in r.stdout, (layer, line, r.stdout)


@pytest.mark.parametrize(("layer", "line"), ALLOWED)
def test_an_allowed_import_passes_its_fence(tmp_path: Path, layer: str, line: str) -> None:
    _needs_layer(layer)
    r = _ruff_file(tmp_path, f"gpuctl/{layer}/fence_probe.py", f"{line}\n")
    assert r.returncode in (0, 1), (r.stdout, r.stderr)  # 1: an unused import (F401) only
    assert "TID251" not in r.stdout, (layer, line, r.stdout)


def test_every_fenced_layer_has_its_fence() -> None:
    for layer in FENCED:
        if (PKG / layer).is_dir():
            assert (PKG / layer / "ruff.toml").is_file(), f"gpuctl/{layer} has no ruff.toml"


def test_the_real_tree_passes_the_fences() -> None:
    r = subprocess.run(
        [RUFF, "check", "--no-cache", "--select", "TID", "gpuctl"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# The adapter modules a flow may import: the homes of the interfaces it names by type.
PORT_HOMES = {
    "gpuctl.adapters",
    "gpuctl.adapters.store",  # its concrete names are banned one by one
    "gpuctl.adapters.store.base",
    "gpuctl.adapters.launchers",
    "gpuctl.adapters.launchers.base",
}


def test_flows_are_fenced_off_every_concrete_adapter() -> None:
    """Every module under gpuctl/adapters/ but the interfaces' homes is banned in flows
    (itself or a package above it), so a new adapter is fenced off from the day it lands."""
    banned = _banned("flows")
    open_ = []
    for path in sorted((PKG / "adapters").rglob("*.py")):
        mod = _module_of(path)
        parts = mod.split(".")
        if mod in PORT_HOMES:
            continue
        if not any(".".join(parts[:i]) in banned for i in range(3, len(parts) + 1)):
            open_.append(mod)
    assert not open_, f"gpuctl/flows/ruff.toml does not ban {open_}"


def _banned(layer: str) -> set[str]:
    cfg = tomllib.loads((PKG / layer / "ruff.toml").read_text())
    return set(cfg["lint"]["flake8-tidy-imports"]["banned-api"])


# The one package the core may import (gpuctl/core/ruff.toml says why); the sim may not.
CORE_ALLOWS = {"msgspec"}

# Distributions whose import name is not their own name.
_IMPORT_NAME = {"nvidia-ml-py": "pynvml"}


def _runtime_imports() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra, more in project["optional-dependencies"].items():
        if extra not in ("test", "docs"):  # tools for the suite and the site, never imported
            reqs += more
    names = set()
    for req in reqs:
        dist = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()
        names.add(_IMPORT_NAME.get(dist, dist.replace("-", "_")))
    return names


def _gpuctl_parts() -> set[str]:
    return {
        f"gpuctl.{p.name.removesuffix('.py')}"
        for p in PKG.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
    }


# The one package the core may import: msgspec, a declaration library with no I/O, in
# which the record's shapes are declared once (``core.record_shapes``).
CORE_ALLOWED = {"msgspec"}


@pytest.mark.parametrize("layer", ["core", "sim"])
def test_the_bare_layers_ban_every_installed_package_and_every_other_layer(layer: str) -> None:
    """The ban lists of core and sim name every package gpuctl installs (a new dependency
    must be added to them) and every gpuctl package but the core; the core's list all
    but ``CORE_ALLOWED``."""
    banned = _banned(layer)
    allowed = CORE_ALLOWED if layer == "core" else set()
    missing = (_runtime_imports() | (_gpuctl_parts() - {"gpuctl.core", "gpuctl.__init__"})) - {
        f"gpuctl.{layer}"
    }
    assert not banned & allowed, f"gpuctl/{layer}/ruff.toml bans {sorted(banned & allowed)}"
    missing -= allowed
    assert not missing - banned, f"gpuctl/{layer}/ruff.toml does not ban {sorted(missing - banned)}"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import in ``path`` (inside functions too), as (line, module)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("layer", ["core", "sim"])
def test_the_bare_layers_import_only_the_standard_library_and_core(layer: str) -> None:
    """Beyond any list: every import in core and sim is standard library, __future__ or
    gpuctl.core (sim may import itself; core exactly ``CORE_ALLOWED`` besides)."""
    own = {"gpuctl.core"} | ({"gpuctl.sim"} if layer == "sim" else CORE_ALLOWED)
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if any(mod == o or mod.startswith(o + ".") for o in own):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {mod}")
    assert not bad, "\n".join(bad)


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _without_type_checking(tree: ast.Module) -> ast.Module:
    """``tree`` less its ``if TYPE_CHECKING:`` blocks."""

    class Drop(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | None:
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                return None
            return self.generic_visit(node)

    return Drop().visit(tree)


def _package_graph(depth: int) -> dict[str, set[str]]:
    """gpuctl's packages, cut at ``depth`` dotted parts below gpuctl (1: adapters, flows...;
    2: adapters.probes, adapters.store...), and which others each imports, counting imports
    inside functions and relative imports too (a lazy import is still an edge).
    A module that is not a package counts as a node of its own, so ``depth=2`` also finds
    cycles between the modules directly inside a package. Between modules of one package a
    reference made only for type annotations (``if TYPE_CHECKING:``) is no edge; between
    packages (``depth=1``) it counts like any other."""

    def node(mod: str) -> str | None:
        parts = mod.split(".")
        if parts[0] != "gpuctl" or len(parts) < 2:
            return None
        cut = ["gpuctl"]
        for p in parts[1 : depth + 1]:
            cut.append(p)
            if not (ROOT.joinpath(*cut)).is_dir():
                break
        here = ROOT.joinpath(*cut)
        if not here.is_dir() and not here.with_suffix(".py").exists():
            return None  # a name imported from a module, not a module
        return ".".join(cut)

    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        mod = _module_of(path)
        src = node(mod) if mod != "gpuctl" else None
        if src is None or src == "gpuctl.__main__":
            continue
        edges = graph.setdefault(src, set())
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        if depth > 1:
            tree = _without_type_checking(tree)
        for tree_node in ast.walk(tree):
            names: list[str] = []
            if isinstance(tree_node, ast.Import):
                names = [a.name for a in tree_node.names]
            elif isinstance(tree_node, ast.ImportFrom):
                base = tree_node.module or ""
                if tree_node.level:
                    anchor = mod.split(".")
                    up = tree_node.level - (1 if is_pkg else 0)
                    anchor = anchor[: len(anchor) - up] if up else anchor
                    base = ".".join([*anchor, base] if base else anchor)
                names = [base] + [f"{base}.{a.name}" for a in tree_node.names]
            for name in names:
                dst = node(name)
                if dst is not None and dst != src and not src.startswith(dst + "."):
                    # a package importing its own parent's __init__ is not an edge out
                    edges.add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("depth", [1, 2])
def test_no_package_cycles(depth: int) -> None:
    graph = _package_graph(depth)
    assert {"gpuctl.core", "gpuctl.adapters", "gpuctl.flows", "gpuctl.cli"} <= {
        n.split(".")[0] + "." + n.split(".")[1] for n in graph
    }
    assert any(graph.values()), "the graph has no edges: the scan found no imports"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def _load_time_imports(tree: ast.Module, lazy: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is loaded or type-checked: its top level, class
    bodies and ``if``/``try`` blocks (``if TYPE_CHECKING:`` included: a type-only circle
    still ties two ideas together). Imports inside functions are lazy: left out unless
    ``lazy``."""
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Import | ast.ImportFrom):
                out.append(s)
            elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
                if lazy:
                    walk(s.body)
            elif isinstance(s, ast.ClassDef):
                walk(s.body)
            else:
                for name in ("body", "orelse", "finalbody"):
                    walk(getattr(s, name, None) or [])
                for handler in getattr(s, "handlers", None) or []:
                    walk(handler.body)

    walk(tree.body)
    return out


def _module_graph(root: Path, lazy: bool = False) -> dict[str, set[str]]:
    """Every module of ``root``/gpuctl and the modules it imports at load time. Importing
    ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so a module also depends on
    the packages above what it imports."""
    files = {_module_of_in(root, p): p for p in (root / "gpuctl").rglob("*.py")}

    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & files.keys()

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges = graph.setdefault(mod, set())
        for node in _load_time_imports(ast.parse(path.read_text()), lazy):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".")
                    up = node.level - (1 if path.name == "__init__.py" else 0)
                    anchor = anchor[: len(anchor) - up] if up else anchor
                    base = ".".join([*anchor, base] if base else anchor)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            for name in names:
                edges |= with_parents(name)
        edges -= {mod, *with_parents(mod)}  # a module's own packages run before it
    return graph


def _module_of_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other (Tarjan's strongly connected
    components with more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                found.append(sorted([v, *part]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_module_graph_sees_type_only_and_package_circles(tmp_path: Path) -> None:
    pkg = tmp_path / "gpuctl"
    (pkg / "p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuctl.b import B\n"
    )
    (pkg / "b.py").write_text("from gpuctl import a\n")
    (pkg / "lazy.py").write_text("def f():\n    from gpuctl import b\n")
    (pkg / "p" / "__init__.py").write_text("from gpuctl.p.x import X\n")
    (pkg / "p" / "x.py").write_text("from gpuctl.y import Y\n")
    (pkg / "y.py").write_text("from gpuctl.p.z import Z\n")
    (pkg / "p" / "z.py").write_text("Z = 1\n")
    graph = _module_graph(tmp_path)
    assert graph["gpuctl.lazy"] == set()
    assert graph["gpuctl.y"] == {"gpuctl.p", "gpuctl.p.z"}
    assert _module_cycles(graph) == [
        ["gpuctl.a", "gpuctl.b"],
        ["gpuctl.p", "gpuctl.p.x", "gpuctl.y"],
    ]


def test_no_module_imports_itself_in_a_circle() -> None:
    """0 file-level circles: no two modules import each other, directly or round a loop,
    counting type-only imports and the packages an import runs."""
    graph = _module_graph(ROOT)
    assert sum(map(len, graph.values())) > 100, "the scan found no imports"
    assert _module_cycles(graph) == []


# The layers, lowest first. A module imports its own layer and those below, never one
# above (lazy imports included: an upward import inside a function is still upward).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gpuctl", "gpuctl.core"),
    ("gpuctl.errors", "gpuctl.failpoints", "gpuctl.sim"),
    ("gpuctl.config",),
    ("gpuctl.adapters",),
    ("gpuctl.flows",),
    ("gpuctl.wiring",),
    ("gpuctl.agent", "gpuctl.api", "gpuctl.demo", "gpuctl.render"),
    ("gpuctl.proxy",),
    ("gpuctl.cli", "gpuctl.__main__"),
)


def _layer_of(mod: str) -> int:
    top = ".".join(mod.split(".")[:2])
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{mod} is in no layer of LAYERS: add its package there")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}" for a, bs in graph.items() for b in bs if _layer_of(b) > _layer_of(a)
    )


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"gpuctl.flows.x": {"gpuctl.core.y"}, "gpuctl.adapters.z": {"gpuctl.wiring.w"}}
    assert _upward(graph) == ["gpuctl.adapters.z -> gpuctl.wiring.w"]


def test_no_module_imports_a_higher_layer() -> None:
    graph = _module_graph(ROOT, lazy=True)
    assert not _upward(graph), "\n".join(_upward(graph))


def test_the_repo_stands_alone() -> None:
    """No source cites a design document the repository does not carry ("DESIGN §N")."""
    cited = []
    for top in ("gpuctl", "tests", "bench", "scripts"):
        for path in sorted((ROOT / top).rglob("*")):
            if (
                path.is_file()
                and path.suffix in (".py", ".toml", ".md", "")
                and path != Path(__file__)
            ):
                text = path.read_text(errors="replace")
                if re.search(r"DESIGN(\.md)? ?§", text):
                    cited.append(str(path.relative_to(ROOT)))
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
    for page in [*pages, *sorted((ROOT / "docs").rglob("*.md"))]:
        if re.search(r"DESIGN(\.md)? ?§", page.read_text()):
            cited.append(str(page.relative_to(ROOT)))
    assert not cited, cited
