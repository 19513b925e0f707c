"""Where layers read their weights from: a name → tensor-slice source.

Layers ask for exactly the slice their rank owns (`get(name, dim, start, stop)`), so
a tensor-parallel rank reads only its shard from disk. `DictWeights` serves tests
and in-memory conversions; the loader provides a safetensors-backed source.
"""
from __future__ import annotations

from typing import Protocol

import torch


class WeightSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor: ...


class DictWeights:
    """A WeightSource over a dict of full tensors (tests, conversions)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.read: set[str] = set()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        self.read.add(name)
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, (stop or t.shape[dim]) - start)


def padded_slice(src: WeightSource, name: str, dim: int, start: int, stop: int,
                 length: int) -> torch.Tensor:
    """Rows [start, stop) of `name` along `dim`, zero-padded to `length` (exact padding)."""
    part = src.get(name, dim, start, stop) if stop > start else None
    full_shape = list(src.shape(name))
    full_shape[dim] = length
    if part is not None and part.shape[dim] == length:
        return part
    dtype = part.dtype if part is not None else torch.float32
    out = torch.zeros(full_shape, dtype=dtype)
    if part is not None:
        out.narrow(dim, 0, part.shape[dim]).copy_(part)
    return out
