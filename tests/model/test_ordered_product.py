"""The ordered product (`dense_ordered_linear` / `dense_ordered_argmax`, layers/ordered.py)
and the one-row greedy LM head (`dense_linear_argmax`): the kernels compute the documented
order exactly, their argmax forms answer as argmax_rows does, and the LM head's outputs are
the reference path's bits whichever path runs."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.sampler import argmax_rows
from kvrelay.model import execution_plan, kernels
from kvrelay.model.layers import ordered
from kvrelay.model.layers.embedding import ParallelLMHead
from kvrelay.model.layers.linear import fp32_product, linear
from kvrelay.model.layers.ordered import MAX_K, OrderedProduct
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import isa_params

pytestmark = pytest.mark.skipif(not kernels.status().available,
                                reason="the native kernels cannot be built here")

ISAS = isa_params("dense")
OPS = torch.ops.kvrelay_kernels


def _f32(v: Fraction) -> np.float32:
    """v rounded to the nearest float32, ties to even."""
    c = np.float32(float(v))
    best = None
    for d in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        err = abs(Fraction(float(d)) - v)
        if (best is None or err < best[0]
                or (err == best[0] and int(np.array(d).view(np.int32)) % 2 == 0)):
            best = (err, d)
    return best[1]


def _fma_chains(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), each fma rounded
    once, in exact arithmetic."""
    xs, ws = x.double().tolist(), w.double().tolist()
    out = np.zeros((len(xs), len(ws)), dtype=np.float32)
    for m, xr in enumerate(xs):
        for n, wr in enumerate(ws):
            acc = np.float32(0.0)
            for a, b in zip(xr, wr):
                acc = _f32(Fraction(a) * Fraction(b) + Fraction(float(acc)))
            out[m, n] = acc
    return torch.from_numpy(out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 5, 3), (3, 17, 9), (9, 33, 7), (5, 16, 1)])
