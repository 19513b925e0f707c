"""Every environment variable that configures kvrelay is read through `kvrelay/envs.py`.

The source is parsed (no imports): a read of `os.environ` / `os.getenv` anywhere else fails,
except in the few modules that give *another library's* variable a default when the user
has not set it, or hand the environment on to child processes (listed below with why).
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).parent

# module -> why it may touch os.environ itself
LIBRARY_DEFAULTS = {
    "cli.py": "OMP_WAIT_POLICY / GOMP_SPINCOUNT for OpenMP",
    "disagg/nixl.py": "UCX_* and NIXL_LOG_LEVEL for NIXL/UCX",
    "model/kernels/__init__.py": "PATH while ninja builds the kernels",
    "model/kernels/build.py": "MAX_JOBS and PATH for the background compiler (cpp_extension)",
    "model/o200k.py": "TIKTOKEN_ENCODINGS_BASE for openai-harmony",
    "deploy/launcher.py": "copies the environment for the processes it starts",
    "distributed/ray_cluster.py": "copies kvrelay's variables into a Ray actor's runtime_env",
    "deploy/ray_actors.py": "a server actor hands its environment to the server it starts",
    "envs.py": "the one reader",
}


def _environ_reads(tree: ast.AST) -> list[int]:
    """Line numbers of `os.environ` (any use) and `os.getenv(...)`."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in ("environ", "getenv")):
            lines.append(node.lineno)
    return lines


def test_environment_is_read_through_envs_only():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        reads = _environ_reads(tree)
        if reads and rel not in LIBRARY_DEFAULTS:
            offenders.append(f"{rel}: os.environ/os.getenv at lines {reads}")
    assert offenders == []


def test_the_exemptions_are_still_needed():
    """An exempt module that no longer touches os.environ leaves the list."""
    unused = [rel for rel in LIBRARY_DEFAULTS
              if not _environ_reads(ast.parse((ROOT / rel).read_text()))]
    assert unused == []
