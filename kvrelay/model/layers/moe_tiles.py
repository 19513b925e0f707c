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

`Experts.forward` / `Experts.decode` ask `wants` first (a small dispatch hook in
`layers/moe.py`); the fp32 model, other CPUs, `KVRELAY_MOE_KERNEL=native|torch` and few
rows per expert keep their paths (the execution plan's `moe_tiles`). So do bf16 experts
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

from typing import TYPE_CHECKING, Protocol

import torch

from kvrelay.model.mxfp4 import MXFP4Tensor

if TYPE_CHECKING:
    from kvrelay.model.execution_plan import ExecutionPlan
    from kvrelay.model.parallel import ParallelContext


class TileExperts(Protocol):
    """What the tiles read of `moe.Experts`, named here because moe.py imports this
    module: the import points one way."""

    @property
    def ctx(self) -> ParallelContext: ...
    @property
    def plan(self) -> ExecutionPlan: ...
    @property
    def gate_up(self) -> torch.Tensor | MXFP4Tensor: ...
    @property
    def down(self) -> torch.Tensor | MXFP4Tensor: ...
    @property
    def hidden(self) -> int: ...
    @property
    def i_local(self) -> int: ...
    @property
    def num_local(self) -> int: ...
    @property
    def first_expert(self) -> int: ...
    @property
    def add_down_bias(self) -> bool: ...
    @property
    def alpha(self) -> float: ...
    @property
    def limit(self) -> float: ...

    def _kernel_weight(
            self, w: torch.Tensor | MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def _f32(self, name: str) -> torch.Tensor: ...

# Token rows per expert (choices / local experts) from which the tiles take over. An
# expert's rows are padded to 16 (one vector of token rows), so below that the tiles cost
# as much as 16 rows. Measured (one thread, CPU time per layer call, AVX512-BF16 Zen 4 VM
# under load; tiles / the path taken before): tiny config (hidden = intermediate = 128, 8
# experts, top-2) at 6 / 8 / 10 / 12 / 16 / 256 / 1024 rows per expert, bf16 107/89,
# 105/112, 117/136, 121/165, 142/272, 1572/3373, 8658/17365 us, MXFP4 114/97, 114/118,
# 127/150, 137/200, 147/226, 1565/3847, 6867/15359 us; the embedded model's shape
# (576/1536, 2 experts, top-1) at 4 / 8 / 16 rows 1243/390, 1015/986, 1377/1551 us.
TILE_MIN_ROWS = 10


def wants(ex: TileExperts, x: torch.Tensor, choices: int) -> bool:
    """Whether `ex` runs this call of `choices` (token, expert) pairs on the tiles."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    w = ex.gate_up
    if not isinstance(w, MXFP4Tensor) and w.dtype != torch.bfloat16:
        return False
    rows = choices / (ex.num_local * ex.ctx.ep_size)
    if rows < TILE_MIN_ROWS:
        return False
    plan = ex.plan
    if not isinstance(w, MXFP4Tensor) and plan.half_in_fp32 and rows >= plan.upcast_min_rows:
        return False            # bf16 weights: torch's fp32 GEMMs, from where they pay
    return plan.moe_tiles and ex.hidden % 2 == 0 and ex.i_local % 2 == 0


def forward(ex: TileExperts, x: torch.Tensor, weights: torch.Tensor,
            expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16, weights/expert_ids [T, k] → this rank's partial output [T, H] bf16."""
    gate_up, down = ex._kernel_weight(ex.gate_up), ex._kernel_weight(ex.down)
    return torch.ops.kvrelay_kernels.moe_tiles(
        x.contiguous(), weights.float().contiguous(), expert_ids.long().contiguous(),
        ex.first_expert, gate_up[0], gate_up[1], ex._f32("gate_up_bias"), down[0], down[1],
        ex._f32("down_bias") if ex.add_down_bias else None, ex.alpha, ex.limit)

