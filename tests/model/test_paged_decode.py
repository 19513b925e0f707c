"""The in-place paged decode kernel against the reference path (gather + SDPA + sinks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers import paged_decode
from kvrelay.model.layers.attention import AttentionMetadata, FusedDecode, PagedAttention
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import isa_params, skip_unless_runs

pytestmark = pytest.mark.skipif(
    not paged_decode.enabled(), reason="the C++ paged decode kernel cannot be built here"
)


def _step(
    seq_lens: list[int], q_lens: list[int], block_size: int, num_blocks: int, seed: int
) -> AttentionMetadata:
    """Metadata for sequences whose blocks are scattered over the cache (block 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    rows = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        for p in range(n - q, n):
            slots.append(rows[i][p // block_size] * block_size + p % block_size)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionMetadata(
        cu,
        torch.tensor(seq_lens),
        (table,),
        (torch.tensor(slots),),
        block_size,
        sum(1 for q in q_lens if q == 1),
    )


def _plan(use_kernel: bool) -> ExecutionPlan:
    """This process's plan (the native kernels), or the reference plan."""
    return execution_plan.current() if use_kernel else ExecutionPlan.reference()


def _run(layer: PagedAttention, use_kernel: bool, q, k, v, cache, meta) -> torch.Tensor:
    layer.plan = _plan(use_kernel)
    meta._plans.clear()
    return layer(q, k, v, cache.clone(), meta)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 16), (6, 3, 12), (8, 2, 8), (16, 2, 20), (8, 1, 64)]
)
@pytest.mark.parametrize("window", [None, 5, 40])
def test_decode_kernel_matches_reference(heads, kv_heads, head_dim, window):
    torch.manual_seed(0)
    B, NB = 8, 64
    # block-edge lengths (B-1, B, B+1, 2B), one token, and longer than the window
    seq_lens = [1, B - 1, B, B + 1, 2 * B, 37, 70]
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=heads + (window or 0))
    layer = PagedAttention(heads, kv_heads, head_dim, window, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    T = len(seq_lens)
    q, k, v = (
        torch.randn(T, heads, head_dim),
        torch.randn(T, kv_heads, head_dim),
        torch.randn(T, kv_heads, head_dim),
    )
    cache = torch.randn(2, NB, kv_heads, B, head_dim)
    ref = _run(layer, False, q, k, v, cache, meta)
    got = _run(layer, True, q, k, v, cache, meta)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_seqs", [1, 33])
def test_decode_kernel_bf16_and_mixed_step(num_seqs):
    """bf16 cache; decodes followed by a prefill chunk in the same step (the prefill keeps
    the reference path and must be unchanged)."""
    torch.manual_seed(1)
    B, NB, h, kvh, hd = 16, 256, 8, 2, 32
    seq_lens = [int(x) for x in torch.randint(1, 90, (num_seqs,))] + [45]
    q_lens = [1] * num_seqs + [20]
    meta = _step(seq_lens, q_lens, B, NB, seed=num_seqs)
    layer = PagedAttention(h, kvh, hd, 32, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    T = sum(q_lens)
    q = torch.randn(T, h, hd, dtype=torch.bfloat16)
    k, v = (torch.randn(T, kvh, hd, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(2, NB, kvh, B, hd).to(torch.bfloat16)
    ref = _run(layer, False, q, k, v, cache, meta)
    got = _run(layer, True, q, k, v, cache, meta)
    torch.testing.assert_close(got[num_seqs:], ref[num_seqs:], rtol=0, atol=0)
    torch.testing.assert_close(got[:num_seqs].float(), ref[:num_seqs].float(), rtol=2e-2, atol=2e-2)


def test_decode_kernel_reads_only_its_blocks():
    """Garbage (NaN) in blocks a sequence does not own, or outside its window, never leaks."""
    torch.manual_seed(2)
    B, NB, h, kvh, hd = 4, 32, 4, 2, 8
    meta = _step([10, 3], [1, 1], B, NB, seed=3)
    cache = torch.full((2, NB, kvh, B, hd), float("nan"))
    table = meta.block_tables[0]
    for i, n in enumerate([10, 3]):
        for p in range(max(0, n - 6), n):  # window 6: only these positions are read
            cache[:, table[i, p // B], :, p % B] = torch.randn(2, kvh, hd)
    layer = PagedAttention(h, kvh, hd, 6, 0, ParallelContext())
    q, k, v = torch.randn(2, h, hd), torch.randn(2, kvh, hd), torch.randn(2, kvh, hd)
    out = _run(layer, True, q, k, v, cache, meta)
    assert torch.isfinite(out).all()


def test_native_write_kv_matches_reference_and_skips_padding():
    from kvrelay.model.layers.attention import write_kv

    torch.manual_seed(4)
    B, NB, kvh, hd = 4, 8, 3, 5
    k, v = torch.randn(6, kvh, hd).to(torch.bfloat16), torch.randn(6, kvh, hd).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 31, 12, -1])
    ref = torch.zeros(2, NB, kvh, B, hd, dtype=torch.bfloat16)
    got = ref.clone()
    write_kv(ref, k, v, slots, B)
    paged_decode.write_kv(got, k, v, slots)
    assert torch.equal(got, ref)
    assert int((got != 0).any(dim=(2, 4)).sum()) == 2 * 4  # 4 slots written, K and V


@pytest.mark.parametrize("isa", isa_params("paged_decode"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_isa_build_matches_reference(dtype, isa):
    """Each ISA build of the table (avx512_bf16 / avx512 / avx2 / generic; those this CPU
    cannot run are skipped naming what it lacks) against the reference path; fp16 caches
    too."""
    from kvrelay.model.layers.attention import write_kv

    torch.manual_seed(5)
    B, NB, h, kvh, hd = 8, 64, 6, 2, 20
    seq_lens = [1, B - 1, B + 1, 2 * B, 45, 261]   # 261: three softmax chunks
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=5)
    layer = PagedAttention(h, kvh, hd, 12, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    T = len(seq_lens)
    q = torch.randn(T, h, hd).to(dtype)
    k, v = (torch.randn(T, kvh, hd).to(dtype) for _ in range(2))
    cache = torch.randn(2, NB, kvh, B, hd).to(dtype)
    ref = _run(layer, False, q, k, v, cache, meta).float()
    written = cache.clone()
    write_kv(written, k, v, meta.slot_mappings[0], B)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = torch.ops.kvrelay_kernels.paged_decode(
        q, written, meta.block_tables[0], meta.seq_lens, layer.sinks, layer.scale, 12, isa)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol, msg=isa)


@pytest.mark.parametrize("window", [0, 100])
def test_two_threads_give_the_single_thread_result_bit_for_bit(window):
    """(sequence, KV head) items are independent: splitting them over threads (here 45
    sequences × 3 KV heads of uneven lengths, enough work for two threads) changes no bit."""
    torch.manual_seed(6)
    B, NB, h, kvh, hd = 16, 512, 12, 3, 64
    seq_lens = [1] + [int(x) for x in torch.randint(2, 300, (44,))]
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=6)
    q = torch.randn(len(seq_lens), h, hd)
    cache = torch.randn(2, NB, kvh, B, hd)
    sinks = torch.randn(h)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.ops.kvrelay_kernels.paged_decode(
                q, cache, meta.block_tables[0], meta.seq_lens, sinks, 0.125, window))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 72])
def test_every_isa_on_the_shapes_the_simd_builds_specialise(dtype, heads, kv_heads, head_dim):
    """The SIMD builds fix the head dim's vector count at compile time (32 and 64: the
    tiny and real models), take 72 at run time with a partial last vector, score 16 or 8
    positions at a time and tile the query heads of a KV head (GQA 1 with an odd head
    count, 2 and 8): blocks of 16 with lengths around the block and vector edges, with and
    without a window that starts inside a block (inside the first softmax chunk, or one
    that leaves a chunk short of a whole block), for every ISA this CPU runs."""
    from kvrelay.model.kernels import isa as isa_table
    from kvrelay.model.layers.attention import write_kv

    torch.manual_seed(7)
    B, NB = 16, 96
    seq_lens = [1, 7, 15, 16, 17, 33, 200]
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=heads * head_dim)
    T = len(seq_lens)
    q = torch.randn(T, heads, head_dim).to(dtype)
    k, v = (torch.randn(T, kv_heads, head_dim).to(dtype) for _ in range(2))
    cache = torch.randn(2, NB, kv_heads, B, head_dim).to(dtype)
    written = cache.clone()
    write_kv(written, k, v, meta.slot_mappings[0], B)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (None, 17, 150):
        layer = PagedAttention(heads, kv_heads, head_dim, window, 0, ParallelContext())
        layer.sinks.normal_(0, 1)
        ref = _run(layer, False, q, k, v, cache, meta).float()
        for isa in isa_table.variants("paged_decode"):
            got = torch.ops.kvrelay_kernels.paged_decode(
                q, written, meta.block_tables[0], meta.seq_lens, layer.sinks, layer.scale,
                window or 0, isa)
            torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol,
                                       msg=f"{isa} window={window}")


