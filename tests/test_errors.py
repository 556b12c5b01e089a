"""The exception tree: drawn whole in ``gpuctl.errors``' docstring, and no class unused."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import gpuctl
from gpuctl import errors

ROOT = Path(gpuctl.__file__).parent


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_all_subclasses(sub)}
    return out


def test_every_gpuctl_error_is_drawn_in_the_tree() -> None:
    for mod in pkgutil.walk_packages([str(ROOT)], "gpuctl."):
        if mod.name.endswith("__main__") or mod.name.startswith(
            ("gpuctl.sim", "gpuctl.cli", "gpuctl.agent")
        ):
            continue  # no GpuctlError subclasses there; some need the server stack
        importlib.import_module(mod.name)
    doc = errors.__doc__ or ""
    drawn = set(re.findall(r"[├└]── (\w+)", doc))
    classes = {c.__name__ for c in _all_subclasses(errors.GpuctlError)}
    assert classes == drawn, (classes - drawn, drawn - classes)


def test_no_error_class_is_unused() -> None:
    source = "\n".join(
        p.read_text() for p in ROOT.rglob("*.py") if p.resolve() != Path(errors.__file__).resolve()
    )
    for name in re.findall(r"^class (\w+)\(", Path(errors.__file__).read_text(), re.M):
        if name in ("ExitCode", "GpuctlError"):
            continue
        assert re.search(rf"\b{name}\b", source), f"{name} is never raised or caught"
