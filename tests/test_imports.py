"""The import graph of moeprep and moerun, read from the sources (nothing is imported): no module imports its own
importer, directly or around a loop, counting imports inside functions (a cycle they hold together is a cycle) and
leaving out those under `if TYPE_CHECKING:` (annotations only); and moerun's layers point one way: kernels below
layers, layers below the backend, the models and the expert cache, those below graphs, the model and the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"moeprep": ROOT / "moeprep", "moerun": ROOT / "runtime"}

# What the modules of each part of moerun may not import (prefixes of module names).
ABOVE_KERNELS = (
    "moerun.layers",
    "moerun.backend",
    "moerun.models",
    "moerun.cache",
    "moerun.capture",
    "moerun.graphs",
    "moerun.model",
    "moerun.generation",
    "moerun.serve",
    "moerun.cli",
    "moerun.bench",
    "moerun.perplexity",
)
FORBIDDEN = {
    "moerun.kernels": ABOVE_KERNELS,
    "moerun.layers": ABOVE_KERNELS[1:],
    "moerun.cache": (
        "moerun.models",
        "moerun.capture",
        "moerun.graphs",
        "moerun.model",
        "moerun.generation",
        "moerun.serve",
        "moerun.cli",
        "moerun.bench",
    ),
    "moerun.capture": ("moerun.",),
    "moerun.backend": ABOVE_KERNELS[2:],
    "moerun.models": ("moerun.graphs", "moerun.model", "moerun.generation", "moerun.serve", "moerun.cli"),
}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import name` that names a submodule counts as that
    submodule)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif node.module in modules:
                    found.add(node.module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), and self-imports."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_project(graph):
    assert "moerun.kernels.cpu.moe_rows" in graph and "moeprep.quant.quantize" in graph
    assert "moerun.layers.linear" in graph["moerun.backend"]


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_runtime_imports_point_down(graph, part):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == part or module.startswith(part + ".")
        for target in targets
        if target.startswith(FORBIDDEN[part]) and not target.startswith(part)
    )
    assert wrong == []
