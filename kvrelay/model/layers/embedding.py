"""Vocab-parallel embedding and LM head.

Rank r holds vocab rows [r·V/tp, (r+1)·V/tp) (V padded up to a multiple of tp with
zero rows). The embedding zeroes tokens outside its range and all-reduces; the LM head
computes its vocab slice of the logits and all-gathers them.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers.linear import fp32_product, linear, runs_on_dense_kernel
from kvrelay.model.layers.ordered import OrderedProduct
from kvrelay.model.layers.screened import ScreenedHead, exact_mode
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
        self.ordered: OrderedProduct | None = None     # made on the first `logits`
        self.screen: ScreenedHead | None = None        # made on the first screened `greedy`

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.plan)             # [tokens, V/tp]
        if self.ctx.tp_size == 1:
            return logits
        return self.ctx.comm.all_gather(logits, dim=-1)[:, : self.vocab]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [tokens, V]: `self(hidden).float()`, bit for bit; where that is
        torch's fp32 GEMM on one rank, from the ordered kernel once it was seen to give
        the same bits (layers/ordered.py): no per-step upcast of the weight, one pass
        over the output."""
        if self.ctx.tp_size == 1 and fp32_product(hidden, self.weight, self.plan):
            if self.ordered is None:
                self.ordered = OrderedProduct(self.weight)
            logits = self.ordered(hidden, self.plan)
            if logits is not None:
                return logits
        return self(hidden).float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`argmax_rows(self.logits(hidden))` (int64 [tokens]) without the logits, where a
        native kernel computes the logits and can fold their argmax as it makes them: one
        row on the dense kernel (`dense_linear_argmax`), or rows on the ordered kernel
        once checked (layers/ordered.py); None otherwise (the caller takes the logits).
        Where the plan screens the head (`plan.screened_head`), the same ids from its int8
        copy first (layers/screened.py)."""
        if self.ctx.tp_size != 1 or torch.compiler.is_compiling():
            return None
        tokens = self._screened(hidden)
        if tokens is not None:
            return tokens
        if hidden.shape[0] == 1 and runs_on_dense_kernel(hidden, self.weight, self.plan):
            op = _linear_argmax()
            return op(hidden, self.weight, "") if op is not None else None
        if self.ordered is None or not fp32_product(hidden, self.weight, self.plan):
            return None
        return self.ordered.argmax(hidden, self.plan)

    def _screened(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy ids from the screened int8 copy, where the plan screens the head and
        the screen can reproduce the exact path here; None otherwise."""
        if not self.plan.screened_head:
            return None
        mode = exact_mode(hidden, self.weight, self.plan)
        if mode is None:
            return None
        if self.screen is None:
            self.screen = ScreenedHead(self.weight)
        return self.screen.argmax(hidden, mode, self.plan, self.logits)


@functools.cache
def _linear_argmax() -> torch._ops.OpOverload | None:
    ops = torch.ops.kvrelay_kernels
    return ops.dense_linear_argmax.default if hasattr(ops, "dense_linear_argmax") else None
