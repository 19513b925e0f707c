"""Parallel layout of one rank and the collectives the model layers call.

`ParallelContext` says which shard of each layer this rank holds:

    tp_rank / tp_size   attention heads, vocab, expert intermediate dim
    ep_rank / ep_size   which experts (expert parallel)
    moe_tp_rank / size  which rows of each local expert's intermediate dim; by default
                        the TP ranks not used for EP (TP4 with ep_size 2: experts split
                        two ways, each split over two ranks)
    dp_rank / dp_size   which data-parallel replica; with `expert_group` set, experts are
                        sharded over every rank of every replica (EP = TP × DP, the
                        tutorial's decode TP8 DP8 EP64): ep_rank = dp_rank · tp_size + tp_rank

The layers never call torch.distributed directly; they call `ctx.all_reduce` /
`ctx.all_gather`, which are identities at tp_size=1. A multi-process executor passes a
`Collectives` that wraps a process group; unit tests simulate ranks in one process by
building every rank's layer with `NoCollectives` and summing/concatenating by hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # annotations only: EngineConfig validates layouts without torch
    import torch


class Collectives:
    """The communication a sharded model needs. The default does nothing (one rank)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


class NoCollectives(Collectives):
    """Returns each rank's partial result unchanged (single process, or simulated ranks)."""


class ExpertGroup:
    """The expert-parallel group spanning all ranks of all DP replicas (global rank
    g = dp_rank · tp_size + tp_rank), and what the MoE layers need to know per step:
    how many tokens each replica runs (`token_counts`, identical on every rank; a
    replica in a dummy step counts 0). Set by the runner before each forward."""

    size: int = 1
    rank: int = 0

    def __init__(self) -> None:
        self.token_counts: tuple[int, ...] = ()

    def begin_step(self, token_counts: tuple[int, ...]) -> None:
        self.token_counts = tuple(token_counts)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] from every rank → [size · n, ...] in global rank order."""
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[size · n, ...] partial sums → this rank's share [n, ...] of the total."""
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    comm: Collectives = field(default_factory=NoCollectives, compare=False)
    dp_rank: int = 0
    dp_size: int = 1
    expert_group: ExpertGroup | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} outside ep_size {self.ep_size}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} outside dp_size {self.dp_size}")

    @classmethod
    def across_replicas(cls, tp_rank: int, tp_size: int, dp_rank: int, dp_size: int,
                        comm: Collectives, group: ExpertGroup) -> ParallelContext:
        """Experts sharded over all tp_size × dp_size ranks (one expert group)."""
        return cls(tp_rank=tp_rank, tp_size=tp_size, ep_rank=dp_rank * tp_size + tp_rank,
                   ep_size=tp_size * dp_size, comm=comm, dp_rank=dp_rank, dp_size=dp_size,
                   expert_group=group)

    @property
    def moe_tp_size(self) -> int:
        return max(self.tp_size // self.ep_size, 1)

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def is_first(self) -> bool:
        """Rank that adds biases of row-parallel layers (added once, not tp_size times)."""
        return self.tp_rank == 0 and self.ep_rank == 0


def shard_range(total: int, size: int, rank: int, granule: int = 1) -> tuple[int, int, int]:
    """Split `total` items into `size` equal shares of whole granules.

    Returns (start, stop, padded_len): this rank owns items [start, stop) and its share is
    `padded_len` long; the tail beyond `stop - start` is zero padding. With gpt-oss'
    MXFP4 experts (2880 = 90 blocks of 32) at TP4, each rank gets 23 blocks = 736 rows:

        rank 0: [   0,  736)   rank 1: [ 736, 1472)
        rank 2: [1472, 2208)   rank 3: [2208, 2880) + 64 zero rows

    Zero rows (and zero bias) of the gate/up projection give exactly zero activations,
    and zero columns of the down projection add nothing, so padding is exact.
    """
    granules = -(-total // granule)
    per_rank = -(-granules // size) * granule
    start = min(rank * per_rank, total)
    stop = min(start + per_rank, total)
    return start, stop, per_rank


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by the parallel size {size}")
    return total // size


def validate_layout(num_heads: int, num_kv_heads: int, num_experts: int, tp_size: int,
                    ep_size: int, dp_size: int = 1) -> None:
    """Reject layouts the model cannot be sharded into, naming the numbers.

    ep_size == tp_size × dp_size (dp_size > 1) is expert parallelism across replicas;
    otherwise the EP width must divide the TP ranks of one replica."""
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"parallel sizes must be at least 1 (tp={tp_size}, ep={ep_size})")
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the {num_heads} "
                         "attention heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} exceeds the {num_kv_heads} KV heads and "
                         "is not a multiple of them (KV heads are replicated in whole groups)")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the {num_kv_heads} KV "
                         "heads")
    across = dp_size > 1 and ep_size == tp_size * dp_size
    if num_experts % ep_size:
        how = f" (TP {tp_size} × DP {dp_size})" if across else ""
        raise ValueError(f"expert-parallel width {ep_size}{how} does not divide the {num_experts} "
                         "experts")
    if not across and (ep_size > tp_size or tp_size % ep_size):
        raise ValueError(f"expert-parallel width {ep_size} must divide tensor_parallel_size "
                         f"{tp_size}")


def cpu_slices(cores: list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Split the visible CPU cores among ranks: equal contiguous slices; when ranks
    outnumber cores, rank r shares core r % len(cores) (one thread each)."""
    if not cores:
        return ()
    if ranks > len(cores):
        return tuple((cores[r % len(cores)],) for r in range(ranks))
    per = len(cores) // ranks
    return tuple(tuple(cores[r * per:(r + 1) * per]) for r in range(ranks))
