"""Hints for torch.compile that cost nothing at import.

`torch.compiler.assume_constant_result` imports `torch._dynamo`, about a second of start-up
for every process that imports the model code (engine cores, TP workers, every test
server), though only a `KVRELAY_COMPILE_DECODE` run ever compiles. `constant_result` only
records the function; `apply()` hands each one to torch's decorator right before the first
compile (`ModelRunner.compile_decode`). torch's decorator marks the function object in
place, so the functions the model code already calls are the marked ones.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

_CONSTANTS: list[Callable[..., object]] = []


def constant_result(fn: F) -> F:
    """`fn` (no arguments, a fixed answer per process) is a constant to torch.compile."""
    _CONSTANTS.append(fn)
    return fn


def apply() -> None:
    """Mark every recorded function for torch.compile (before tracing)."""
    import torch

    for fn in _CONSTANTS:
        torch.compiler.assume_constant_result(fn)
