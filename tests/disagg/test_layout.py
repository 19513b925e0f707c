"""Head-slice mapping between prefill TP a and decode TP b (kvrelay/disagg/layout.py), and
per-rank reads that assemble each decode rank's shard from the prefill ranks' shards."""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from kvrelay.disagg.capability import notify_message, parse_notify
from kvrelay.disagg.handshake import pairing_hash
from kvrelay.disagg.layout import (
    HeadRange,
    HeadSlice,
    TPMismatch,
    head_slice,
    rank_heads,
    tp_mismatch,
)
from kvrelay.disagg.params import KVTransferConfig
from kvrelay.disagg.worker import (
    GroupPull,
    KVWork,
    KVWorker,
    KVWorkerSetup,
    PeerInfo,
    PullOrder,
    ReadGrant,
)

KV_HEADS = (1, 2, 3, 4, 8)
SIZES = (1, 2, 3, 4, 6, 8, 16)


def valid_tp(tp: int, k: int) -> bool:
    """The model's layout rule (kvrelay/model/parallel.validate_layout, KV part)."""
    return k % tp == 0 if tp <= k else tp % k == 0


def holds(tp: int, k: int, rank: int) -> set[int]:
    """Brute force: the heads rank `rank` holds (QKVParallelLinear's rule)."""
    if tp >= k:
        return {rank * k // tp}
    return set(range(rank * k // tp, (rank + 1) * k // tp))


def test_rank_heads_follow_the_model_sharding():
    for k in KV_HEADS:
        for tp in SIZES:
            if not valid_tp(tp, k):
                with pytest.raises(ValueError, match=f"tensor_parallel_size {tp}"):
                    rank_heads(tp, k, 0)
                continue
            seen = set()
            for r in range(tp):
                h = rank_heads(tp, k, r)
                assert set(range(h.start, h.stop)) == holds(tp, k, r)
                seen |= holds(tp, k, r)
            assert seen == set(range(k))                        # every head lives somewhere


@pytest.mark.parametrize("k", KV_HEADS)
def test_head_slice_every_combination(k):
    for a, b in itertools.product(SIZES, SIZES):
        if not (valid_tp(a, k) and valid_tp(b, k)):
            continue
        if b % a:
            with pytest.raises(TPMismatch, match=f"prefill {a}, decode {b}"):
                head_slice(a, b, k, 0)
            continue
        used = set()
        for d in range(b):
            s = head_slice(a, b, k, d)
            src = rank_heads(a, k, s.src_rank)
            assert s.src_heads == src.count
            assert s.src_offset >= 0 and s.src_offset + s.num_heads <= s.src_heads
            # the global heads read are exactly the ones decode rank d holds
            read = set(range(src.start + s.src_offset, src.start + s.src_offset + s.num_heads))
            assert read == holds(b, k, d), (a, b, k, d)
            used.add(s.src_rank)
        assert used == set(range(a))  # the load spreads over every prefill rank


def test_head_slice_examples():
    # K=8, prefill TP2 (4 heads each), decode TP4 (2 each): decode 1 reads heads 2-3 of prefill 0
    assert head_slice(2, 4, 8, 1) == HeadSlice(src_rank=0, src_offset=2, num_heads=2, src_heads=4)
    assert head_slice(2, 4, 8, 2) == HeadSlice(src_rank=1, src_offset=0, num_heads=2, src_heads=4)
    # K=2, prefill TP1 (both heads), decode TP2: decode 1 reads head 1
    assert head_slice(1, 2, 2, 1) == HeadSlice(0, 1, 1, 2)
    # K=2 replicated on both sides: prefill TP4 (ranks 0,1 head 0; 2,3 head 1), decode TP8
    assert head_slice(4, 8, 2, 5) == HeadSlice(src_rank=2, src_offset=0, num_heads=1, src_heads=1)
    # K=2, prefill TP1, decode TP4 (replicated): ranks 2 and 3 both read head 1
    assert [head_slice(1, 4, 2, d).src_offset for d in range(4)] == [0, 0, 1, 1]
    # the tutorial: gpt-oss (8 KV heads), prefill TP4, decode TP8: one head each
    assert [head_slice(4, 8, 8, d) for d in (0, 7)] == [HeadSlice(0, 0, 1, 2),
                                                        HeadSlice(3, 1, 1, 2)]
    assert rank_heads(8, 8, 7) == HeadRange(7, 1)


def test_tp_mismatch_names_the_sizes():
    assert tp_mismatch(2, 2) is None and tp_mismatch(1, 8) is None and tp_mismatch(4, 8) is None
    assert "prefill 2, decode 1" in tp_mismatch(2, 1)
    assert "prefill 4, decode 6" in tp_mismatch(4, 6)
    assert "multiple of the prefill TP size" in tp_mismatch(8, 4)


def test_notify_counts_and_pairing_hash():
    assert parse_notify(notify_message("cmpl-abc-0", 4, "cap-x_Y")) == ("cmpl-abc-0", 4, "cap-x_Y")
    assert parse_notify(b"cmpl-abc-0") is None                  # no count, no capability: ignored
    assert parse_notify(b"cmpl-abc-0:2") is None
    assert parse_notify(b"id:with:colons:2:cap") == ("id:with:colons", 2, "cap")
    spec = {"block_size": 4, "num_kv_heads": 2}
    assert pairing_hash(spec, 1, 2) == pairing_hash(dict(spec), 1, 2)
    assert pairing_hash(spec, 1, 2) != pairing_hash(spec, 2, 2)


# ---------------------------------------------------------------------------------------
# real reads (TCP transport, in one process): each decode rank's shard = its heads


NUM_BLOCKS, B, HD, LAYERS = 6, 4, 8, 3


def shard(full: torch.Tensor, tp: int, k: int, rank: int) -> torch.Tensor:
    h = rank_heads(tp, k, rank)
    return full[:, :, h.start:h.stop].contiguous()                        # [2, nb, heads, B, hd]


def tcp_setup(role: str, engine_id: str, k: int, tp: int) -> KVWorkerSetup:
    cfg = KVTransferConfig(kv_connector="TcpConnector", kv_role=role, backends=("TCP",))
    return KVWorkerSetup(cfg, engine_id, k, tp)


@pytest.mark.parametrize("a,b,k", [(1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 2), (2, 4, 2), (2, 4, 4),
                                   (4, 4, 2), (1, 2, 1)])
def test_rank_reads_assemble_the_decode_shards(a, b, k):
    torch.manual_seed(a * 100 + b * 10 + k)
    # the prefill's KV (all heads)
    full = [torch.randn(2, NUM_BLOCKS, k, B, HD) for _ in range(LAYERS)]
    prefill = [KVWorker(tcp_setup("kv_producer", "P", k, a), r, [shard(t, a, k, r) for t in full])
               for r in range(a)]
    local = [[torch.zeros(2, NUM_BLOCKS + 2, max(k // b, 1), B, HD) for _ in range(LAYERS)]
             for _ in range(b)]
    decode = [KVWorker(tcp_setup("kv_consumer", "D", k, b), d, local[d]) for d in range(b)]
    try:
        peer = PeerInfo("P", a, NUM_BLOCKS, tuple(w.metadata() for w in prefill))
        # group 0 (3 layers): remote 1,2,5 → local 7,3,4; group 1 (2 layers): remote 4 → local 1
        groups = (GroupPull(3, (1, 2, 5), (7, 3, 4)), GroupPull(2, (4,), (1,)))
        order = PullOrder("req", "P", notify_message("remote-req", b, "cap"), groups)
        for w in prefill:                  # what the prefill engine issued for that request
            w.apply(KVWork(grants=[ReadGrant("remote-req", "cap", frozenset({1, 2, 4, 5}))]))
        for w in decode:
            assert w.apply(KVWork(peers=[peer], pulls=[order])) == []
        events = []
        for _ in range(2000):
            events += [e for w in decode for e in w.poll()]
            if len(events) == b:
                break
            time.sleep(0.005)
        assert sorted(e.rank for e in events) == list(range(b))
        assert all(e.error is None for e in events)
        for d in range(b):
            want = [shard(t, b, k, d) for t in full]
            for g in groups:
                for rb, lb in zip(g.remote_blocks, g.local_blocks):
                    for t in range(g.num_layers):
                        assert torch.equal(local[d][t][:, lb], want[t][:, rb]), (d, t, rb)
            for t in range(LAYERS):
                assert not local[d][t][:, [0, 2, 5, 6]].any()  # nothing else written
        notes = []
        for _ in range(200):
            notes += [n for w in prefill for n in w.notifications()]
            if len(notes) == b:
                break
            time.sleep(0.005)
        assert notes == [b"remote-req:%d:cap" % b] * b                         # one per decode rank
    finally:
        for w in prefill + decode:
            w.close()
