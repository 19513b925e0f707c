"""Imports point down: no kvrelay module imports another that imports it back (issue 13;
that the light layers load no torch is tests/e2e/test_light_imports.py).

The check reads every `import` in kvrelay/ (function-level ones too: an import moved
into a function to dodge a cycle is still a cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# cycles another helper is removing (issue 13); each entry names its owner
KNOWN_CYCLES: dict[frozenset[str], str] = {
    frozenset({"kvrelay.model.kernels", "kvrelay.model.layers.moe",
               "kvrelay.model.layers.paged_decode"}): "kernels2",
    frozenset({"kvrelay.server.api", "kvrelay.server.responses"}): "hygiene",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kvrelay modules `path` imports anywhere (a `from pkg import name` that names a
    submodule counts as that submodule); not those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def test_no_import_cycles():
    files = {_module_name(p): p for p in (ROOT / "kvrelay").rglob("*.py")}
    graph = {m: _imports(p, set(files)) - {m} for m, p in files.items()}
    for m in graph:          # a package's __init__ is not a dependency of its submodules
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    cycles = [sorted(c) for c in _cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert cycles == []