def test_every_output_is_one_fma_chain_in_k_order(isa, wdtype, m, n, k):
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(wdtype)
    packed = ordered.pack(w)
    assert packed.shape == (-(-n // 16), k, 16)
    want = _fma_chains(x, w.float())
    raw = OPS.dense_ordered_linear(x, packed, n, False, isa=isa)
    assert torch.equal(_bits(raw), _bits(want))
    rounded = OPS.dense_ordered_linear(x, packed, n, True, isa=isa)
    assert torch.equal(_bits(rounded), _bits(want.bfloat16().float()))


def _blocked_chains(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                    kc: int) -> torch.Tensor:
    """((b + chain_0) + chain_1) + ... (without a bias: chain_0 + chain_1 + ...), each
    chain the fma chain of one k block from 0, each addition rounded once."""
    k = x.shape[1]
    parts = [_fma_chains(x[:, k0:k0 + kc], w[:, k0:k0 + kc]) for k0 in range(0, k, kc)]
    total = parts[0] if bias is None else None
    rest = parts[1:] if bias is None else parts
    out = np.zeros(parts[0].shape, dtype=np.float32)
    for m in range(out.shape[0]):
        for n in range(out.shape[1]):
            acc = (np.float32(total[m, n]) if total is not None
                   else np.float32(bias[n].item()))
            for part in rest:
                acc = _f32(Fraction(float(acc)) + Fraction(float(part[m, n])))
            out[m, n] = acc
    return torch.from_numpy(out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m,n,k,kc", [(3, 17, 9, 4), (5, 20, 12, 5), (9, 33, 6, 6), (2, 3, 7, 3)])
def test_k_blocks_and_bias_are_added_in_order(isa, with_bias, m, n, k, kc):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if with_bias else None
    packed = ordered.pack(w)
    padded = None
    if b is not None:
        padded = torch.zeros(packed.shape[0] * 16)
        padded[:n] = b
    got = OPS.dense_ordered_linear(x, packed, n, False, padded, kc, isa=isa)
    assert torch.equal(_bits(got), _bits(_blocked_chains(x, w.float(), b, kc)))
    assert ordered.block_size(256) == 128 and ordered.block_size(576) == 192
    assert ordered.block_size(32) == 32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_bf16_x_gives_the_rounded_outputs_in_bf16(isa, with_bias):
    """A projection's bf16 input goes in as it is: the kernel widens it, and its bf16
    outputs are the float32 form's rounded ones (`.to(torch.bfloat16)` of them, bit for bit);
    the greedy form reads it alike."""
    g = torch.Generator().manual_seed(5)
    m, n, k, kc = 7, 37, 24, 12
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = ordered.pack(torch.randn(n, k, generator=g).bfloat16())
    bias = torch.randn(packed.shape[0] * 16, generator=g) if with_bias else None
    got = OPS.dense_ordered_linear(x, packed, n, False, bias, kc, isa=isa)
    want = OPS.dense_ordered_linear(x.float(), packed, n, True, bias, kc, isa=isa)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16()) and torch.equal(got.float(), want)
    if not with_bias:
        assert torch.equal(OPS.dense_ordered_argmax(x, packed, n, True, isa),
                           OPS.dense_ordered_argmax(x.float(), packed, n, True, isa))


def _tied_operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of few distinct values (many equal outputs: the ties argmax must break)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (m, k), generator=g).float()
    w = torch.randint(-2, 3, (n, k), generator=g).float()
    return x, w


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_argmax_forms_answer_as_argmax_rows(isa, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [(m, n, k, s) for s, (m, n, k) in enumerate(
            [(1, 201, 32), (3, 5000, 16), (8, 40000, 8), (17, 31, 5), (4, 1, 4)])]
        for m, n, k, seed in cases:
            for tied in (False, True):
                if tied:
                    x, w = _tied_operands(m, n, k, seed)
                else:
                    g = torch.Generator().manual_seed(seed)
                    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
                for wdtype in (torch.bfloat16, torch.float32):
                    packed = ordered.pack(w.to(wdtype))
                    for rnd in (False, True):
                        rows = OPS.dense_ordered_linear(x, packed, n, rnd, isa=isa)
                        got = OPS.dense_ordered_argmax(x, packed, n, rnd, isa)
                        assert torch.equal(got, argmax_rows(rows)), (m, n, k, tied, wdtype, rnd)
                    one = x[:1].to(wdtype)
                    row = OPS.dense_linear(one, w.to(wdtype), None, isa).float()
                    assert torch.equal(OPS.dense_linear_argmax(one, w.to(wdtype), isa),
                                       argmax_rows(row))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
def test_argmax_of_nan_and_infinite_rows(isa):
    """A row's first NaN, the first of equal maxima, 0 for a row of -inf — as argmax_rows."""
    w = torch.cat([torch.ones(40, 2), torch.full((3, 2), 2.0), torch.tensor([[float("nan"), 0]]),
                   torch.full((20, 2), 2.0), torch.full((30, 2), -float("inf"))])
    x = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [-float("inf"), 0.0], [0.0, 1.0],
                      [float("inf"), 0.0], [-1.0, 0.0]])
    for wdtype in (torch.bfloat16, torch.float32):
        packed = ordered.pack(w.to(wdtype))
        for rnd in (False, True):
            rows = OPS.dense_ordered_linear(x, packed, w.shape[0], rnd, isa=isa)
            assert torch.equal(OPS.dense_ordered_argmax(x, packed, w.shape[0], rnd, isa),
                               argmax_rows(rows))
        for i in range(x.shape[0]):
            one = x[i:i + 1].to(wdtype)
            row = OPS.dense_linear(one, w.to(wdtype), None, isa).float()
            assert torch.equal(OPS.dense_linear_argmax(one, w.to(wdtype), isa),
                               argmax_rows(row))


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 32, generator=g), torch.randn(20000, 32, generator=g).bfloat16()
    packed = ordered.pack(w)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append((OPS.dense_ordered_linear(x, packed, 20000, True),
                         OPS.dense_ordered_argmax(x, packed, 20000, True, ""),
                         OPS.dense_linear_argmax(x[:1].bfloat16(), w, "")))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _head(vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, ParallelContext(), dtype, execution_plan.current())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
    return head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_lm_head_gives_the_reference_bits_whichever_path_runs(dtype):
    """`logits` is `forward(...).float()` bit for bit and `greedy` its argmax_rows, for
    every row count and thread count (the ordered kernel only where it was checked equal)."""
    head = _head(3001, 32, dtype)
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 4, 5, 7, 8, 9, 16, 33):
                for _ in range(2):
                    x = torch.randn(m, 32, generator=g).to(dtype)
                    ref = head(x).float()
                    assert torch.equal(_bits(head.logits(x)), _bits(ref))
                    ids = head.greedy(x)
                    assert ids is None or torch.equal(ids, argmax_rows(ref))
    finally:
        torch.set_num_threads(before)


