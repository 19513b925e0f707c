"""The AVX512-BF16 expert tiles (`kvrelay_kernels::moe_tiles`, layers/moe_tiles.py)
against a float32 reference of the same bf16 computation, on odd shapes: hidden and
intermediate not multiples of 16 or 32 (bf16), 1 to 300 rows per expert (token blocks
of 16 and 32 and their tails), experts without tokens, top-1/2/3, choices of other
ranks' experts, MXFP4 weights decoded to bf16 (exactly), and the dispatch from
`Experts.forward` / `Experts.decode`."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.model import execution_plan, kernels, mxfp4
from kvrelay.model.layers import moe_tiles
from kvrelay.model.layers.moe import ExpertPaths, Experts
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import skip_unless_runs


def _tiles_take(ex: Experts, x: torch.Tensor, choices: int) -> bool:
    """Whether `ex` runs a call of `choices` (token, expert) pairs on x on the tiles."""
    return ExpertPaths.tiles_take(ex, x, choices, False)

ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module", autouse=True)
def tiles() -> None:
    if kernels.compiler() is None or not kernels.status().available:
        pytest.skip("the native kernels are not built here")
    skip_unless_runs("moe_tile", "avx512_bf16")     # the family's only build
    assert list(torch.ops.kvrelay_kernels.moe_tile_isas()) == ["avx512_bf16"]


def reference(x, w, ids, first, gate_up, gate_up_bias, down, down_bias):
    """The same computation in float64 from the bf16 values (the kernel's products are
    exact: its swiglu output enters the down projection as three bf16 parts summing to
    the f32 value), and beside each output the sum of its terms' magnitudes: the scale of
    the fp32 rounding any implementation carries, which a cancelling sum (experts of
    ±300 adding up to 0.004) cannot shed."""
    T, k = ids.shape
    E = gate_up.shape[0]
    out, mag = torch.zeros(T, x.shape[1], dtype=torch.float64), torch.zeros(T, x.shape[1],
                                                                            dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - first
            if not 0 <= e < E:
                continue
            h = gate_up[e].double() @ x[t].double() + gate_up_bias[e].double()
            gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
            act = (up + 1) * gate * torch.sigmoid(gate * ALPHA)
            y = down[e].double() @ act
            terms = down[e].double().abs() @ act.abs()
            if down_bias is not None:
                y, terms = y + down_bias[e].double(), terms + down_bias[e].double().abs()
            out[t] += y * float(w[t, j])
            mag[t] += terms * abs(float(w[t, j]))
    return out, mag


def assert_bf16_close(y: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Within the output's one bf16 rounding (1/256 of it, doubled for a value next to a
    rounding boundary) plus the fp32 rounding of its terms: 2^-20 of their magnitudes,
    16x the one-ulp error a cancelling fp32 sum shows (measured on an Intel AVX-512 CPU:
    4.8e-5 at a sum of 0.0045 whose terms reach 675, i.e. 2^-23.8 of them). A wrong
    weight, row or routing weight is off by a whole term."""
    value, mag = ref
    assert y.dtype == torch.bfloat16
    err = (y.double() - value).abs()
    allowed = value.abs() / 128 + 1e-5 + mag * 2.0**-20
    worst = int((err - allowed).argmax())
    assert bool((err <= allowed).all()), (
        f"{int((err > allowed).sum())} of {err.numel()} outputs off; worst at "
        f"{divmod(worst, y.shape[1])}: {float(y.flatten()[worst])} vs "
        f"{float(value.flatten()[worst])} (terms {float(mag.flatten()[worst])})")


def routing(T: int, E: int, k: int, g: torch.Generator, skew: bool = False):
    if skew:        # most tokens on expert 0, one expert never chosen
        ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 2, generator=g)[
            :k - 1]]) for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return torch.rand(T, k, generator=g), ids.long()


