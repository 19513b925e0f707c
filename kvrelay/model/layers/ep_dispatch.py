"""MoE across data-parallel replicas (EP = TP × DP): gather every replica's tokens,
run this rank's experts, reduce-scatter the results back.

Each replica r has T_r tokens (identical on its tp ranks after attention). Every
step all ranks know every T_r (`ExpertGroup.token_counts`, exchanged once per step
by the engine cores), so all collectives have equal, known sizes:

    P = T_max rounded up to a multiple of tp        c = P / tp rows per rank
    replica r, tp rank j contributes rows [j·c, (j+1)·c) of its zero-padded [P, H]

    all_gather over g = r·tp + j   →  x_all [dp·P, H]    rows r·P + i  (i < T_r real)
    local experts on the real rows →  y_all [dp·P, H]    zero where not routed here
    reduce_scatter (sum)           →  y_mine [c, H]      = this rank's own rows, summed
    all_gather over the replica's tp ranks → [P, H] → first T_r rows

Routing is computed where the rows live (each row once) and travels with them, packed
as [x | weights | expert ids] in float32 (ids < 2^24 are exact), so a single gather
dispatches everything. Padding rows carry expert id -1 and are never computed. A
replica in a dummy step has T_r = 0: it contributes only padding and discards its
output, but takes part in every collective.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kvrelay.model.parallel import ParallelContext

logger = logging.getLogger(__name__)


def moe_across_replicas(router: nn.Module, experts: nn.Module, x: torch.Tensor,
                        ctx: ParallelContext) -> torch.Tensor:
    """x [T, H] (this replica's tokens) → MoE output [T, H]."""
    group = ctx.expert_group
    if group is None:
        raise RuntimeError("expert-parallel step without an expert group")
    counts = group.token_counts
    if len(counts) != ctx.dp_size:
        raise RuntimeError(f"expert-parallel step without the replicas' token counts "
                           f"(got {len(counts)} for {ctx.dp_size} replicas)")
    T, H = x.shape
    tp, j = ctx.tp_size, ctx.tp_rank
    P = -(-max(max(counts), 1) // tp) * tp
    c = P // tp
    real = counts[ctx.dp_rank]                                          # ≤ T (dummy: 0 of 1)
    padded = x.new_zeros(P, H)                                          # [P, H]
    padded[:min(T, P)] = x[:P]
    mine = padded[j * c:(j + 1) * c]                                    # [c, H]
    weights, ids = router(mine)                                         # [c, k] x2
    is_pad = torch.arange(j * c, (j + 1) * c) >= real                   # [c]
    ids = ids.masked_fill(is_pad[:, None], -1)
    k = ids.shape[1]
    packed = torch.cat([mine.float(), weights.float(), ids.float()], dim=1)   # [c, H + 2k]
    gathered = group.all_gather(packed)                                 # [dp·P, H + 2k]
    x_all = gathered[:, :H].to(x.dtype)                                 # [dp·P, H]
    w_all = gathered[:, H:H + k].to(weights.dtype)                      # [dp·P, k]
    ids_all = gathered[:, H + k:].long()                                # [dp·P, k]
    y_all = x.new_zeros(x_all.shape)                                    # [dp·P, H]
    live = (ids_all[:, 0] >= 0).nonzero().flatten()                     # [n] real rows
    if len(live):
        y_all[live] = experts(x_all[live], w_all[live], ids_all[live])
    y_mine = group.reduce_scatter(y_all)                                # [c, H]
    y = ctx.comm.all_gather(y_mine, dim=0) if tp > 1 else y_mine        # [P, H]
    return y[:T]


def report_expert_layout(model: nn.Module, ctx: ParallelContext) -> list[list[int]]:
    """Every rank says which experts it holds and how many bytes of expert weights;
    global rank 0 logs the table (the proof that each rank loaded only its share).
    A collective: every rank of every replica calls it once after loading."""
    group = ctx.expert_group
    if group is None:
        raise RuntimeError("expert layout report without an expert group")
    experts = [layer.mlp.experts for layer in model.layers]  # type: ignore[union-attr]
    mine = torch.tensor([[group.rank, ctx.dp_rank, ctx.tp_rank, experts[0].first_expert,
                          experts[0].num_local, sum(e.nbytes() for e in experts)]],
                        dtype=torch.int64)
    table = group.all_gather(mine).tolist()                  # [size, 6]
    if group.rank == 0:
        for g, r, j, e0, n, nbytes in table:
            logger.info("expert parallel: rank %d (replica %d, tp rank %d) holds experts [%d, %d) "
                        "of each layer, %d bytes of expert weights", g, r, j, e0, e0 + n, nbytes)
    return table
