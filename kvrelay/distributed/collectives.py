"""`Collectives` over a torch.distributed process group (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kvrelay.model.parallel import Collectives


class TorchDistCollectives(Collectives):
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # reduce in float32: exact enough for token-identical TP, and gloo-friendly
        buf = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(buf, group=self.group)
        return buf.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)