@pytest.mark.parametrize("T,H,I,E,k,skew", [
    (1, 64, 64, 4, 2, False), (37, 70, 46, 5, 2, False), (3, 18, 34, 3, 3, False),
    (130, 96, 64, 4, 1, False), (300, 128, 128, 8, 2, True), (64, 128, 128, 8, 2, False),
])
def test_bf16_tiles_match_reference(T, H, I, E, k, skew):  # noqa: E741 -- I: shapes
    g = torch.Generator().manual_seed(T * 7 + H)
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    gub, db = torch.randn(E, 2 * I, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3
    w, ids = routing(T, E, k, g, skew)
    y = torch.ops.kvrelay_kernels.moe_tiles(x, w, ids, 0, gate_up, None, gub, down, None, db,
                                            ALPHA, LIMIT)
    assert_bf16_close(y, reference(x, w, ids, 0, gate_up, gub, down, db))


@pytest.mark.parametrize("T,H,I", [(45, 64, 96), (200, 128, 128), (17, 32, 32)])
def test_mxfp4_tiles_match_reference_on_decoded_weights(T, H, I):  # noqa: E741
    g = torch.Generator().manual_seed(T)
    E, k = 6, 2
    gate_up, down = (mxfp4.MXFP4Tensor(
        torch.randint(0, 256, (E, r, c // 32, 16), dtype=torch.uint8, generator=g),
        torch.randint(118, 130, (E, r, c // 32), dtype=torch.uint8, generator=g))
        for r, c in ((2 * I, H), (H, I)))
    x = torch.randn(T, H, generator=g).bfloat16()
    gub, db = torch.randn(E, 2 * I, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3
    w, ids = routing(T, E, k, g)
    y = torch.ops.kvrelay_kernels.moe_tiles(x, w, ids, 0, gate_up.blocks, gate_up.scales, gub,
                                            down.blocks, down.scales, db, ALPHA, LIMIT)
    dense = [torch.stack([t.expert(e, torch.bfloat16) for e in range(E)])
             for t in (gate_up, down)]
    assert_bf16_close(y, reference(x, w, ids, 0, dense[0], gub, dense[1], db))


def test_choices_of_other_ranks_are_skipped_and_unchosen_tokens_are_zero():
    g = torch.Generator().manual_seed(3)
    T, H, I, E, k, first = 50, 64, 32, 4, 2, 4  # noqa: E741 -- rank 1: experts 4-7 of 12
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    gub, db = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    w, ids = routing(T, 12, k, g)
    ids[:5] = torch.tensor([0, 11])                    # tokens with no local choice at all
    y = torch.ops.kvrelay_kernels.moe_tiles(x, w, ids, first, gate_up, None, gub, down, None,
                                            db, ALPHA, LIMIT)
    assert torch.equal(y[:5], torch.zeros(5, H, dtype=torch.bfloat16))
    assert_bf16_close(y, reference(x, w, ids, first, gate_up, gub, down, db))


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(5)
    T, H, I, E, k = 700, 96, 160, 8, 2  # noqa: E741 -- I as in the shape notation
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    gub, db = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    w, ids = routing(T, E, k, g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.ops.kvrelay_kernels.moe_tiles(x, w, ids, 0, gate_up, None, gub,
                                                            down, None, db, ALPHA, LIMIT))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def experts(storage: str, H: int = 64, I: int = 96, E: int = 4) -> Experts:  # noqa: E741
    g = torch.Generator().manual_seed(11)
    ex = Experts(H, I, E, ParallelContext(), torch.bfloat16, ALPHA, LIMIT, storage == "mxfp4")
    ex.gate_up_bias.copy_(torch.randn(ex.gate_up_bias.shape, generator=g) * 0.3)
    ex.down_bias.copy_(torch.randn(ex.down_bias.shape, generator=g) * 0.3)
    if storage == "mxfp4":
        ex.gate_up, ex.down = (mxfp4.MXFP4Tensor(
            torch.randint(0, 256, (E, r, c // 32, 16), dtype=torch.uint8, generator=g),
            torch.randint(120, 128, (E, r, c // 32), dtype=torch.uint8, generator=g))
            for r, c in ((2 * I, H), (H, I)))
        ex.invalidate()
    else:
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) * 0.2)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) * 0.2)
    return ex


@pytest.fixture
def half_matmuls(monkeypatch):
    """Plan the CPU's half-precision matmuls as `mode` (native | fp32) for one test; the
    experts given follow the new plan."""
    def pin(mode: str, *experts: Experts) -> None:
        monkeypatch.setenv("KVRELAY_CPU_HALF_MATMUL", mode)
        execution_plan.current.cache_clear()
        for ex in experts:
            ex.use_plan(execution_plan.current())
    yield pin
    execution_plan.current.cache_clear()


@pytest.mark.parametrize("storage", ["bf16", "mxfp4"])
def test_experts_take_the_tiles_from_enough_rows_per_expert(storage, monkeypatch, half_matmuls):
    half_matmuls("native")
    ex = experts(storage)
    g = torch.Generator().manual_seed(2)
    T = 64                                              # 32 rows per expert
    x = torch.randn(T, ex.hidden, generator=g).bfloat16()
    w, ids = routing(T, ex.num_local, 2, g)
    calls = []
    real = moe_tiles.forward
    monkeypatch.setattr(moe_tiles, "forward", lambda *a: calls.append(1) or real(*a))
    y = ex.forward(x, w, ids)
    assert calls and torch.equal(ex(x, w, ids), y)            # the kept choice: the same op
    assert len(calls) == 2
    # the bf16 torch path (the reference, bf16 matmul outputs and swiglu) agrees up to its
    # own roundings; the kernel's fp32 reference up to the summation order
    ref = ex.forward_torch(x, w, ids).float()
    assert (y.float() - ref).norm() < 0.01 * ref.norm()
    dense = [t.detach() if isinstance(t, torch.Tensor) else torch.stack(
        [t.expert(e, torch.bfloat16) for e in range(ex.num_local)]) for t in (ex.gate_up, ex.down)]
    assert_bf16_close(y, reference(x, w, ids, 0, dense[0], ex.gate_up_bias.float(), dense[1],
                                   ex.down_bias.float()))
    assert not _tiles_take(ex, x[:2], 4)                  # 1 row per expert: not taken
    assert not _tiles_take(ex, x.float(), ids.numel())    # fp32 activations: not taken
    monkeypatch.setenv("KVRELAY_MOE_KERNEL", "native")
    execution_plan.current.cache_clear()
    ex.use_plan(execution_plan.current())
    assert not _tiles_take(ex, x, ids.numel())            # an explicit kernel choice wins


def test_no_tiles_for_bf16_experts_where_bf16_measured_slower_than_fp32(monkeypatch,
                                                                        half_matmuls):
    """The tiles are the CPU's bf16 dot products: where its bf16 GEMM lost to fp32 compute
    (the execution plan's matmul "fp32"), bf16 experts take torch's fp32 GEMMs
    from the rows `linear` upcasts from; MXFP4 experts keep the tiles (their other paths
    decode the weights first)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 64, generator=g).bfloat16()
    w, ids = routing(64, 4, 2, g)
    half_matmuls("fp32")
    assert _tiles_take(experts("mxfp4"), x, ids.numel())
    ex = experts("bf16")
    half_matmuls("native", ex)
    assert _tiles_take(ex, x, ids.numel())
    half_matmuls("fp32", ex)
    assert not _tiles_take(ex, x, ids.numel())          # 32 rows an expert, upcast from 4
    # fewer rows per expert than `linear` upcasts from: torch would run bf16, the tiles stay
    fp32 = ex.plan
    ex.use_plan(dataclasses.replace(fp32, upcast_min_rows=33))
    assert _tiles_take(ex, x, ids.numel())
    ex.use_plan(dataclasses.replace(fp32, upcast_min_rows=32))
    assert not _tiles_take(ex, x, ids.numel())
    ex.use_plan(fp32)
    calls = []
    real = moe_tiles.forward
    monkeypatch.setattr(moe_tiles, "forward", lambda *a: calls.append(1) or real(*a))
    y = ex.forward(x, w, ids)
    assert not calls
    ref = ex.forward_torch(x, w, ids).float()
    assert (y.float() - ref).norm() < 0.01 * ref.norm()
