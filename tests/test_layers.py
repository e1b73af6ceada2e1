"""The package's imports point down only (docs/architecture.md), and form no cycle.

Every import counts: top-level, inside functions, under ``TYPE_CHECKING``. A lazy
import hides a dependency from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "faultlab"

#: Lowest first. A module may import its own layer or a lower one.
LAYERS: list[tuple[str, set[str]]] = [
    ("ground", {"faultlab", "faultlab.errors", "faultlab.canonical", "faultlab.stores",
                "faultlab.records", "faultlab.defaults", "faultlab.messages", "faultlab.clock",
                "faultlab.pgstores", "faultlab.interrupt", "faultlab.inputs", "faultlab.output",
                "faultlab.wall_clock"}),
    ("process", {"faultlab.process", "faultlab.affinity"}),
    ("nemesis", {"faultlab.nemesis", "faultlab.nemesis.crash", "faultlab.nemesis.announce",
                 "faultlab.nemesis.schedule", "faultlab.pgcrash"}),
    ("checks", {"faultlab.invariants", "faultlab.history"}),
    ("format", {"faultlab.trace", "faultlab.concurrent_trace"}),
    ("systems", {"faultlab.system", "faultlab.system.contract", "faultlab.system.reference",
                 "faultlab.system.mutants", "faultlab.system.description",
                 "faultlab.system.command", "faultlab.system.fields", "faultlab.worker",
                 "faultlab.system.concurrency_mutants", "faultlab.system.reference_pg",
                 "faultlab.system.command_pg"}),
    ("run", {"faultlab.executor", "faultlab.lanes"}),
    ("search", {"faultlab.machine", "faultlab.explore", "faultlab.shrink",
                "faultlab.enumeration", "faultlab.coverage", "faultlab.data",
                "faultlab.simplify", "faultlab.search", "faultlab.streams",
                "faultlab.concurrent_explore", "faultlab.concurrent_enumeration"}),
    ("front", {"faultlab.scenarios", "faultlab.zoo", "faultlab.corpus", "faultlab.report",
               "faultlab.redis_corpus", "faultlab.__main__", "faultlab.html_report",
               "faultlab.pytest_plugin", "faultlab.lane_report", "faultlab.replaying",
               "faultlab.concurrent_zoo"}),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    if name == "faultlab.cli" or name.startswith("faultlab.cli."):
        return len(LAYERS) - 1
    for rank, (_, members) in enumerate(LAYERS):
        if name in members:
            return rank
    raise AssertionError(f"{name} is in no layer: add it to LAYERS and docs/architecture.md")


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
    upward.write_text("from faultlab.executor import Observation\n", encoding="utf-8")
    targets = imports("faultlab.invariants", upward, set(modules()))
    assert targets == {"faultlab.executor"}
    assert layer("faultlab.executor") > layer("faultlab.invariants")