def _exact_decode(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: list[int],
                  sinks: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Decode attention in float64 straight from the paged cache (positions
    [max(0, len - window), len) of each sequence; the sink joins the softmax's denominator)."""
    S, H, D = q.shape
    B, KVH = cache.shape[3], cache.shape[2]
    out = torch.empty(S, H, D, dtype=torch.float64)
    for s, n in enumerate(lens):
        pos = torch.arange(max(0, n - window) if window else 0, n)   # [n_visible]
        blocks = table[s, pos // B]
        k = cache[0, blocks, :, pos % B].double()                   # [n_visible, KVH, D]
        v = cache[1, blocks, :, pos % B].double()
        for h in range(H):
            kh = h // (H // KVH)
            logits = k[:, kh] @ q[s, h].double() * scale            # [n_visible]
            full = torch.cat([logits, sinks[h:h + 1].double()]).softmax(0)
            out[s, h] = full[:-1] @ v[:, kh]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,B",
    [(64, 8, 64, 16), (9, 3, 64, 16), (10, 2, 128, 8), (20, 4, 32, 32), (6, 2, 64, 160),
     (5, 1, 64, 16), (3, 3, 64, 16)],
)
def test_every_isa_on_long_gqa_contexts(dtype, heads, kv_heads, head_dim, B):
    """Long contexts over many softmax chunks (kDecodeChunk = 128 positions; blocks of 160
    make one-block chunks) with GQA 1, 2, 3, 5 (a head tile cut short) and 8 (gpt-oss-20b's
    64 over 8), lengths ending inside a block, windows starting inside a block and spanning
    chunks, and sinks: every ISA this CPU runs equals attention computed in float64 to the
    output's rounding."""
    from kvrelay.model.kernels import isa as isa_table

    torch.manual_seed(heads * head_dim + B)
    seq_lens = [1, 17, 8 * B - 1, 1000, 2051]
    NB = sum(-(-n // B) for n in seq_lens) + 1
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=B)
    table = meta.block_tables[0]
    q = (2 * torch.randn(len(seq_lens), heads, head_dim)).to(dtype)
    cache = torch.randn(2, NB, kv_heads, B, head_dim).to(dtype)
    sinks = 2 * torch.randn(heads)
    scale = head_dim ** -0.5
    rtol = 1e-5 if dtype == torch.float32 else 4e-3   # bf16: half an ulp of the output
    for window in (0, 200, 1500):
        exact = _exact_decode(q, cache, table, seq_lens, sinks, scale, window).float()
        for isa in isa_table.variants("paged_decode"):
            got = torch.ops.kvrelay_kernels.paged_decode(q, cache, table, meta.seq_lens, sinks,
                                                         scale, window, isa)
            torch.testing.assert_close(got.float(), exact, rtol=rtol, atol=1e-5,
                                       msg=f"{isa} window={window}")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,B",
    [(4, 2, 32, 16), (3, 1, 64, 32), (9, 3, 96, 8), (16, 2, 128, 16), (5, 5, 64, 48),
     (2, 1, 32, 160)],
)
def test_bf16_build_matches_reference_and_the_fp32_build(heads, kv_heads, head_dim, B):
    """The avx512_bf16 build (bf16 cache, head dims 32-128: vdpbf16ps scores, even/odd V
    accumulators) on GQA 1, 2, 3 and 8 with head tiles cut short, blocks of 8, 16, 32, 48
    and 160 (one, two or three 16-row score groups, the last partial; softmax chunks of
    128 positions or of one block larger than that), lengths on block and group edges and
    across chunks, windows starting inside a block (one inside the first chunk's block
    list, one spanning chunks) and sinks: equal to the reference and, up to one bf16
    rounding of the output, to the fp32 "avx512" build."""
    from kvrelay.model.layers.attention import write_kv

    skip_unless_runs("paged_decode", "avx512_bf16")
    torch.manual_seed(head_dim + B)
    NB = 160
    seq_lens = [1, B - 1, B, B + 1, 17, 2 * B + 15, 3 * B + 16, 150, 261]
    NB = max(NB, sum(-(-n // B) for n in seq_lens) + 1)
    meta = _step(seq_lens, [1] * len(seq_lens), B, NB, seed=heads * B)
    T = len(seq_lens)
    q = (3 * torch.randn(T, heads, head_dim)).to(torch.bfloat16)
    k, v = (torch.randn(T, kv_heads, head_dim).to(torch.bfloat16) for _ in range(2))
    cache = torch.randn(2, NB, kv_heads, B, head_dim).to(torch.bfloat16)
    written = cache.clone()
    write_kv(written, k, v, meta.slot_mappings[0], B)
    for window in (None, 21, 150):
        layer = PagedAttention(heads, kv_heads, head_dim, window, 0, ParallelContext())
        layer.sinks.normal_(0, 2)
        ref = _run(layer, False, q, k, v, cache, meta).float()
        got, fp32 = (torch.ops.kvrelay_kernels.paged_decode(
            q, written, meta.block_tables[0], meta.seq_lens, layer.sinks, layer.scale,
            window or 0, isa).float() for isa in ("avx512_bf16", "avx512"))
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2, msg=f"window={window}")
        torch.testing.assert_close(got, fp32, rtol=8e-3, atol=1e-5, msg=f"window={window}")


def _rotary_case(heads, kv_heads, head_dim, seq_lens, dtype, B=8, NB=64, seed=0):
    """A decode-only step: qk/v as views of one qkv row (as QKVParallelLinear gives them),
    a YaRN rotary table, a cache with scattered blocks and one padding slot (-1)."""
    from kvrelay.model.config import RopeConfig
    from kvrelay.model.layers.rotary import RotaryEmbedding

    torch.manual_seed(seed)
    T = len(seq_lens)
    meta = _step(seq_lens, [1] * T, B, NB, seed=seed)
    if T > 2:
        meta.slot_mappings[0][1] = -1   # a padded row: its K/V must not be written
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)
    rope = RopeConfig(rope_type="yarn", theta=150000.0, factor=32.0, beta_fast=32.0,
                      beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)
    rotary = RotaryEmbedding(rope, head_dim, max(seq_lens) + 4)
    positions = torch.tensor(seq_lens) - 1
    cache = torch.randn(2, NB, kv_heads, B, head_dim).to(dtype)
    return meta, qk, v, rotary, positions, cache


def _separate_ops(layer, rotary, qk, v, positions, cache, meta):
    """The general path of `PagedAttention.rope_attend`: one rotary call, then the layer's
    forward."""
    meta._plans.clear()
    q, k = rotary.rotate(positions, qk).split([layer.num_heads, layer.num_kv_heads], dim=1)
    return layer(q, k, v, cache, meta).flatten(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (6, 3, 12), (16, 2, 20), (8, 1, 64)]
)
@pytest.mark.parametrize("window", [0, 5, 40])
def test_fused_rotary_decode_is_bitwise_the_separate_ops(dtype, heads, kv_heads, head_dim,
                                                         window):
    """RoPE + KV write + paged decode in one call: the output and every cache byte equal
    the eager path's (native write_kv + decode) exactly, on block-edge lengths."""
    B = 8
    seq_lens = [1, B - 1, B, B + 1, 2 * B, 37, 70]
    meta, qk, v, rotary, positions, cache = _rotary_case(heads, kv_heads, head_dim, seq_lens,
                                                         dtype, B=B, seed=heads + window)
    layer = PagedAttention(heads, kv_heads, head_dim, window or None, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = _separate_ops(layer, rotary, qk, v, positions, ref_cache, meta)
    assert layer.fuses_decode(qk, got_cache, meta)
    got = layer.rope_attend(qk, v, positions, rotary, got_cache, meta,
                            FusedDecode(rotary.cos, rotary.sin))
    assert got.dtype == dtype and got.shape == (len(seq_lens), heads * head_dim)
    assert torch.equal(got, ref)
    assert torch.equal(got_cache, ref_cache)
    meta._plans.clear()
    general_cache = cache.clone()                 # no `FusedDecode`: the separate ops
    general = layer.rope_attend(qk, v, positions, rotary, general_cache, meta, None)
    assert torch.equal(general, ref) and torch.equal(general_cache, ref_cache)


@pytest.mark.parametrize("num_seqs", [1, 16, 40])
def test_fused_rotary_decode_matches_the_reference_path(num_seqs):
    """Against the pure-PyTorch reference (torch rotary, index-put KV write, gather + SDPA),
    bf16, one and many sequences, GQA 3:1 and a sliding window."""
    g = torch.Generator().manual_seed(num_seqs)
    seq_lens = [int(x) for x in torch.randint(1, 200, (num_seqs,), generator=g)]
    for window in (0, 64):
        meta, qk, v, rotary, positions, cache = _rotary_case(
            9, 3, 64, seq_lens, torch.bfloat16, B=16, NB=16 * num_seqs + 1, seed=num_seqs)
        layer = PagedAttention(9, 3, 64, window or None, 0, ParallelContext())
        layer.sinks.normal_(0, 1)
        ref_cache, got_cache = cache.clone(), cache.clone()
        layer.plan = _plan(False)
        ref = _separate_ops(layer, rotary, qk, v, positions, ref_cache, meta)
        assert not layer.fuses_decode(qk, ref_cache, meta)
        layer.plan = _plan(True)
        got = layer.rope_attend(qk, v, positions, rotary, got_cache, meta,
                                FusedDecode(rotary.cos, rotary.sin))
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        assert torch.equal(got_cache, ref_cache)


def test_fused_rotary_decode_is_not_taken_for_mixed_steps_or_other_cache_dtypes():
    meta, qk, _, _, _, cache = _rotary_case(4, 2, 16, [5, 9], torch.bfloat16)
    layer = PagedAttention(4, 2, 16, None, 0, ParallelContext())
    assert layer.fuses_decode(qk, cache, meta)
    assert not layer.fuses_decode(qk, cache.float(), meta)           # cache dtype differs
    assert not layer.fuses_decode(qk[:1], cache, meta)               # not every token a decode
    layer.plan = dataclasses.replace(layer.plan, fused_decode=False, decode_stack=False)
    assert not layer.fuses_decode(qk, cache, meta)
