"""Vocab-parallel embedding and LM head.

Rank r holds vocab rows [r·V/tp, (r+1)·V/tp) (V padded up to a multiple of tp with
zero rows). The embedding zeroes tokens outside its range and all-reduces; the LM head
computes its vocab slice of the logits and all-gathers them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers.linear import linear
from kvrelay.model.parallel import ParallelContext, shard_range
from kvrelay.model.weights import WeightSource, padded_slice


class _VocabShard(nn.Module):
    def __init__(self, vocab: int, hidden: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx, self.vocab = ctx, vocab
        self.start, self.stop, self.local = shard_range(vocab, ctx.tp_size, ctx.tp_rank)
        self.weight = nn.Parameter(torch.zeros(self.local, hidden, dtype=dtype),
                                   requires_grad=False)

    def load(self, src: WeightSource, name: str) -> None:
        self.weight.copy_(padded_slice(src, name, 0, self.start, self.stop, self.local))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(token_ids, self.weight)                      # [tokens, hidden]
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.ctx.comm.all_reduce(out)


class ParallelLMHead(_VocabShard):
    def __init__(self, vocab: int, hidden: int, ctx: ParallelContext, dtype: torch.dtype,
                 plan: ExecutionPlan) -> None:
        super().__init__(vocab, hidden, ctx, dtype)
        self.plan = plan                     # its matmul follows the model's plan (use_plan)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.plan)             # [tokens, V/tp]
        if self.ctx.tp_size == 1:
            return logits
        return self.ctx.comm.all_gather(logits, dim=-1)[:, : self.vocab]
