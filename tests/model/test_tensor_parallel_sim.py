"""Sharding maths, proved by simulating ranks in one process.

Each rank's model is built from the same checkpoint with its `ParallelContext`;
collectives are done by threads meeting at a barrier. The sharded model's logits
must equal the unsharded model's.
"""
from __future__ import annotations

import threading

import pytest
import torch

from kvrelay.model.generate import PagedGreedyLoop, _Seq
from kvrelay.model.loader import load_model
from kvrelay.model.parallel import Collectives, ParallelContext, shard_range
from tests.factories import make_hf_model, save_checkpoint


class ThreadCollectives(Collectives):
    """All-reduce / all-gather between `size` threads of one process."""

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self.rank, self.size = shared, rank, size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self.rank] = x
        self.shared["barrier"].wait()
        parts = list(self.shared["slots"])
        self.shared["barrier"].wait()           # nobody overwrites a slot before all read
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x)).sum(0)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)


def run_sharded(path, prompt: list[int], tp: int, ep: int = 1) -> torch.Tensor:
    shared = {"slots": [None] * tp, "barrier": threading.Barrier(tp)}
    results: list[torch.Tensor | None] = [None] * tp
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            ctx = ParallelContext(tp_rank=rank, tp_size=tp, ep_rank=rank * ep // tp, ep_size=ep,
                                  comm=ThreadCollectives(shared, rank, tp))
            model = load_model(path, dtype=torch.float32, ctx=ctx, progress=False).model
            loop = PagedGreedyLoop(model, 32, 4, shuffle_blocks=True)
            seq = _Seq(prompt)
            first = loop.step([seq], [len(prompt) - 3])
            rest = [loop.step([seq], [1]) for _ in range(3)]
            results[rank] = torch.cat([first, *rest])
        except BaseException as e:  # surface thread failures in the test
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    for r in range(1, tp):
        assert torch.equal(results[0], results[r]), "ranks disagree after all-gather"
    return results[0]


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def checkpoint(request, tmp_path_factory):
    # vocab 162 does not divide by 4 (padded vocab shards); intermediate 96 = 3 MXFP4
    # blocks, which TP2 and TP4 split with zero padding
    hf = make_hf_model(seed=7, vocab_size=162, num_attention_heads=8, num_key_value_heads=2)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param),
                           mxfp4_experts=request.param == "mxfp4")
    return path


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (4, 2), (2, 2), (4, 4)])
def test_sharded_logits_equal_unsharded(checkpoint, tp, ep):
    prompt = torch.randint(0, 162, (20,),
                           generator=torch.Generator().manual_seed(tp * 10 + ep)).tolist()
    full = run_sharded(checkpoint, prompt, tp=1)
    sharded = run_sharded(checkpoint, prompt, tp=tp, ep=ep)
    assert (sharded - full).abs().max().item() < 1e-4


def test_kv_heads_replicated_when_tp_exceeds_them(checkpoint):
    # TP4 over 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1
    heads = [load_model(checkpoint, dtype=torch.float32, progress=False,
                        ctx=ParallelContext(tp_rank=r, tp_size=4)).model.layers[0].self_attn.qkv
             for r in range(4)]
    assert [h.kv_head_start for h in heads] == [0, 0, 1, 1]
    assert all(h.num_kv_heads == 1 and h.num_heads == 2 for h in heads)


def test_shard_range_pads_mxfp4_blocks_exactly():
    # gpt-oss: 2880 = 90 blocks of 32; TP4 → 23 blocks per rank, the last padded
    shares = [shard_range(2880, 4, r, 32) for r in range(4)]
    assert shares == [(0, 736, 736), (736, 1472, 736), (1472, 2208, 736), (2208, 2880, 736)]
    shares = [shard_range(2880, 8, r, 32) for r in range(8)]
    assert sum(stop - start for start, stop, _ in shares) == 2880
    assert all(length == 12 * 32 for _, _, length in shares)
    assert shares[-1] == (2688, 2880, 384)


def test_indivisible_heads_are_rejected(checkpoint):
    with pytest.raises(ValueError,
                       match="num_attention_heads=8 is not divisible by the parallel size 3"):
        load_model(checkpoint, ctx=ParallelContext(tp_rank=0, tp_size=3), progress=False)
