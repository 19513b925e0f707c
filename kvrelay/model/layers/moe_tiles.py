"""The experts of a bf16 model at many token rows per expert, as AVX512-BF16 tiles.

Offline decode batches (64 sequences, top-2 of 8 experts: 16 rows per expert) and
prefill steps (hundreds of rows per expert) are compute-bound. The generic native kernel
(`kernels.moe_experts`) widens bf16 weights to fp32 and runs fp32 FMAs; the torch path
loops over experts in Python and runs a dozen elementwise bf16 ops per expert around its
GEMMs. `kvrelay_kernels::moe_tiles` (csrc/moe_tile*.cpp) multiplies bf16 pairs with
`vdpbf16ps` — the products are exact in fp32, only the summation order changes — and
fuses bias, swiglu, routing weight and the k-way sum. The f32 swiglu output enters the
down projection as three bf16 parts that sum to it exactly (hi, the f32 remainder's
rounding, the rest), so those products are exact too: the results are the fp32 kernel's
up to the summation order. MXFP4 weights are decoded to bf16 exactly (e2m1 × 2^k is a
bf16 value) one block of rows at a time.

`ExpertPaths.choose` (layers/moe.py, the experts' one rule) sends calls here; the fp32
model, other CPUs, `KVRELAY_MOE_KERNEL=native|torch` and few rows per expert
(`moe.TILE_MIN_ROWS`) keep their paths (the execution plan's `moe_tiles`). So do bf16 experts
where the plan computes half matmuls in fp32 (CPUs whose bf16 arithmetic is slower than
their fp32), from the rows per expert at which `linear` upcasts (the plan's
`upcast_min_rows`): the tiles are that
bf16 arithmetic, and below those rows torch's GEMMs would run in bf16 too. On such a
CPU (an AVX512-BF16 Xeon without AMX) the embedded model's 200-token prefill spent
455-549 ms in the tiles, 350 in the fp32 streaming kernel and 238-282 in torch's fp32
GEMMs on upcast weights, the path its experts then take. MXFP4 experts keep the tiles
there: their other paths decode the weights first, and the tiny model's offline generate
measured 3.5-4.8k tok/s without the tiles against 4.4-5.0k with them.
"""
from __future__ import annotations

from typing import Any

import torch


def forward(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
            op_args: tuple[Any, ...]) -> torch.Tensor:
    """x [T, H] bf16, weights/expert_ids [T, k] → this rank's partial output [T, H] bf16.
    `op_args`: the experts' weights and fp32 biases in the native ops' order
    (`ExpertPaths.op_args`; the tiles take no ISA name, its last item)."""
    return torch.ops.kvrelay_kernels.moe_tiles(
        x.contiguous(), weights.float().contiguous(), expert_ids.long().contiguous(),
        *op_args[:-1])
