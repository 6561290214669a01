"""The package's layout rules: no import cycle, imports at the top of each module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gateway"
# Imported where they are used because they may be missing: uvloop is optional per platform.
# The embeddings extra (gateway/embed.py) is imported only when memory.retrieval.embeddings is on.
OPTIONAL = {"uvloop", "numpy", "onnxruntime", "onnxruntime.quantization", "tokenizers"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & known


def test_no_import_cycle() -> None:
    """No gateway module imports, directly or through others, a module that imports it."""
    modules = _modules()
    graph = {name: _imports(tree, set(modules)) - {name} for name, tree in modules.items()}
    graph = {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_imports_are_at_module_top() -> None:
    """Imports inside functions are only those of optional dependencies."""
    inner = []
    for name, tree in _modules().items():
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    names = {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    names = {node.module or ""}
                else:
                    continue
                if names - OPTIONAL:
                    inner.append(f"{name}:{node.lineno} {sorted(names)}")
    assert inner == []