def test_a_kernel_that_differs_from_the_reference_is_not_used(monkeypatch):
    """The check is what guards the bits: a kernel one ulp off for some key is never used
    for it, and the reference answers."""
    head = _head(500, 16, torch.bfloat16)
    head.plan = dataclasses.replace(head.plan, screened_head=False)   # the ordered kernel alone
    real = ordered._op()
    assert real is not None

    def off_by_one_ulp(x, packed, n, rnd, bias=None, kc=0):
        y = real(x, packed, n, rnd, bias, kc)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(ordered, "_op", lambda name="dense_ordered_linear": (
        off_by_one_ulp if name == "dense_ordered_linear" else None))
    x = torch.randn(8, 16).bfloat16()
    plan = head.plan
    ref = linear(x, head.weight, None, plan).float()
    for _ in range(3):
        assert torch.equal(_bits(head.logits(x)), _bits(ref))
    if fp32_product(x, head.weight, plan):
        assert list(head.ordered.verdicts.values()) == [False]
    assert head.greedy(x) is None


def test_fp32_product_is_where_linear_computes_torchs_fp32_gemm():
    plan = execution_plan.current()
    w16, w32 = torch.randn(100, 8).bfloat16(), torch.randn(100, 8)
    for m in (1, 4, 9, 64):
        x16, x32 = torch.randn(m, 8).bfloat16(), torch.randn(m, 8)
        if fp32_product(x32, w32, plan):
            assert torch.equal(linear(x32, w32, None, plan), F.linear(x32, w32))
        if fp32_product(x16, w16, plan):
            assert torch.equal(linear(x16, w16, None, plan),
                               F.linear(x16.float(), w16.float()).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_projections_give_the_reference_bits_whichever_path_runs(dtype):
    """QKV and o_proj (a bias, K in two blocks) through `_ordered_linear` are `linear`."""
    from kvrelay.model.layers.linear import QKVParallelLinear, RowParallelLinear
    plan = execution_plan.current()
    qkv = QKVParallelLinear(32, 64, 4, 2, ParallelContext(), dtype, plan)
    o_proj = RowParallelLinear(256, 32, ParallelContext(), dtype, plan=plan)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t in (qkv.weight, qkv.bias, o_proj.weight, o_proj.bias):
            t.copy_(torch.randn(t.shape, generator=g))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 4, 5, 8, 9, 16, 64, 65):
                for _ in range(2):
                    x = torch.randn(m, 32, generator=g).to(dtype)
                    q, k, v = qkv(x)
                    ref = linear(x, qkv.weight, qkv.bias, plan)
                    assert torch.equal(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1),
                                       ref)
                    h = torch.randn(m, 256, generator=g).to(dtype)
                    assert torch.equal(o_proj(h), linear(h, o_proj.weight, o_proj.bias, plan))
    finally:
        torch.set_num_threads(before)


def test_checked_decides_the_verdict_a_first_call_would():
    """`checked` (the decode stack's question, asked before any real input) agrees with the
    verdict a first real call decides, per row count and thread count."""
    plan = execution_plan.current()
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 5, 8, 9, 16):
                asked, called = OrderedProduct(w, b), OrderedProduct(w, b)
                x = torch.randn(m, 40, generator=g).bfloat16()
                called.linear(x, plan)
                key = (m, threads, plan)
                assert asked.checked(m, plan) == called.verdicts.get(key, False)
    finally:
        torch.set_num_threads(before)


def test_operands_are_held_until_the_weight_changes():
    plan = execution_plan.current()
    w = torch.randn(40, 16).bfloat16()
    product = OrderedProduct(w, torch.zeros(40).bfloat16())
    operands = product.operands(plan)
    if plan.dense is None:
        assert operands is None
        return
    assert operands is not None
    packed, packed_bias, kc = operands
    assert packed.shape == (3, 16, 16) and packed_bias is not None and kc == 16
    assert product.holds(packed) and product.operands(plan)[0] is packed
    w.mul_(2)
    assert not product.holds(packed)                       # changed, not packed again yet
    again = product.operands(plan)[0]
    assert again is not packed and product.holds(again) and not product.holds(packed)
    assert torch.equal(again, ordered.pack(w))
    assert OrderedProduct(torch.randn(4, MAX_K + 1)).operands(plan) is None   # too deep


def test_a_weight_changed_in_place_is_packed_and_checked_again():
    head = _head(700, 16, torch.bfloat16)
    x = torch.randn(8, 16).bfloat16()
    for _ in range(2):
        head.logits(x)
    with torch.no_grad():
        head.weight.mul_(-1.5)
    for _ in range(2):
        assert torch.equal(_bits(head.logits(x)), _bits(head(x).float()))
        ids = head.greedy(x)
        assert ids is None or torch.equal(ids, argmax_rows(head(x).float()))
