"""Arrows point one way: each package imports only the packages below it (kairos/__init__.py
draws the stack). Read from the source with ``ast``, so a new import that breaks the layering
fails here, not in a user's environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Package -> (its folder, the kairos packages it may import besides itself).
LAYERS: dict[str, tuple[str, frozenset[str]]] = {
    "kairos.common": ("kairos/common", frozenset()),
    "kairos.core": ("kairos/core", frozenset({"kairos.common"})),
    "kairos.api": ("kairos/api", frozenset({"kairos.common"})),
    "kairos.traffic": ("kairos/traffic", frozenset({"kairos.common"})),
    "kairos.extproc": ("extproc", frozenset({"kairos.common", "kairos.core", "kairos.api"})),
    "kairos.nodeagent": ("nodeagent", frozenset({"kairos.common", "kairos.core", "kairos.api"})),
    "kairos.sim": ("sim", frozenset({"kairos.common", "kairos.core", "kairos.api", "kairos.traffic"})),
    "kairos.profiling": ("profiling", frozenset({"kairos.common", "kairos.core", "kairos.traffic"})),
    "kairos.launcher": (
        "kairos/launcher",
        frozenset(
            {
                "kairos.common",
                "kairos.core",
                "kairos.api",
                "kairos.traffic",
                "kairos.extproc",
                "kairos.nodeagent",
                "kairos.sim",
                "kairos.profiling",
            }
        ),
    ),
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kairos":
        return None
    return ".".join(parts[:2]) if len(parts) > 1 else "kairos"


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", list(LAYERS))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    folder, allowed = LAYERS[package]
    wrong = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / folder).rglob("*.py")
        for module in imports(path)
        if (target := package_of(module)) is not None and target != package and target not in allowed
    )
    assert wrong == []


def test_every_package_has_a_layer() -> None:
    folders = {ROOT / folder for folder, _ in LAYERS.values()}
    packages = {p.parent for p in (ROOT / "kairos").glob("*/__init__.py")}
    packages |= {ROOT / d for d in ("extproc", "nodeagent", "sim", "profiling")}
    assert packages == folders
    top = {p.name for p in (ROOT / "kairos").glob("*.py")}
    assert top == {"__init__.py", "__main__.py"}  # nothing lives between the packages
