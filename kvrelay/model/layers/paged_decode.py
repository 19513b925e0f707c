"""Paged decode attention that reads the KV blocks in place (one query token per sequence).

    q [S, h, hd], kv_cache [2, num_blocks, kvh, B, hd], block_table [S, max_blocks],
    seq_lens [S] (context after this step), sinks [h] float32, window (0: full)
      → out [S, h, hd]

For each (sequence, KV head) the kernel walks the sequence's visible positions
`[max(0, len - window), len)` block by block through the block table, keeps the g = h / kvh
query heads of that KV head in float32, and runs an online softmax (running max, running
sum, rescaled accumulator) — so no gathered copy of the context is made. The learned sink
joins the softmax denominator at the end: softmax over [scores, sink] with the sink column
dropped, the same as the reference path's `out · sigmoid(lse − sink)`.

The C++ lives with the other native kernels (`kvrelay/model/kernels/csrc/paged_decode*`)
and is built, cached and dispatched to the running CPU's ISA by `kvrelay.model.kernels`;
this module is its Python face. Where the extension cannot be built the caller keeps the
pure-PyTorch reference path (`layers/attention.py`), with the one warning
`kernels.status()` logs. `KVRELAY_ATTENTION_KERNEL=reference` forces the reference path
(the execution plan's `attention`, which `layers/attention.py` reads).
"""
from __future__ import annotations

import functools

import torch

from kvrelay.model import execution_plan


def enabled() -> bool:
    """Whether this process's execution plan runs decodes on the native kernel (not forced
    off, the extension built); the model's layers read their own plan."""
    return execution_plan.current().attention == "native"


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """`kvrelay_kernels::paged_decode` (see the module docstring); needs `enabled()`.
    Eager calls take the op overload directly (the packet's overload resolution costs
    about as much as the kernel on small steps); traced ones go through the packet."""
    if torch.compiler.is_compiling():
        return torch.ops.kvrelay_kernels.paged_decode(
            q, kv_cache, block_table, seq_lens, sinks, scale, window)
    return _ops().paged_decode(q, kv_cache, block_table, seq_lens, sinks, scale, window)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Copies each new token's K and V rows into its slot (one memcpy per KV head)."""
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if torch.compiler.is_compiling():      # a mutating op in the graph, written in place
        torch.ops.kvrelay_kernels.write_kv(kv_cache, k, v, slots)
        return
    _ops().write_kv(kv_cache, k, v, slots)


def rotary_decode(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor,
                  scale: float, window: int) -> torch.Tensor:
    """`kvrelay_kernels::rotary_decode_attention` (csrc/fused_decode_op.cpp): a decode-only
    step's RoPE of the q and k heads (qk [T, h + kvh, hd], cos/sin [max_pos, hd/2] f32), the
    K/V write into `slots` and the paged decode above, in one call → [T, h·hd] in qk's dtype,
    bitwise what `RotaryEmbedding.rotate` + `write_kv` + `decode` give."""
    return _ops().rotary_decode(qk, v, positions, cos, sin, kv_cache, slots, block_table,
                                seq_lens, sinks, scale, window)


class _Ops:
    """The resolved overloads, looked up once."""

    def __init__(self) -> None:
        ns = torch.ops.kvrelay_kernels
        self.paged_decode = ns.paged_decode.default
        self.write_kv = ns.write_kv.default
        self.rotary_decode = ns.rotary_decode_attention.default


@functools.cache
def _ops() -> _Ops:
    return _Ops()
