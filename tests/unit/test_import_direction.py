"""Imports point down: the light layers load neither torch nor a KV transport, and no
kvrelay module imports another that imports it back (issue 13).

The API process, the proxy and the scheduler's bookkeeping must start without the model
stack: each module is imported in a fresh interpreter, and what it pulled in is read
from `sys.modules`. The cycle check reads every `import` in kvrelay/ (function-level
ones too: an import moved into a function to dodge a cycle is still a cycle)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "nixl", "kvrelay.disagg.transport", "kvrelay.disagg.tcp",
         "kvrelay.disagg.nixl", "kvrelay.disagg.side_channel", "kvrelay.disagg.connector",
         "kvrelay.engine.core", "kvrelay.model.gpt_oss")
LIGHT = ["kvrelay.engine.scheduler", "kvrelay.kv_cache.manager", "kvrelay.proxy.app",
         "kvrelay.proxy.main", "kvrelay.server.api", "kvrelay.engine.messages",
         "kvrelay.framing", "kvrelay.disagg.params"]

# cycles another helper is removing (issue 13); each entry names its owner
KNOWN_CYCLES: dict[frozenset[str], str] = {
    frozenset({"kvrelay.model.kernels", "kvrelay.model.layers.moe",
               "kvrelay.model.layers.paged_decode"}): "kernels2",
    frozenset({"kvrelay.server.api", "kvrelay.server.responses"}): "hygiene",
}


@pytest.mark.parametrize("module", LIGHT)
def test_light_modules_load_no_torch_and_no_transport(module):
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"{module} loads them"


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
