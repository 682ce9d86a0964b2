"""The house's layers, from the code's own imports (module level and inside functions alike).

`api/` is the bottom floor; `worker/`, `operator/` and `control_plane/` stand on it and never import
each other: what two of them share moves down into `api/`. `local/`, `bench/` and `cli/` compose
them and may import anything.
`monitoring/` (rules, dashboards) and `storage/` (weights by URI) stand on `api/` alone.

Inside `worker/`, the wings stand in one order: `serve/` on `engine/`, the engine on the model side
(`model/`, `quant/`, `lora/`, `embedding/`, `structured/`), all of them on `ops/`, the ground floor.
`model/` is plain PyTorch: it calls ops, never a backend (C, Triton) itself.
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


WORKER = "inferplane.worker"
# A worker room never imports the rooms named here: a higher wing, or a room beside it.
WORKER_FORBIDDEN = {
    "ops": {"llm", "serve", "engine", "model", "quant", "lora", "embedding", "structured"},
    "structured": {"llm", "serve", "engine", "model", "quant", "lora", "embedding"},
    "model": {"llm", "serve", "engine", "quant", "lora", "embedding", "structured"},
    "quant": {"llm", "serve", "engine", "lora", "embedding", "structured"},
    "lora": {"llm", "serve", "engine", "embedding", "structured"},
    "embedding": {"llm", "serve", "engine", "quant", "lora", "structured"},
    "engine": {"llm", "serve"},
    "serve": {"llm"},
}
# The backends an op chooses between: only ops/ (and the int8 kernels' quant/) name them.
BACKENDS = ("inferplane.worker.ops.native", "inferplane.worker.ops.gpu_kernels", "inferplane.worker.ops.gpu_attention")


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


def worker_room(name: str) -> str | None:
    """The worker room a module name falls in (`serve`, `ops`, ..., `llm`), None outside `worker/`."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["inferplane", "worker"] and len(parts) > 2 else None


def test_every_worker_file_is_in_a_wing_or_an_entry_point() -> None:
    loose = sorted(p.name for p in (PACKAGE / "worker").glob("*.py"))
    assert loose == ["__init__.py", "llm.py"]
    rooms = {p.name for p in (PACKAGE / "worker").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(WORKER_FORBIDDEN)


@pytest.mark.parametrize("room", sorted(WORKER_FORBIDDEN))
def test_worker_wings_import_in_one_direction(room: str) -> None:
    offences = []
    for path in sorted((PACKAGE / "worker" / room).rglob("*.py")):
        for name in sorted(module_imports(path)):
            if worker_room(name) in WORKER_FORBIDDEN[room]:
                offences.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert offences == []


def test_model_code_calls_ops_not_backends() -> None:
    offences = []
    for path in sorted((PACKAGE / "worker" / "model").rglob("*.py")):
        source = path.read_text()
        names = module_imports(path)
        # `from inferplane.worker.ops import native` names the package ops: look at the names taken too
        taken = {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for name in sorted(names | taken):
            if name.startswith(BACKENDS):
                offences.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert offences == []
