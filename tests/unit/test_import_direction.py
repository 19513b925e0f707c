"""Imports point down: no kvrelay module imports another that imports it back (issue 13;
that the light layers load no torch is tests/e2e/test_light_imports.py).

The check reads every `import` in kvrelay/ (function-level ones and those under
`if TYPE_CHECKING:` too: an import moved into a function or behind the type checker to
dodge a cycle is still a cycle; the lower module names what it needs as a Protocol)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kvrelay modules `path` imports anywhere (a `from pkg import name` that names a
    submodule counts as that submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _import_graph(package: Path) -> dict[str, set[str]]:
    files = {_module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {m: _imports(p, set(files)) - {m} for m, p in files.items()}
    for m in graph:          # a package's __init__ is not a dependency of its submodules
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    return graph


def test_no_import_cycles():
    assert [sorted(c) for c in _cycles(_import_graph(ROOT / "kvrelay"))] == []


def test_a_cycle_is_found(tmp_path):
    """The check itself: two modules importing each other, one of them only for the type
    checker and inside a function, are reported; a package's __init__ is not."""
    pkg = tmp_path / "kvrelay"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from kvrelay import a\n")
    (pkg / "a.py").write_text("def f():\n    from kvrelay.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from kvrelay import a\n")
    (pkg / "c.py").write_text("import kvrelay.a\n")
    assert [sorted(c) for c in _cycles(_import_graph(pkg))] == [["kvrelay.a", "kvrelay.b"]]
