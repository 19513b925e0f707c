"""The native decode-sized dense kernels (`dense_linear`, `rms_norm`, `add_rms_norm`) against
the PyTorch reference paths, for every ISA build this CPU runs, and their dispatch."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model import execution_plan, kernels
from kvrelay.model.layers import linear as L
from kvrelay.model.layers import norm as N
from tests.kernel_isas import isa_params

pytestmark = pytest.mark.skipif(not kernels.status().available,
                                reason="the native kernels cannot be built here")

ISAS = isa_params("dense")
# K and N off every vector width (16 fp32 / 32 bf16 lanes, the 8-column work items)
SHAPES = [(37, 45), (130, 67), (9, 100), (96, 576)]


@pytest.fixture
def dense_mode(monkeypatch):
    def set_mode(value: str) -> None:
        monkeypatch.setenv("KVRELAY_DENSE_KERNEL", value)
        execution_plan.current.cache_clear()
    yield set_mode
    monkeypatch.delenv("KVRELAY_DENSE_KERNEL", raising=False)
    execution_plan.current.cache_clear()


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x·Wᵀ + b of the (already rounded) operands in float64."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_linear_matches_torch(isa, dtype, m, with_bias):
    for seed, (n, k) in enumerate(SHAPES):
        x, w, b = _operands(m, n, k, dtype, seed)
        bias = b if with_bias else None
        out = torch.ops.kvrelay_kernels.dense_linear(x, w, bias, isa)
        assert out.dtype == dtype and out.shape == (m, n)
        exact = _exact(x, w, bias)
        # fp32 accumulation (order aside) rounded once to the output dtype: within one
        # rounding of the exact result, like torch's own F.linear
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
            torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        else:
            torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-4 * k ** 0.5)
            ref = F.linear(x, w, bias)
            torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


# (N, K) for every row count 1..16: N tails of the 8-row stream blocks and 4-row tiles, K
# tails of every vector width (8/16 fp32 lanes, 32 bf16 pairs) and of the 4-vector stream
# step (K = 130: 4 x 32 + 2), one K below a single vector
ODD_SHAPES = [(7, 130), (13, 97), (21, 33), (5, 20), (3, 161)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_every_row_count_on_odd_shapes(isa, dtype):
    tol = dict(rtol=2 ** -8, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5,
                                                                             atol=1e-4)
    for m in range(1, 17):
        for seed, (n, k) in enumerate(ODD_SHAPES):
            x, w, b = _operands(m, n, k, dtype, seed=100 * m + seed)
            bias = b if (m + seed) % 2 else None
            out = torch.ops.kvrelay_kernels.dense_linear(x, w, bias, isa)
            assert out.shape == (m, n) and out.dtype == dtype
            torch.testing.assert_close(out.double(), _exact(x, w, bias), **tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_same_bits_on_one_and_two_threads(isa, m, dtype):
    """Large enough for the op to split the rows over threads (and for the stream and tile
    paths to stop prefetching at a thread's range end): the split never changes a result.
    4.5 / 9 MB of weights: the threads take 1 MiB chunks (59 / 29 work items of 8 rows),
    the last one partial, so chunks of both threads interleave through the matrix."""
    x, w, b = _operands(m, 2053, 1100, dtype, seed=m)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.kvrelay_kernels.dense_linear(x, w, b, isa)
        torch.set_num_threads(2)
        two = torch.ops.kvrelay_kernels.dense_linear(x, w, b, isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), _exact(x, w, b), rtol=2 ** -8, atol=1e-2)


# Decode-sized matrices between the stream split's 256 KiB and the 4 MiB of one thread's
# share: two threads, each matrix cut into 4 pieces (items of 8 weight rows, N off them)
SPLIT_SHAPES = [(299, 577), (961, 576), (203, 700)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_stream_split_same_bits_on_one_and_two_threads(isa, m, dtype):
    """Small decode matrices (the embedded model's qkv / o_proj) are split over two threads
    in continuous pieces: every output equals the one-thread result bit for bit, and the
    reference within one rounding (5 rows: the tile path, split by work items the same way)."""
    threads = torch.get_num_threads()
    for seed, (n, k) in enumerate(SPLIT_SHAPES):
        x, w, b = _operands(m, n, k, dtype, seed=31 * m + seed)
        bias = b if seed % 2 else None
        try:
            torch.set_num_threads(1)
            one = torch.ops.kvrelay_kernels.dense_linear(x, w, bias, isa)
            torch.set_num_threads(2)
            two = [torch.ops.kvrelay_kernels.dense_linear(x, w, bias, isa) for _ in range(3)]
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(one, t) for t in two)
        torch.testing.assert_close(one.double(), _exact(x, w, bias), rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_dense_linear_row_result_does_not_depend_on_its_neighbours(isa, m):
    """3-4 input rows read weight rows in pairs (an odd last row alone): dropping the first
    weight row re-pairs every other row, and no result may change by a bit (the decode
    result of a weight row must not depend on the matrix around it or on the split)."""
    x, w, _ = _operands(m, 41, 1000, torch.bfloat16, seed=7 + m)    # K tail of 8 lanes
    full = torch.ops.kvrelay_kernels.dense_linear(x, w, None, isa)
    shifted = torch.ops.kvrelay_kernels.dense_linear(x, w[1:].contiguous(), None, isa)
    alone = torch.ops.kvrelay_kernels.dense_linear(x, w[-1:].contiguous(), None, isa)
    assert torch.equal(full[:, 1:], shifted)
    assert torch.equal(full[:, -1:], alone)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 6])
def test_dense_linear_rounds_and_propagates_like_torch(isa, m):
    """bf16 outputs are the fp32 sums rounded to nearest even (the vector stores of 4
    outputs included), inf and NaN kept: a weight row of inf gives inf, one with a NaN
    gives NaN, and a sum halfway between two bf16 values rounds to the even one."""
    k, n = 64, 12
    x = torch.ones(m, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[0, 0] = float("inf")
    w[1, 5] = float("nan")
    w[2, 0], w[2, 1] = 1.0, 2.0 ** -8      # 1 + 2^-8: halfway, rounds down to 1 (even)
    w[3, 0], w[3, 1] = 1.0 + 2.0 ** -7, 2.0 ** -8   # halfway, rounds up to 1 + 2^-6
    w[4, 0] = -3.0
    out = torch.ops.kvrelay_kernels.dense_linear(x, w, None, isa)
    assert torch.isinf(out[:, 0]).all() and (out[:, 0] > 0).all()
    assert torch.isnan(out[:, 1]).all()
    assert (out[:, 2] == 1.0).all()
    assert (out[:, 3] == 1.0 + 2.0 ** -6).all()
    assert (out[:, 4] == -3.0).all() and (out[:, 5:] == 0).all()


@pytest.mark.parametrize("isa", ISAS)
def test_dense_linear_takes_strided_rows_and_fp32_bias(isa):
    x, w, b = _operands(4, 37, 45, torch.bfloat16, seed=7)
    wide = torch.zeros(4, 64, dtype=torch.bfloat16)
    wide[:, :45] = x
    out = torch.ops.kvrelay_kernels.dense_linear(wide[:, :45], w, b.float(), isa)
    torch.testing.assert_close(out.double(), _exact(x, w, b.float()), rtol=2 ** -8, atol=1e-3)


def test_dense_linear_rejects_mismatched_shapes():
    x, w, _ = _operands(2, 8, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="dense_linear"):
        torch.ops.kvrelay_kernels.dense_linear(x, w[:, :15].contiguous(), None, "")
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.kvrelay_kernels.dense_linear(x, w, torch.zeros(7), "")


def test_linear_dispatches_decode_rows_to_the_kernel(dense_mode):
    dense_mode("auto")
    isa = L.dense_kernel_isa()
    if isa is None:
        pytest.skip("only the generic dense build runs on this CPU")
    x, w, b = _operands(40, 96, 64, torch.bfloat16, seed=3)
    limit = L.DENSE_MAX_ROWS[isa][torch.bfloat16]
    assert L.runs_on_dense_kernel(x[:1], w) and L.runs_on_dense_kernel(x[:limit], w)
    # past the row limit only a call within the small-call budget keeps the kernel
    big = torch.zeros(L.DENSE_SMALL_CALL_MACS.get(isa, 0) // limit + 1, 64, dtype=torch.bfloat16)
    assert L.runs_on_dense_kernel(x[:limit], big) and not L.runs_on_dense_kernel(x[:limit + 1], big)
    # the kernel's result (not torch's) comes back for decode rows
    kernel = torch.ops.kvrelay_kernels.dense_linear(x[:1], w, b, "")
    assert torch.equal(L.linear(x[:1], w, b), kernel)
    dense_mode("torch")
    assert L.dense_kernel_isa() is None and not L.runs_on_dense_kernel(x[:1], w)
    assert torch.equal(L.linear(x[:1], w, b), F.linear(x[:1], w, b))


def test_small_calls_take_the_kernel_at_any_row_count(dense_mode):
    dense_mode("auto")
    isa = L.dense_kernel_isa()
    budget = L.DENSE_SMALL_CALL_MACS.get(isa or "", 0)
    if not budget:
        pytest.skip("no small-call budget for this CPU's dense variant")
    limit = L.DENSE_MAX_ROWS[isa][torch.bfloat16]
    w = torch.zeros(256, 128, dtype=torch.bfloat16)          # the tiny model's qkv
    rows = budget // w.numel()
    assert rows > limit
    x, wide = torch.zeros(rows + 1, 128, dtype=torch.bfloat16), torch.zeros(8, L.WIDE_K)
    assert L.runs_on_dense_kernel(x[:rows], w) and not L.runs_on_dense_kernel(x, w)
    assert L.runs_on_dense_kernel(torch.zeros(rows, L.WIDE_K), wide)   # however wide, if small
    assert not L.runs_on_dense_kernel(x[:rows].float(), w)              # dtypes must still agree
    # and the kernel's result comes back, equal to torch's to bf16 rounding
    x, w, b = _operands(rows, 256, 128, torch.bfloat16, seed=5)
    kernel = torch.ops.kvrelay_kernels.dense_linear(x, w, b, "")
    assert torch.equal(L.linear(x, w, b), kernel)
    torch.testing.assert_close(kernel.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


def test_wide_matmuls_keep_the_kernel_for_fewer_rows(dense_mode):
    dense_mode("auto")
    isa = L.dense_kernel_isa()
    if isa is None:
        pytest.skip("only the generic dense build runs on this CPU")
    limit = L.DENSE_MAX_ROWS[isa][torch.bfloat16]
    wide = min(limit, L.WIDE_MAX_ROWS)
    w = torch.zeros(1024, L.WIDE_K, dtype=torch.bfloat16)    # past the small-call budget
    x = torch.zeros(limit + 1, L.WIDE_K, dtype=torch.bfloat16)
    assert L.runs_on_dense_kernel(x[:wide], w) and not L.runs_on_dense_kernel(x[:wide + 1], w)
    narrow = torch.zeros(limit, L.WIDE_K - 1, dtype=torch.bfloat16)
    assert L.runs_on_dense_kernel(narrow, w[:, :-1])       # below WIDE_K the ISA's own limit holds


def test_bad_dense_mode_names_the_variable(dense_mode):
    dense_mode("fast")
    with pytest.raises(ValueError, match=r"KVRELAY_DENSE_KERNEL.*auto or torch"):
        L.dense_kernel_isa()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("hidden", [45, 576])
def test_native_norms_match_the_reference(dense_mode, dtype, m, hidden):
    dense_mode("auto")
    if N._native_ops() is None:
        pytest.skip("the native norm is off on this CPU")
    g = torch.Generator().manual_seed(m * hidden)
    norm = N.RMSNorm(hidden, eps=1e-5)
    norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    x = (torch.randn(m, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(m, hidden, generator=g).to(dtype)
    tol = dict(rtol=2 ** -7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5,
                                                                             atol=1e-6)
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm.reference(x), **tol)
    h, normed = norm.add_forward(x, delta)
    assert torch.equal(h, x + delta)          # the residual rounds exactly as torch's add
    torch.testing.assert_close(normed, norm.reference(x + delta), **tol)
    norm.plan = dataclasses.replace(norm.plan, dense=None)   # the reference path: same pair
    h_ref, normed_ref = norm.add_forward(x, delta)
    assert torch.equal(h_ref, h) and torch.equal(normed_ref, norm.reference(x + delta))


def test_norms_of_many_rows_keep_torch(dense_mode):
    dense_mode("auto")
    norm = N.RMSNorm(16)
    x = torch.randn(N.NATIVE_MAX_ROWS + 1, 16)
    assert norm._ops(x) is None and norm._ops(x[:1]) is N._native_ops()
