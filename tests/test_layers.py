"""The house's layers, from the code's own imports (module level and inside functions alike).

`api/` is the bottom floor; `worker/`, `operator/` and `control_plane/` stand on it and never import
each other: what two of them share moves down into `api/`. `local/`, `bench/` and `cli/` compose
them and may import anything.
`monitoring/` (rules, dashboards) and `storage/` (weights by URI) stand on `api/` alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "inferplane"
FORBIDDEN = {
    "api": {"worker", "operator", "control_plane", "local", "bench", "monitoring", "storage"},
    # Fetching weights by URI into the node cache: the registry, the operator and the local
    # supervisor all use it, so it stands on api/ alone.
    "storage": {"worker", "operator", "control_plane", "local", "bench", "monitoring"},
    # Rules and dashboards read only api/ (metric names, the spec); the operator renders them.
    "monitoring": {"worker", "operator", "control_plane", "local", "bench"},
    "worker": {"operator", "control_plane", "local", "monitoring"},
    "operator": {"worker", "control_plane", "local"},
    "control_plane": {"worker", "operator", "local", "monitoring"},
}


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of every module `source` (a module of `package`) imports, relative ones resolved."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
    return names


def module_imports(path: Path) -> set[str]:
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    return imported_modules(path.read_text(), package)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_or_beside_it(layer: str) -> None:
    offences = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in sorted(module_imports(path)):
            parts = name.split(".")
            if parts[0] == "inferplane" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                offences.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert offences == []


def test_the_walk_sees_function_level_and_relative_imports() -> None:
    source = "import os\nfrom . import sibling\nfrom ..worker import engine\n" \
             "def f():\n    from inferplane.operator.handlers import reconcile\n"
    assert imported_modules(source, "inferplane.control_plane.gateway") == {
        "os", "inferplane.control_plane.gateway", "inferplane.control_plane.worker", "inferplane.operator.handlers"}
