"""RMSNorm computed in float32, as gpt-oss was trained."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        # Kept in float32 whatever the model dtype: the scale multiplies fp32 activations.
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()                                                  # [tokens, hidden]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
