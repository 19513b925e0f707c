"""The native MoE kernels (`kvrelay.model.kernels`) against the PyTorch reference path.

Every ISA build this CPU can run (avx512 / avx2 / generic) is checked, on odd shapes:
hidden not a multiple of 64 (or of 16, dense), intermediate ≠ hidden, one and many
tokens per expert, experts without tokens, top-1/2/4, fp32 / bf16 / MXFP4 weights,
and expert- and tensor-parallel shards (MXFP4 rows zero-padded to whole blocks).
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvrelay.model import execution_plan, fast_paths, kernels, mxfp4
from kvrelay.model.kernels import isa as isa_table
from kvrelay.model.layers import moe as moe_mod
from kvrelay.model.layers.attention import FusedDecode
from kvrelay.model.layers.moe import Experts
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import isa_params

ALPHA, LIMIT = 1.702, 7.0
# a decode-only step's choice of the fused ops (the experts read none of its tables)
FUSED = FusedDecode(torch.empty(0), torch.empty(0))


@pytest.fixture(scope="session")
def isas() -> tuple[str, ...]:
    """Builds the extension once per test session (JIT, cached on disk). Without a C++
    compiler the kernels cannot exist (the fallback is tested below); with one, a failed
    build is a failure."""
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    status = kernels.status()
    assert status.available, f"native kernels failed to build: {status.reason}"
    return isa_table.variants("moe")    # the table's choice for this CPU (the op must take each)


def make_experts(H: int, I: int, E: int, storage: str, seed: int,  # noqa: E741 -- I: shapes
                 ctx: ParallelContext | None = None) -> Experts:
    """Random experts; `storage` is fp32, bf16 or mxfp4 (weights on the MXFP4 grid)."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if storage == "bf16" else torch.float32
    ex = Experts(H, I, E, ctx or ParallelContext(), dtype, ALPHA, LIMIT, storage == "mxfp4")
    ex.gate_up_bias.copy_(torch.randn(ex.gate_up_bias.shape, generator=g) * 0.5)
    ex.down_bias.copy_(torch.randn(ex.down_bias.shape, generator=g) * 0.5)
    if storage == "mxfp4":
        ex.gate_up = random_mxfp4(ex.num_local, 2 * I, H, g)
        ex.down = random_mxfp4(ex.num_local, H, I, g)
        ex.invalidate()
    else:
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.3)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.3)
    return ex


def random_mxfp4(E: int, rows: int, cols: int, g: torch.Generator) -> mxfp4.MXFP4Tensor:
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(122, 126, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
    return mxfp4.MXFP4Tensor(blocks, scales)


def fp32_reference(ex: Experts) -> Experts:
    """The same experts as dense fp32 (MXFP4 dequantised exactly), for forward_torch."""
    E, H, I = ex.num_local, ex.hidden, ex.intermediate  # noqa: E741 -- I as in the shape notation
    ref = Experts(H, I, E * ex.ctx.ep_size, ex.ctx, torch.float32, ALPHA, LIMIT, False)
    ref.gate_up_bias.copy_(ex.gate_up_bias.float())
    ref.down_bias.copy_(ex.down_bias.float())
    for name in ("gate_up", "down"):
        w = getattr(ex, name)
        dense = torch.stack([w.expert(e, torch.float32) for e in range(E)]) \
            if isinstance(w, mxfp4.MXFP4Tensor) else w.float()
        getattr(ref, name).copy_(dense)
    return ref


def routing(T: int, E: int, k: int, seed: int, experts: int | None = None):
    """Random top-k choices among the first `experts` experts (the others get no tokens)."""
    g = torch.Generator().manual_seed(seed)
    pool = experts or E
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)])   # [T, k]
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)                # [T, k]
    return weights, ids


def native(ex: Experts, x, weights, ids, isa: str) -> torch.Tensor:
    return kernels.moe_experts(
        x.float().contiguous(), weights.float().contiguous(), ids, ex.first_expert,
        ex._kernel_weight(ex.gate_up), ex._f32("gate_up_bias"), ex._kernel_weight(ex.down),
        ex._f32("down_bias") if ex.add_down_bias else None, ALPHA, LIMIT, isa)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    scale = ref.abs().max().clamp(min=1e-6)
    err = (out.float() - ref).abs().max() / scale
    assert err < rel, f"max error {err:.2e} of the output scale (allowed {rel:.0e})"


