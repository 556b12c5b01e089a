"""The layer fences (DESIGN §2) hold: a deliberate bad import in each folder fails ruff
(TID251, banned-api, from that folder's ruff.toml), and an allowed one passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = str(Path(sys.executable).with_name("ruff"))


def _ruff(path: str, source: str) -> subprocess.CompletedProcess[str]:
    """``ruff check`` of ``source`` as if it were the file ``path`` (its folder's config)."""
    return subprocess.run(
        [RUFF, "check", "--no-cache", "--select", "TID251", "--stdin-filename", path, "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


BANNED = [
    ("gpuctl/core/x.py", "from gpuctl.adapters import procinfo"),
    ("gpuctl/core/x.py", "from gpuctl.agent import app"),
    ("gpuctl/core/x.py", "from gpuctl.render import status_view"),
    ("gpuctl/core/x.py", "from gpuctl.sim import gpu"),
    ("gpuctl/core/x.py", "from gpuctl import api"),
    ("gpuctl/core/x.py", "import websockets"),
    ("gpuctl/core/x.py", "import pynvml"),
    ("gpuctl/adapters/x.py", "from gpuctl.flows import ensure"),
    ("gpuctl/adapters/x.py", "from gpuctl.cli import common"),
    ("gpuctl/adapters/x.py", "from gpuctl.agent import app"),
    ("gpuctl/adapters/x.py", "from gpuctl.render.status_view import render_status"),
    ("gpuctl/adapters/probes/x.py", "from gpuctl.flows.results import Outcome"),
    ("gpuctl/flows/x.py", "from gpuctl.cli.common import say"),
    ("gpuctl/flows/x.py", "from gpuctl.render.results import ensure_text"),
    ("gpuctl/flows/x.py", "from gpuctl.agent.app import create_app"),
    ("gpuctl/flows/x.py", "import rich"),
    ("gpuctl/render/x.py", "from gpuctl.adapters.store import DirectStore"),
    ("gpuctl/render/x.py", "import httpx"),
    ("gpuctl/sim/x.py", "import httpx"),
    ("gpuctl/sim/x.py", "import platformdirs"),
    ("gpuctl/sim/x.py", "from gpuctl.adapters import procinfo"),
    ("gpuctl/sim/x.py", "from gpuctl.errors import GpuctlError"),
    ("gpuctl/sim/x.py", "from gpuctl.config import load_config"),
]

ALLOWED = [
    ("gpuctl/core/x.py", "from gpuctl.core.units import format_mib"),
    ("gpuctl/adapters/x.py", "from gpuctl.core.model import Snapshot"),
    ("gpuctl/flows/x.py", "from gpuctl.adapters.store import DirectStore"),
    ("gpuctl/render/x.py", "from rich.table import Table"),
    ("gpuctl/render/x.py", "from gpuctl.flows.results import StatusReport"),
    ("gpuctl/sim/x.py", "from gpuctl.core.units import parse_size_mib"),
    ("gpuctl/sim/x.py", "import fcntl"),
]


@pytest.mark.parametrize(("path", "line"), BANNED)
def test_a_bad_import_fails_ruff(path: str, line: str) -> None:
    r = _ruff(path, line + "\n")
    assert r.returncode == 1, (path, line, r.stdout, r.stderr)
    assert "TID251" in r.stdout


@pytest.mark.parametrize(("path", "line"), ALLOWED)
def test_an_allowed_import_passes(path: str, line: str) -> None:
    r = _ruff(path, line + "\n")
    assert r.returncode == 0, (path, line, r.stdout, r.stderr)


def _package_graph() -> dict[str, set[str]]:
    """gpuctl's packages (and top-level modules) and which others each imports, counting
    imports inside functions too (a lazy import is still an edge)."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in (ROOT / "gpuctl").rglob("*.py"):
        rel = path.relative_to(ROOT / "gpuctl").parts
        src = rel[0].removesuffix(".py")
        if src == "__main__":
            continue
        edges = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if (
                    parts[0] == "gpuctl"
                    and len(parts) > 1
                    and parts[1] != src
                    and (
                        (ROOT / "gpuctl" / parts[1]).is_dir()
                        or (ROOT / "gpuctl" / f"{parts[1]}.py").exists()
                    )
                ):
                    edges.add(parts[1])
    return graph


def test_no_package_cycles() -> None:
    graph = _package_graph()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycle = [*path[path.index(m) :], m]
                raise AssertionError(" -> ".join(cycle))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert {"core", "adapters", "flows", "render", "cli", "sim"} <= set(graph)
