"""Where a `--model` is, found without torch: a local directory, a Hugging Face repo id
in the HF cache layout (`<cache>/models--org--name/snapshots/<rev>/config.json`), or (no
model) the embedded model. Never downloads.

`kvrelay serve` calls it before its heavy imports, so a wrong path is one line within a
second; the loader's `resolve_model_path` is `locate_checkpoint`.
"""
from __future__ import annotations

from pathlib import Path

from kvrelay import envs
from kvrelay.model.config import CheckpointError


def hf_cache_dir(download_dir: str | None = None) -> Path:
    """--download-dir, else $HF_HUB_CACHE, else $HF_HOME/hub (~/.cache/huggingface/hub)."""
    return Path(download_dir or envs.HF_HUB_CACHE.raw()
                or Path(envs.HF_HOME.raw() or "~/.cache/huggingface") / "hub").expanduser()


def locate_checkpoint(model: str, download_dir: str | None = None) -> Path:
    """The checkpoint directory of `model`; CheckpointError (one line) when there is none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    cache = hf_cache_dir(download_dir)
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) \
        if snapshots.is_dir() else []
    if found:
        return found[-1].parent
    if path.exists():
        raise CheckpointError(f"model {model!r} is a file; expected a checkpoint directory "
                              "(with config.json) or a Hugging Face repo id")
    raise CheckpointError(
        f"model {model!r} is not a local directory and was not found in {cache} "
        f"(offline: no download is attempted; pass a checkpoint directory or --download-dir)")


def resolve_model_dir(model: str | None, download_dir: str | None = None) -> Path:
    """The checkpoint directory of --model: `locate_checkpoint`'s, or (no model) the embedded
    model's, built on first use."""
    if model is None:
        from kvrelay.model.embedded import embedded_model_dir
        return embedded_model_dir()
    return locate_checkpoint(model, download_dir)
