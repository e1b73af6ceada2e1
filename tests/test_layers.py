"""The package's imports point down only (docs/internals/architecture.md), and form no cycle.

Every import counts: top-level, inside functions, under ``TYPE_CHECKING``. A lazy
import hides a dependency from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "faultlab"

#: Lowest first, by folder. A module may import its own layer or a lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("faultlab.base", "faultlab.stores")),
    ("process", ("faultlab.process",)),
    ("nemesis", ("faultlab.nemesis",)),
    ("checks", ("faultlab.checks",)),
    ("format", ("faultlab.trace",)),
    ("systems", ("faultlab.system",)),
    ("run", ("faultlab.run",)),
    ("search", ("faultlab.search",)),
    ("front", ("faultlab.report", "faultlab.corpus", "faultlab.trials", "faultlab.pytest_plugin",
               "faultlab.api", "faultlab.__main__", "faultlab")),
    ("cli", ("faultlab.cli",)),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    for rank, (_, folders) in enumerate(LAYERS):
        if any(name == folder or name.startswith(folder + ".") for folder in folders):
            return rank
    raise AssertionError(f"{name} is in no layer: add its folder to LAYERS and the "
                         "architecture page")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in known:
                    found.add(child)
                elif node.module in known:
                    found.add(node.module)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_import_points_down() -> None:
    upward = [
        f"{source} ({LAYERS[layer(source)][0] if layer(source) < len(LAYERS) else 'front'}) "
        f"imports {target}"
        for source, targets in graph().items()
        for target in sorted(targets)
        if layer(target) > layer(source)
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    """Negative control: an invariant importing the executor is reported."""
    upward = tmp_path / "invariants.py"
    upward.write_text("from faultlab.run.executor import Observation\n", encoding="utf-8")
    targets = imports("faultlab.checks.invariants", upward, set(modules()))
    assert targets == {"faultlab.run.executor"}
    assert layer("faultlab.run.executor") > layer("faultlab.checks.invariants")
