"""Which KV heads each TP rank holds, and where a decode rank reads its heads from.

A TP rank's KV cache holds a contiguous range of the model's K KV heads (the layout is
`[2, num_blocks, kv_heads_local, block_size, head_dim]`, heads outer within a block):

    tp <= K (K % tp == 0):   rank r holds heads [r·K/tp, (r+1)·K/tp)
    tp >  K (tp % K == 0):   rank r holds the one head r·K // tp (each head on tp/K ranks)

Prefill at TP a, decode at TP b: decode must be a multiple of prefill (b = m·a). Decode
rank d then reads everything from prefill rank p = d // m, whose heads contain d's:

    K=8, a=2, b=4           prefill rank 0: heads 0-3 | prefill rank 1: heads 4-7
                            decode  0: 0-1  1: 2-3    | decode 2: 4-5  3: 6-7
                            decode 1 reads heads [2, 4) of prefill rank 0's blocks

    K=2, a=4, b=8 (replicated)   prefill ranks 0,1 hold head 0; 2,3 head 1
                                 decode ranks 0-3 head 0; 4-7 head 1
                                 decode rank 5 reads prefill rank 2 (head 1, offset 0)

Each decode rank reads one head slice `[src_head_offset, +num_heads)` out of each of the
source rank's blocks: one descriptor per (layer tensor, K/V, block).
"""
from __future__ import annotations

from dataclasses import dataclass


class TPMismatch(ValueError):
    """Prefill and decode TP sizes cannot exchange KV (decode must be a multiple of prefill)."""


@dataclass(frozen=True)
class HeadRange:
    start: int            # first global KV head this rank holds
    count: int            # heads held (contiguous)

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class HeadSlice:
    """What one decode rank reads: heads [src_offset, src_offset + num_heads) of each block
    of prefill rank `src_rank` (whose blocks hold `src_heads` heads) fill its whole block."""
    src_rank: int
    src_offset: int
    num_heads: int
    src_heads: int


def rank_heads(tp_size: int, num_kv_heads: int, rank: int) -> HeadRange:
    """The KV heads rank `rank` of a TP group holds (the model's sharding rule)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tensor_parallel_size {tp_size}")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of the "
                             f"{num_kv_heads} KV heads")
        return HeadRange(rank * num_kv_heads // tp_size, 1)
    if num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the {num_kv_heads} KV "
                         "heads")
    per = num_kv_heads // tp_size
    return HeadRange(rank * per, per)


def tp_mismatch(prefill_tp: int, decode_tp: int) -> str | None:
    """Why these TP sizes cannot pair (phrased the same on both sides), or None."""
    if prefill_tp < 1 or decode_tp < 1:
        return f"tensor_parallel_size must be positive (prefill {prefill_tp}, decode {decode_tp})"
    if decode_tp % prefill_tp:
        return (f"tensor_parallel_size: prefill {prefill_tp}, decode {decode_tp}: the decode TP "
                "size must be a multiple of the prefill TP size (each decode rank reads its KV "
                "heads from one prefill rank)")
    return None


def head_slice(prefill_tp: int, decode_tp: int, num_kv_heads: int, decode_rank: int) -> HeadSlice:
    """Where decode rank `decode_rank` reads its heads (see the module docstring)."""
    problem = tp_mismatch(prefill_tp, decode_tp)
    if problem:
        raise TPMismatch(problem)
    src_rank = decode_rank // (decode_tp // prefill_tp)
    mine = rank_heads(decode_tp, num_kv_heads, decode_rank)
    theirs = rank_heads(prefill_tp, num_kv_heads, src_rank)
    # guaranteed by the rule above
    if not (theirs.start <= mine.start and mine.stop <= theirs.stop):
        raise AssertionError(f"decode rank {decode_rank} heads {mine} not held by prefill rank "
                             f"{src_rank} {theirs}")
    return HeadSlice(src_rank, mine.start - theirs.start, mine.count, theirs.count)