# (hidden, intermediate, experts, top_k, tokens, storage, experts that get tokens)
CASES = {
    "dense-hidden40-top2": (40, 56, 5, 2, 7, "fp32", None),
    "dense-hidden72-1token-top4": (72, 24, 6, 4, 1, "fp32", None),
    "bf16-many-tokens-top1": (80, 136, 4, 1, 53, "bf16", None),
    "bf16-zero-token-experts": (48, 48, 8, 2, 3, "bf16", 3),
    "mxfp4-hidden96-1token-top4": (96, 64, 4, 4, 1, "mxfp4", None),
    "mxfp4-many-tokens-top2": (160, 96, 6, 2, 45, "mxfp4", None),
    "mxfp4-zero-token-experts-top1": (64, 192, 16, 1, 9, "mxfp4", 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_matches_reference_in_fp32(case, isas):
    H, I, E, k, T, storage, pool = CASES[case]  # noqa: E741 -- I as in the shape notation
    ex = make_experts(H, I, E, storage, seed=len(case))
    ref = fp32_reference(ex)
    weights, ids = routing(T, E, k, seed=T, experts=pool)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    expected = ref.forward_torch(x, weights, ids)
    for isa in isas:
        out = native(ex, x, weights, ids, isa)
        assert out.dtype == torch.float32 and out.shape == (T, H)
        assert_close(out, expected)


@pytest.mark.parametrize("variant", isa_params("moe"))
def test_every_variant_of_the_table_runs_or_says_what_the_cpu_lacks(variant, isas):
    """The loops above cover the variants this CPU runs; this names the others' skips."""
    H, I, E, k, T, storage, pool = CASES["mxfp4-hidden96-1token-top4"]  # noqa: E741
    ex = make_experts(H, I, E, storage, seed=3)
    weights, ids = routing(T, E, k, seed=T, experts=pool)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    assert_close(native(ex, x, weights, ids, variant),
                 fp32_reference(ex).forward_torch(x, weights, ids))


# Token rows per expert: one row, a pair, odd blocks, one full block of 8 and one more.
SHARED_EXPERT_ROWS = (1, 2, 3, 5, 9, 0)


def shared_expert_routing(rows_per_expert: tuple[int, ...], seed: int):
    """Top-1 choices giving expert e exactly rows_per_expert[e] tokens, tokens shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([e for e, n in enumerate(rows_per_expert) for _ in range(n)])
    ids = ids[torch.randperm(len(ids), generator=g)].unsqueeze(1)                 # [T, 1]
    return torch.ones(len(ids), 1), ids


# hidden 96: 3 groups, one pass per weight row; hidden 3104: 8 token rows exceed the
# kernels' one-pass budget (csrc/moe_impl.h kRowPassBytes), so columns go in chunks of 1024
# with a 32-column tail
@pytest.mark.parametrize("H, I", [(96, 160), (3104, 64)])
@pytest.mark.parametrize("storage", ["mxfp4", "bf16", "fp32"])
def test_tokens_sharing_an_expert_match_the_reference(H, I, storage, isas):  # noqa: E741
    """Tokens routed to the same expert share each decoded weight group (row blocks of
    1-8 token rows against 2 weight rows at a time): every block size and the rows left
    over after whole blocks give the reference result."""
    ex = make_experts(H, I, len(SHARED_EXPERT_ROWS), storage, seed=H + I)
    weights, ids = shared_expert_routing(SHARED_EXPERT_ROWS, seed=1)
    x = torch.randn(len(ids), H, generator=torch.Generator().manual_seed(4))
    expected = fp32_reference(ex).forward_torch(x, weights, ids)
    for isa in isas:
        assert_close(native(ex, x, weights, ids, isa), expected)


@pytest.mark.parametrize("storage", ["bf16", "mxfp4", "fp32"])
def test_module_forward_uses_the_kernel_and_keeps_the_dtype(storage, isas, monkeypatch):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    ex = make_experts(64, 96, 4, storage, seed=3)
    weights, ids = routing(6, 4, 2, seed=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5)).to(ex.dtype)
    calls = []
    real = kernels.moe_experts
    monkeypatch.setattr(kernels, "moe_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = ex(x, weights.to(ex.dtype), ids)
    assert calls == [1] and out.dtype == ex.dtype
    expected = fp32_reference(ex).forward_torch(x.float(), weights.to(ex.dtype).float(), ids)
    assert_close(out, expected, rel=1e-2 if storage != "fp32" else 1e-5)


def test_torch_mode_never_calls_the_kernel(monkeypatch):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "torch")
    monkeypatch.setattr(kernels, "moe_experts", lambda *a, **kw: pytest.fail("kernel called"))
    ex = make_experts(32, 32, 2, "fp32", seed=0)
    weights, ids = routing(3, 2, 1, seed=0)
    assert ex(torch.randn(3, 32), weights, ids).shape == (3, 32)


def test_bad_mode_names_the_variable_at_construction(monkeypatch):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"KVRELAY_MOE_KERNEL.*auto, native or torch"):
        make_experts(32, 32, 2, "fp32", seed=0)


def shard(full: Experts, ctx: ParallelContext) -> Experts:
    """`full`'s share for `ctx`, cut like the loader: whole experts [e0, e1) and
    intermediate rows [i0, i1) zero-padded to the shard length."""
    ex = Experts(full.hidden, full.intermediate, full.num_local, ctx, torch.float32, ALPHA,
                 LIMIT, True)
    e0, e1 = ex.first_expert, ex.first_expert + ex.num_local
    i0, i1, il = ex.i0, ex.i1, ex.i_local
    ex.gate_up_bias.zero_()[:, :2 * (i1 - i0)] = full.gate_up_bias[e0:e1, 2 * i0:2 * i1]
    ex.down_bias.copy_(full.down_bias[e0:e1])

    def cut(w: mxfp4.MXFP4Tensor, dim: int, start: int, stop: int, length: int):
        blocks = torch.zeros(*w.blocks[e0:e1].shape[:dim], length, *w.blocks.shape[dim + 1:],
                             dtype=torch.uint8)
        scales = torch.full(blocks.shape[:-1], 127, dtype=torch.uint8)
        blocks.narrow(dim, 0, stop - start).copy_(w.blocks[e0:e1].narrow(dim, start, stop - start))
        scales.narrow(dim, 0, stop - start).copy_(w.scales[e0:e1].narrow(dim, start, stop - start))
        return mxfp4.MXFP4Tensor(blocks, scales)

    G = mxfp4.BLOCK
    ex.gate_up = cut(full.gate_up, 1, 2 * i0, 2 * i1, 2 * il)
    ex.down = cut(full.down, 2, i0 // G, -(-i1 // G), il // G)
    ex.invalidate()
    return ex


@pytest.mark.parametrize("ctxs", [
    [ParallelContext(tp_rank=r, tp_size=2) for r in range(2)],                     # padded rows
    [ParallelContext(tp_rank=r, tp_size=2, ep_rank=r, ep_size=2) for r in range(2)],
], ids=["moe-tp2-padded", "ep2"])
def test_sharded_experts_sum_to_the_full_layer(ctxs, isas):
    full = make_experts(64, 96, 4, "mxfp4", seed=7)         # 96 = 3 blocks: TP2 pads 32 rows
    weights, ids = routing(11, 4, 2, seed=8)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(9))
    expected = fp32_reference(full).forward_torch(x, weights, ids)
    shards = [shard(full, ctx) for ctx in ctxs]
    if ctxs[0].ep_size == 1:
        assert shards[1].i_local > shards[1].i1 - shards[1].i0      # the padding is exercised
    for isa in isas:
        total = sum(native(s, x, weights, ids, isa) for s in shards)
        assert_close(total, expected)


def test_no_local_choices_give_zeros(isas):
    ex = make_experts(32, 32, 2, "mxfp4", seed=1, ctx=ParallelContext(ep_rank=1, ep_size=2))
    ids = torch.zeros(4, 1, dtype=torch.long)                   # all routed to expert 0 (rank 0)
    out = native(ex, torch.randn(4, 32), torch.ones(4, 1), ids, isas[0])
    assert torch.equal(out, torch.zeros(4, 32))


def test_bad_shapes_are_reported(isas):
    ex = make_experts(64, 32, 2, "fp32", seed=1)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        native(ex, torch.randn(2, 32), *routing(2, 2, 1, seed=0), isas[0])


@pytest.fixture
def broken_build(monkeypatch):
    """The next `kernels.status()` sees a failing compiler; the real status afterwards."""
    def fail(directory):
        raise RuntimeError("Error building extension 'kvrelay_kernels'\nno compiler")
    kernels.status.cache_clear()
    execution_plan.current.cache_clear()
    monkeypatch.setattr(kernels, "_build", fail)
    yield
    kernels.status.cache_clear()
    execution_plan.current.cache_clear()


def test_build_failure_falls_back_with_one_warning(broken_build, monkeypatch, caplog):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "auto")
    weights, ids = routing(3, 2, 1, seed=0)
    x = torch.randn(3, 32)
    with caplog.at_level(logging.WARNING, logger="kvrelay.model.kernels"):
        ex = make_experts(32, 64, 2, "mxfp4", seed=2)          # the build is tried here
        outs = [ex(x, weights, ids) for _ in range(3)]
    warnings = [r for r in caplog.records if "native CPU kernels unavailable" in r.message]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
    assert not kernels.kernels_available() and "no compiler" in kernels.status().reason
    assert fast_paths.native_paths()["kernels"] == {"moe": None, "paged_decode": None,
                                                     "dense": None}
    assert torch.equal(outs[0], fp32_reference(ex).forward_torch(x, weights, ids)) or \
        (outs[0] - fp32_reference(ex).forward_torch(x, weights, ids)).abs().max() < 1e-5
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    execution_plan.current.cache_clear()
    with pytest.raises(RuntimeError, match=r"KVRELAY_MOE_KERNEL=native.*no compiler"):
        execution_plan.current()


def test_no_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_KERNELS_DIR", str(tmp_path))     # nothing built there
    monkeypatch.setenv("CXX", "no-such-compiler-kvrelay")
    kernels.status.cache_clear()
    try:
        status = kernels.status()
        assert not status.available and "no C++ compiler" in status.reason
    finally:
        kernels.status.cache_clear()


def test_kernels_are_not_rebuilt_per_embedded_model_cache(monkeypatch, tmp_path):
    before = kernels.build_dir()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    assert kernels.build_dir() == before
    monkeypatch.setenv("KVRELAY_KERNELS_DIR", str(tmp_path))
    assert kernels.build_dir().parent == tmp_path


def test_a_built_extension_is_reused_without_compiling(isas, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **kw: pytest.fail("recompiled"))
    assert kernels._build(kernels.build_dir()).is_file()


def test_mode_is_read_through_envs(monkeypatch):
    monkeypatch.delenv("KVRELAY_MOE_KERNEL", raising=False)
    assert moe_mod.moe_kernel_mode() == "auto"
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "torch")
    assert moe_mod.moe_kernel_mode() == "torch"


def test_dense_fp16_experts_keep_the_torch_path_mxfp4_ones_do_not(isas, monkeypatch):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    dense = Experts(32, 32, 2, ParallelContext(), torch.float16, ALPHA, LIMIT, False)
    assert not dense.uses_native_kernel()                 # the kernel reads f32/bf16/MXFP4
    packed = Experts(32, 32, 2, ParallelContext(), torch.float16, ALPHA, LIMIT, True)
    g = torch.Generator().manual_seed(0)
    packed.gate_up, packed.down = random_mxfp4(2, 64, 32, g), random_mxfp4(2, 32, 32, g)
    packed.invalidate()
    assert packed.uses_native_kernel()
    weights, ids = routing(3, 2, 1, seed=0)
    out = packed(torch.randn(3, 32).half(), weights.half(), ids)
    assert out.dtype == torch.float16


def test_auto_gives_big_batches_to_torch_gemms_mxfp4_ones_only_at_many_rows(isas, monkeypatch):
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "auto")
    dense = make_experts(256, 128, 4, "bf16", seed=0)
    packed = make_experts(256, 128, 4, "mxfp4", seed=0)
    # per expert: enough rows, and rows × hidden × intermediate ≥ the work threshold
    per_expert = max(moe_mod.DENSE_TORCH_MIN_ROWS, moe_mod.DENSE_TORCH_MIN_WORK // (256 * 128))
    rows = per_expert * 4                                      # choices over 4 experts
    assert dense.uses_native_kernel(rows - 1) and not dense.uses_native_kernel(rows)
    # MXFP4: the kernel (no per-step dequantisation) up to MXFP4_TORCH_MIN_ROWS per expert
    fp4_rows = moe_mod.MXFP4_TORCH_MIN_ROWS * 4
    assert fp4_rows > rows and packed.uses_native_kernel(fp4_rows - 1)
    assert not packed.uses_native_kernel(fp4_rows)
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")          # forced: always the kernel
    execution_plan.current.cache_clear()
    dense.use_plan(execution_plan.current())
    packed.use_plan(execution_plan.current())
    assert dense.uses_native_kernel(rows * 100) and packed.uses_native_kernel(fp4_rows * 100)


def test_auto_mxfp4_prefill_batch_matches_the_kernel(isas, monkeypatch):
    """A batch with MXFP4_TORCH_MIN_ROWS rows per expert takes the dequantise + GEMM path
    under 'auto' and gives the kernel's result (same values, float summation order)."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "auto")
    ex = make_experts(64, 32, 2, "mxfp4", seed=3)
    T = moe_mod.MXFP4_TORCH_MIN_ROWS * 2                       # top-1 of 2 experts
    ids = torch.arange(T).remainder(2).view(T, 1)
    weights = torch.rand(T, 1, generator=torch.Generator().manual_seed(1))
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    assert not ex.uses_native_kernel(ids.numel())
    auto = ex(x, weights, ids)
    assert_close(auto, native(ex, x, weights, ids, isas[0]))


def test_auto_keeps_small_dense_experts_on_the_kernel_at_any_batch(isas, monkeypatch):
    """Tiny experts (hidden 32: the peers benchmark model) lose to the per-expert Python
    loop of the torch path however many rows they get."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "auto")
    dense = make_experts(32, 32, 8, "bf16", seed=0)
    assert dense.uses_native_kernel(8 * 64)                    # 64 rows per expert
    assert not dense.uses_native_kernel(8 * moe_mod.DENSE_TORCH_MIN_WORK // (32 * 32))


def test_the_op_traces_under_fake_tensors(isas):
    """torch.compile traces with FakeTensors: the op needs (and has) a shape function."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    ex = make_experts(64, 32, 4, "mxfp4", seed=0)
    weights, ids = routing(5, 4, 2, seed=0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = native(ex, torch.empty(5, 64), weights, ids, isas[0])
    assert out.shape == (5, 64) and out.dtype == torch.float32


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count (the kernels' OpenMP team) for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# (hidden, intermediate, experts, top_k, tokens, storage, experts that get tokens): every
# case has ≥ 2^21 multiply-adds per sweep, or ≥ 512 KiB of weights to stream, so two
# threads split it (csrc/parallel.h, csrc/moe_op.cpp)
THREADED_CASES = {
    # decode of one token: few multiply-adds, but 1 MiB (gate_up) and 512 KiB (down) of
    # bf16 weights, split by bytes; hidden 272: a 16-column tail on every row
    "bf16-1-token-split-by-bytes": (272, 1024, 2, 1, 1, "bf16", None),
    # 37 tokens: not a multiple of the thread count nor of the token blocks (8)
    "mxfp4-37-tokens-top2": (256, 224, 6, 2, 37, "mxfp4", None),
    # one token: the work is cut along the weight rows of its 4 experts only
    "mxfp4-1-token-top4": (512, 512, 8, 4, 1, "mxfp4", None),
    # 3 of 8 experts get all 150 tokens: > 64 rows each, cut into token chunks; 5 get none
    "bf16-token-chunks-zero-token-experts": (96, 160, 8, 2, 150, "bf16", 3),
    "fp32-odd-hidden-top1": (200, 72, 3, 1, 131, "fp32", None),
}


@pytest.mark.parametrize("case", list(THREADED_CASES))
def test_two_threads_give_the_single_thread_result_bit_for_bit(case, isas, threads):
    """Work items are independent and computed the same on any thread: the split over
    (expert, row tile, token chunk) never changes a bit, and both match the reference."""
    H, I, E, k, T, storage, pool = THREADED_CASES[case]  # noqa: E741 -- I: intermediate size
    ex = make_experts(H, I, E, storage, seed=len(case))
    weights, ids = routing(T, E, k, seed=T, experts=pool)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    _same_bits_on_one_and_two_threads(threads, ex, x, weights, ids, isas)


# -- decode: the per-call work done once ---------------------------------------------------
# (hidden, intermediate, experts, top_k, tokens, storage): one and many tokens, top-1/top-4
DECODE_CASES = {
    "bf16-1token-top1": (576, 96, 2, 1, 1, "bf16"),
    "bf16-many-tokens-top4": (80, 136, 6, 4, 37, "bf16"),
    "mxfp4-bf16-model-1token-top4": (96, 64, 4, 4, 1, "mxfp4"),
    "mxfp4-fp32-model-many-tokens-top1": (160, 96, 6, 1, 45, "mxfp4-fp32"),
    "fp32-16tokens-top2": (40, 56, 5, 2, 16, "fp32"),
}


def decode_experts(case: str) -> tuple[Experts, torch.Tensor, torch.Tensor, torch.Tensor]:
    H, I, E, k, T, storage = DECODE_CASES[case]  # noqa: E741 -- I as in the shape notation
    ex = make_experts(H, I, E, storage.split("-")[0], seed=len(case))
    if storage == "mxfp4":                       # packed experts in a bf16 model
        ex.dtype = torch.bfloat16
        ex.invalidate()
    weights, ids = routing(T, E, k, seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(ex.dtype)
    return ex, x, weights, ids


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_is_the_kernel_path_bit_for_bit(case, isas, monkeypatch):
    """Decode-sized `forward` calls (paths made once, activations passed to the kernel in
    their dtype) give exactly the kernel on x.float(), rounded to x's dtype."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    ex, x, weights, ids = decode_experts(case)
    before = native(ex, x, weights, ids, "").to(x.dtype)
    for _ in range(2):                           # the second call runs on the cached paths
        out = ex(x, weights, ids)
        assert out.dtype == x.dtype and torch.equal(out, before)


def test_bf16_activations_round_like_a_cast_after_the_fp32_kernel(isas):
    """The kernel widens bf16 x itself and rounds its fp32 result once (nearest even):
    the same bits as x.float() in, .bfloat16() out, in every ISA build."""
    ex = make_experts(96, 64, 4, "mxfp4", seed=9)
    weights, ids = routing(11, 4, 2, seed=1)
    x = (torch.randn(11, 96, generator=torch.Generator().manual_seed(1)) * 8).bfloat16()
    for isa in isas:
        out = kernels.moe_experts(x, weights, ids, 0, ex._kernel_weight(ex.gate_up),
                                  ex._f32("gate_up_bias"), ex._kernel_weight(ex.down),
                                  ex._f32("down_bias"), ALPHA, LIMIT, isa)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, native(ex, x, weights, ids, isa).bfloat16())


def test_decode_plan_follows_reloaded_weights(isas, monkeypatch):
    """Biases copied in place (a reload: their versions tell) and weights replaced then
    `invalidate`d (MXFP4 load) both reach the kernel: the paths are made again, never
    stale."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    ex, x, weights, ids = decode_experts("bf16-1token-top1")
    ex(x, weights, ids)
    ex.down_bias.add_(1.0)
    assert torch.equal(ex(x, weights, ids), native(ex, x, weights, ids, "").bfloat16())
    packed = make_experts(96, 64, 4, "mxfp4", seed=2)
    weights, ids = routing(3, 4, 2, seed=2)
    x = torch.randn(3, 96)
    before = packed(x, weights, ids)
    packed.gate_up = random_mxfp4(4, 128, 96, torch.Generator().manual_seed(7))
    packed.invalidate()
    after = native(packed, x, weights, ids, "")
    assert torch.equal(packed(x, weights, ids), after) and not torch.equal(after, before)


def test_fused_route_forward_all_reduces_only_across_ranks(isas, monkeypatch):
    """One rank: the fused step's all-reduce (an identity) is skipped; a real group gets the
    partial, on the fused and the general ops alike."""
    from kvrelay.model.parallel import Collectives

    class Doubling(Collectives):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    ex, x, _, _ = decode_experts("fp32-16tokens-top2")
    router = moe_mod.Router(40, 5, 2, torch.float32)
    router.weight.copy_(torch.randn(5, 40, generator=torch.Generator().manual_seed(0)))
    alone = ex.route_forward(x, router, FUSED)
    assert torch.equal(ex.route_forward(x, router), alone)
    assert ex.paths().reduce is None
    ex.ctx = ParallelContext(comm=Doubling())
    ex.invalidate()
    assert torch.equal(ex.route_forward(x, router, FUSED), alone * 2)
    assert torch.equal(ex.route_forward(x, router), alone * 2)


def test_decode_follows_the_torch_choice(monkeypatch):
    """KVRELAY_MOE_KERNEL=torch: decode-sized calls run the reference path, never the
    kernel."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "torch")
    ex, x, weights, ids = decode_experts("fp32-16tokens-top2")
    assert torch.equal(ex(x, weights, ids), ex.forward_torch(x, weights, ids))


def test_working_memory_reuse_keeps_results(isas):
    """Decode-sized calls reuse one working buffer per thread, large ones allocate their
    own (csrc/moe_op.cpp `scratch`): small, large (over the 1 MB kept), small again all
    match the reference."""
    ex = make_experts(96, 64, 4, "bf16", seed=5)
    ref = fp32_reference(ex)
    for T in (3, 1500, 2):                       # 1500 tokens top-2: 3000 rows × 96 floats
        weights, ids = routing(T, 4, 2, seed=T)
        x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T))
        assert_close(native(ex, x, weights, ids, isas[0]), ref.forward_torch(x, weights, ids))


# -- dense decode streams: long work items of weight rows (csrc/moe_op.cpp `tiles`) ------------
# hidden 201: odd down rows, an odd row stride and a 9-column scalar tail; intermediate 1400:
# gate_up 1.1 MB and down 563 KB of bf16 weights per expert, so both sweeps take two threads
# at one token, and the items (2 per thread) end on odd row counts (down: 52, 52, 52, 45)
@pytest.mark.parametrize("storage", ["bf16", "fp32"])
@pytest.mark.parametrize("tokens, top_k", [(1, 1), (2, 1), (3, 2), (4, 1), (4, 2), (5, 1)])
def test_decode_streams_are_exact_on_any_thread_count(storage, tokens, top_k, isas, threads):
    """1-4 tokens per expert stream each expert's weight rows in a few long items cut
    differently for one and two threads (5: the short tiles again): every row is computed
    the same way either way, so the bits match, and both match the reference."""
    ex = make_experts(201, 1400, 3, storage, seed=tokens * 10 + top_k)
    weights, ids = routing(tokens, 3, top_k, seed=tokens)
    x = torch.randn(tokens, 201, generator=torch.Generator().manual_seed(tokens))
    if storage == "bf16":                  # a bf16 model's hidden states: bf16 values
        x = x.bfloat16().float()
    _same_bits_on_one_and_two_threads(threads, ex, x, weights, ids, isas)


def _route(x: torch.Tensor, router: moe_mod.Router) -> tuple[torch.Tensor, torch.Tensor]:
    """Router.route_native: the router's linear, then the native top-k + softmax."""
    from kvrelay.model.layers.linear import linear
    return torch.ops.kvrelay_kernels.route_topk(linear(x, router.weight, router.bias),
                                                router.top_k)


@pytest.mark.parametrize("storage", ["bf16", "fp32", "mxfp4"])
@pytest.mark.parametrize("tokens, top_k", [(1, 1), (3, 2), (4, 4)])
def test_fused_route_forward_is_the_router_then_the_experts_bit_for_bit(storage, tokens, top_k,
                                                                        isas, monkeypatch):
    """A fused step's `Experts.route_forward` (router linear + top-k + experts in one native
    call) gives exactly the separate router and experts, takes the one call, and reads the
    router's weights as they are now (no stale copy)."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    ex = make_experts(224, 160, 6, storage, seed=tokens)
    dtype = torch.float32 if storage == "fp32" else torch.bfloat16
    ex.dtype = dtype
    ex.invalidate()
    g = torch.Generator().manual_seed(top_k)
    router = moe_mod.Router(224, 6, top_k, dtype)
    router.weight.copy_(torch.randn(6, 224, generator=g))
    router.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(tokens, 224, generator=g).to(dtype)
    for _ in range(2):
        expected = ex(x, *_route(x, router))
        assert torch.equal(ex.route_forward(x, router, FUSED), expected)
        assert ex.paths().fused[tokens]
        router.weight.mul_(-1.0)                 # other choices; the fused call follows


def test_fused_route_forward_falls_back_to_the_separate_calls(isas, monkeypatch):
    """Where the experts take the torch path a fused step's router runs on its own
    (`Router.route_native`), then the experts."""
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "torch")
    ex = make_experts(40, 56, 5, "fp32", seed=1)
    router = moe_mod.Router(40, 5, 2, torch.float32)
    router.weight.copy_(torch.randn(5, 40, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    calls = []
    route = router.route_native
    monkeypatch.setattr(router, "route_native", lambda x: calls.append(1) or route(x))
    assert torch.equal(ex.route_forward(x, router, FUSED), ex.forward_torch(x, *router(x)))
    assert calls and not ex.paths().fused[3]


def _same_bits_on_one_and_two_threads(threads, ex, x, weights, ids, isas) -> None:
    """Each ISA build gives the same bits on one and two threads (`threads`: the fixture's
    setter), close to the fp32 reference."""
    expected = fp32_reference(ex).forward_torch(x, weights, ids)
    for isa in isas:
        threads(1)
        one = native(ex, x, weights, ids, isa)
        threads(2)
        two = native(ex, x, weights, ids, isa)
        assert torch.equal(one, two), isa
        assert_close(two, expected)


# -- the one chooser: `ExpertPaths` ----------------------------------------------------------
def test_one_choice_per_batch_size_until_the_paths_are_made_again(isas, monkeypatch):
    """`ExpertPaths.choose` decides each choice count once; a new plan (`use_plan`), new
    weights (`invalidate`) or moving the module (`_apply`) makes the paths again."""
    ex = make_experts(64, 96, 4, "mxfp4", seed=2)
    weights, ids = routing(4, 4, 2, seed=3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    calls = []
    real = moe_mod.ExpertPaths.choose
    monkeypatch.setattr(moe_mod.ExpertPaths, "choose",
                        staticmethod(lambda *a, **kw: calls.append(a[2]) or real(*a, **kw)))
    first = ex(x, weights, ids)
    assert torch.equal(ex(x, weights, ids), first) and calls == [8]
    ex(x[:1], weights[:1], ids[:1])
    assert calls == [8, 2]
    ex.use_plan(dataclasses.replace(ex.plan, moe="torch"))    # a new plan: decided again
    assert torch.equal(ex(x, weights, ids), ex.forward_torch(x, weights, ids))
    assert calls == [8, 2, 8]
    ex.down = random_mxfp4(4, 64, 96, torch.Generator().manual_seed(5))     # new weights
    ex.invalidate()
    ex(x, weights, ids)
    ex.to("cpu")                                               # moved (`_apply`)
    ex(x, weights, ids)
    assert calls == [8, 2, 8, 8, 8]


def test_the_paths_hold_no_reference_to_their_experts(isas):
    """A dropped layer is freed at once (no reference cycle through its paths)."""
    import weakref
    ex = make_experts(40, 56, 5, "bf16", seed=1)
    weights, ids = routing(3, 5, 2, seed=1)
    ex(torch.randn(3, 40).bfloat16(), weights, ids)
    assert ex._paths is not None
    alive = weakref.ref(ex)
    del ex
    assert alive() is None
