"""KVRELAY_MOE_KERNEL: which expert implementation the MoE layers take (auto | native |
torch). Its own module so that layers/moe.py and layers/moe_tiles.py both read it without
importing each other."""
from __future__ import annotations

from kvrelay import envs
from kvrelay.model import compile_hints

MOE_KERNEL_MODES = ("auto", "native", "torch")


@compile_hints.constant_result      # a constant to torch.compile's tracing
def moe_kernel_mode() -> str:
    mode = envs.MOE_KERNEL.raw() or "auto"
    if mode not in MOE_KERNEL_MODES:
        raise ValueError(f"{envs.MOE_KERNEL.shown}: expected auto, native or torch, got {mode!r}")
    return mode
