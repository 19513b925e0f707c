"""The experts of a bf16 model at many token rows per expert, as AVX512-BF16 tiles.

Offline decode batches (64 sequences, top-2 of 8 experts: 16 rows per expert) and
prefill steps (hundreds of rows per expert) are compute-bound. The generic native kernel
(`kernels.moe_experts`) widens bf16 weights to fp32 and runs fp32 FMAs; the torch path
loops over experts in Python and runs a dozen elementwise bf16 ops per expert around its
GEMMs. `kvrelay_kernels::moe_tiles` (csrc/moe_tile*.cpp) multiplies bf16 pairs with
`vdpbf16ps` — the products are exact in fp32, only the summation order changes — and
fuses bias, swiglu, routing weight and the k-way sum. Its one rounding the fp32 kernel
does not have is the swiglu output's, to bf16 before the down projection, which the bf16
torch path (the reference) rounds too. MXFP4 weights are decoded to bf16 exactly (e2m1 ×
2^k is a bf16 value) one block of rows at a time.

`Experts.forward` / `Experts.decode` ask `wants` first (a small dispatch hook in
`layers/moe.py`); the fp32 model, other CPUs, `KVRELAY_MOE_KERNEL=native|torch` and few
rows per expert keep their paths.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from kvrelay.model import kernels
from kvrelay.model.mxfp4 import MXFP4Tensor

if TYPE_CHECKING:
    from kvrelay.model.layers.moe import Experts

# Token rows per expert (choices / local experts) from which the tiles take over. An
# expert's rows are padded to 16 (one vector of token rows), so below that the tiles cost
# as much as 16 rows. Measured (one thread, CPU time per layer call, AVX512-BF16 Zen 4 VM;
# tiles / the path taken before): tiny config (hidden = intermediate = 128, 8 experts,
# top-2) bf16 at 1 / 2 / 4 / 6 / 8 / 12 rows per expert 42/26, 57/40, 60/59, 60/82,
# 61/108, 63/155 us, MXFP4 49/23, 65/38, 67/63, 68/89, 69/114, 72/168 us; 1024 rows
# 974/3313 (bf16, native kernel); the embedded model's shape (576/1536, 2 experts, top-1)
# at 2 / 4 / 8 / 16 rows 546/273, 571/486, 606/1123, 787/1497 us (torch GEMMs).
TILE_MIN_ROWS = 6


@functools.cache
def available() -> bool:
    """Whether the extension is built and this CPU has AVX512-BF16."""
    if not kernels.kernels_available():
        return False
    return bool(torch.ops.kvrelay_kernels.moe_tile_isas())


def wants(ex: Experts, x: torch.Tensor, choices: int) -> bool:
    """Whether `ex` runs this call of `choices` (token, expert) pairs on the tiles."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    packed = isinstance(ex.gate_up, MXFP4Tensor)
    if not packed and ex.gate_up.dtype != torch.bfloat16:
        return False
    rows = choices / (ex.num_local * ex.ctx.ep_size)
    if rows < TILE_MIN_ROWS:
        return False
    from kvrelay.model.layers.moe import moe_kernel_mode
    return moe_kernel_mode() == "auto" and ex.hidden % 2 == 0 and ex.i_local % 2 == 0 \
        and available()


def forward(ex: Experts, x: torch.Tensor, weights: torch.Tensor,
            expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16, weights/expert_ids [T, k] → this rank's partial output [T, H] bf16."""
    gate_up, down = _weights(ex.gate_up), _weights(ex.down)
    return torch.ops.kvrelay_kernels.moe_tiles(
        x.contiguous(), weights.float().contiguous(), expert_ids.long().contiguous(),
        ex.first_expert, gate_up[0], gate_up[1], ex._f32("gate_up_bias"), down[0], down[1],
        ex._f32("down_bias") if ex.add_down_bias else None, ex.alpha, ex.limit)


def _weights(w: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(w, MXFP4Tensor):
        return w.blocks.contiguous(), w.scales.contiguous()
    return w.detach().contiguous(), None
