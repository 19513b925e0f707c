"""RMSNorm computed in float32, as gpt-oss was trained.

Decode-sized inputs (up to NATIVE_MAX_ROWS rows) take the native kernel
(`kvrelay_kernels::rms_norm`, or `add_rms_norm` with the residual add folded in) where the
execution plan's `dense` names the dense kernels' ISA: one call instead of ~8 small ATen
ops. It computes what `reference` does, up to fp32 summation order.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import ExecutionPlan

# The native norm runs on one thread; from about this many rows torch's parallel ops win.
NATIVE_MAX_ROWS = 64


@functools.cache
def _resolved_ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    ops = torch.ops.kvrelay_kernels
    return ops.rms_norm.default, ops.add_rms_norm.default


def _native_ops(plan: ExecutionPlan | None = None
                ) -> tuple[torch._ops.OpOverload, torch._ops.OpOverload] | None:
    """The native norm ops where `plan` (this process's by default) runs the dense kernels."""
    if (plan or execution_plan.current()).dense is None:
        return None
    return _resolved_ops()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.plan = plan or execution_plan.current()
        # Kept in float32 whatever the model dtype: the scale multiplies fp32 activations.
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()                                                  # [tokens, hidden]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)

    def _ops(self, x: torch.Tensor) -> tuple[torch._ops.OpOverload, ...] | None:
        if (torch.compiler.is_compiling() or x.dim() != 2 or x.shape[0] > NATIVE_MAX_ROWS
                or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"
                or not x.is_contiguous()):
            return None
        return _native_ops(self.plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._ops(x)
        return self.reference(x) if ops is None else ops[0](x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm that follows it,
        in one pass where the native kernel runs."""
        ops = self._ops(x)
        if ops is None or delta.dtype != x.dtype:
            h = x + delta
            return h, self.reference(h)
        return ops[1](x, delta, self.weight, self.eps)
