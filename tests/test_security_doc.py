"""docs/security.md: every line that says what a role can or cannot do names the tests
that check it, and those tests exist. A claim with no test, or one whose test was
renamed or removed, fails here, so the page cannot drift from what is proven."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "security.md"
ROLES = ("Group member", "Read token holder", "Write token holder", "Network peer")
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`")


def _claims() -> dict[str, list[str]]:
    """The bullets under each role's heading (``## <role>``), joined across lines."""
    out: dict[str, list[str]] = {}
    role = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            role = next((r for r in ROLES if title.startswith(r)), None)
            if role is not None:
                out[role] = []
        elif role is not None and line.startswith("- "):
            out[role].append(line[2:])
        elif role is not None and line.startswith("  ") and out[role]:
            out[role][-1] += " " + line.strip()
    return out


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    }


def test_every_role_has_its_section_and_claims() -> None:
    claims = _claims()
    assert sorted(claims) == sorted(ROLES), sorted(claims)
    for role, lines in claims.items():
        assert len(lines) >= 3, f"{role}: {lines}"
        for line in lines:
            assert re.search(r"\b(can|cannot)\b", line), (
                f"{role}: says neither can nor cannot: {line}"
            )


def test_every_claim_names_tests_that_exist() -> None:
    missing = []
    for role, lines in _claims().items():
        for line in lines:
            refs = REF.findall(line)
            if not refs:
                missing.append(f"{role}: no test named: {line[:80]}")
            for file, name in refs:
                path = ROOT / file
                if not path.is_file() or name not in _tests_in(path):
                    missing.append(f"{role}: {file}::{name} does not exist")
    assert not missing, "\n".join(missing)
