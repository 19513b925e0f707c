"""The screened greedy LM head (layers/screened.py, csrc/screen*.{h,cpp}): the int8 copy
holds what the bound needs, every exact logit lies within its bounds, the candidates are
computed with the exact path's bits, and the tokens are the exact path's — on random heads,
built near-ties (exact ties, one fp32 ulp apart), rows and inputs of large dynamic range,
bf16 and fp32 inputs and weights, 1 to 16 rows — or the exact path answers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay import envs
from kvrelay.engine.sampler import argmax_rows
from kvrelay.model import execution_plan, kernels
from kvrelay.model.execution_plan import ExecutionPlan, KernelFacts, PlanConfig
from kvrelay.model.layers import ordered, screened
from kvrelay.model.layers.embedding import ParallelLMHead
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import isa_params

pytestmark = pytest.mark.skipif(not kernels.status().available,
                                reason="the native kernels cannot be built here")

ISAS = isa_params("screen")
OPS = torch.ops.kvrelay_kernels
MODES = [pytest.param(screened.DENSE, id="dense"), pytest.param(screened.ORDERED, id="ordered")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _unpacked(copy: screened.Int8Copy, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K], facts [N, 3]) in row order, from the blocked layout."""
    codes = copy.codes.permute(0, 2, 1, 3).reshape(-1, copy.codes.shape[1] * 2)
    facts = copy.facts.transpose(1, 2).reshape(-1, 3)
    return codes[:n, :k], facts[:n].double()


def _weights(n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16,
             spread: float = 0.0) -> torch.Tensor:
    """N(0, 0.02²) rows, each scaled by 10^U(-spread, spread)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if spread:
        w *= 10 ** ((torch.rand(n, 1, generator=g) * 2 - 1) * spread)
    return w.to(dtype)


def _inputs(m: int, k: int, seed: int, dtype: torch.dtype, outliers: bool = False
            ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if outliers:                       # a few features far above the rest, as hidden states have
        x[:, torch.randint(0, k, (2,), generator=g)] *= 300
    return x.to(dtype)


def _screen(x: torch.Tensor, w: torch.Tensor, mode: int, isa: str = "",
            cap: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    copy = screened.quantize(w)
    assert copy is not None
    return OPS.screen_argmax(x, copy.codes, copy.facts, w.shape[0], copy.w_max, w, mode,
                             ordered.block_size(w.shape[1]), cap, isa, "")


def _exact(x: torch.Tensor, w: torch.Tensor, mode: int) -> torch.Tensor:
    """The exact path's logits as the mode computes them, from the dense kernels' own ops."""
    if mode == screened.DENSE:
        return OPS.dense_linear(x, w, None, "").float()
    return OPS.dense_ordered_linear(x.float(), ordered.pack(w), w.shape[0],
                                    x.dtype == torch.bfloat16, None,
                                    ordered.block_size(w.shape[1]), "")


# -- the copy -------------------------------------------------------------------------------------
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_the_copy_holds_what_the_bound_needs(wdtype):
    """Codes in [-127, 127] with s · 127 >= max|w|, the residual within s/2 of each weight,
    W >= ‖w‖ and E >= ‖w - s q‖ (float64 references), zero rows past N and columns past K."""
    n, k = 1001, 33
    w = _weights(n, k, 0, wdtype, spread=20)
    w[5] = 0
    w[7, 3] = 1e4                                          # one weight far above its row
    copy = screened.quantize(w)
    assert copy is not None and copy.codes.shape == (63, 17, 16, 2)
    codes, facts = _unpacked(copy, n, k)
    s, w64 = facts[:, :1], w.double()
    residual = w64 - s * codes.double()
    assert codes.abs().max() <= 127 and bool((s * 127 >= w64.abs().amax(1, keepdim=True)).all())
    assert bool((residual.abs() <= s / 2).all())
    assert bool((facts[:, 1] >= w64.norm(dim=1)).all())
    assert bool((facts[:, 2] >= residual.norm(dim=1)).all())
    assert copy.w_max == facts[:, 1].max().item()
    padded = copy.codes.permute(0, 2, 1, 3).reshape(63 * 16, 34)
    assert not padded[n:].any() and not padded[:, k:].any() and facts[5].abs().sum() == 0


def test_a_weight_not_finite_gives_no_copy():
    for bad in (float("nan"), float("inf")):
        w = _weights(100, 8, 1)
        w[40, 2] = bad
        assert screened.quantize(w) is None


# -- the bound ------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k,m,spread,outliers", [(3001, 32, 1, 0, False), (2000, 7, 16, 0, False),
                                                   (1500, 300, 5, 4, True), (997, 64, 8, 6, True)])
def test_every_exact_logit_lies_within_its_bounds(isa, mode, n, k, m, spread, outliers):
    """lo <= L <= hi for the exact path's value before its rounding to the output dtype, for
    bf16 and fp32 inputs (the bound covers any summation order)."""
    for wdtype in (torch.bfloat16, torch.float32):
        w = _weights(n, k, n + k, wdtype, spread)
        copy = screened.quantize(w)
        assert copy is not None
        for dtype in (torch.bfloat16, torch.float32):
            x = _inputs(m, k, m, dtype, outliers)
            lo, hi = OPS.screen_bounds(x, copy.codes, copy.facts, n, isa)
            exact = OPS.screen_exact_rows(x.float(), w, mode, ordered.block_size(k), "")
            assert bool((lo <= exact).all()) and bool((exact <= hi).all()), (wdtype, dtype)
            assert bool((hi - lo > 0).all())


# -- the candidates' exact values ----------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_the_candidates_get_the_exact_paths_bits(mode, m):
    """screen_exact_rows (rows packed or gathered as candidates are) is the dense kernels'
    full output, bit for bit, at every row (a vocabulary not a multiple of 4 or 16)."""
    for wdtype in (torch.bfloat16, torch.float32):
        for n, k in ((1003, 32), (257, 200), (130, 300)):
            w = _weights(n, k, n, wdtype)
            for dtype in {wdtype, torch.float32}:
                x = _inputs(m, k, n + m, dtype)
                got = OPS.screen_exact_rows(x, w, mode, ordered.block_size(k), "")
                assert torch.equal(_bits(got), _bits(_exact(x, w, mode))), (wdtype, dtype, n)


# -- the tokens -----------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
def test_random_heads_give_the_exact_paths_tokens(isa, mode):
    cases = [(1, 20000, 32, 0, False), (3, 4001, 32, 3, False), (8, 3000, 300, 0, True),
             (16, 2500, 9, 5, True), (4, 777, 1, 0, False)]
    for m, n, k, spread, outliers in cases:
        for wdtype in (torch.bfloat16, torch.float32):
            w = _weights(n, k, m + n, wdtype, spread)
            for dtype in {wdtype, torch.float32}:
                x = _inputs(m, k, n, dtype, outliers)
                tokens, counts = _screen(x, w, mode, isa)
                assert torch.equal(tokens, argmax_rows(_exact(x, w, mode))), (m, n, k, dtype)
                assert bool((counts >= 1).all())


def _near_ties(k: int, m: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, K] with x[:, 0] = 1 and a head whose top rows are one row w0 with w0[0] stepped
    by one bf16 ulp of 2^-23 at a time (logits about 1 fp32 ulp apart near 1), some of them
    exact duplicates, shuffled among filler rows far below."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g) + 0.1 * torch.randn(m, k, generator=g)
    x[:, 0] = 1
    x = x.to(dtype)
    base = x[0].float() / x[0].float().norm() ** 2          # logits near 1 for every row
    steps = torch.arange(128)
    top = base.repeat(128 + 8, 1)
    top[:128, 0] = 2.0 ** -16 * (1 + steps / 128)           # bf16: exactly these values
    top[128:132] = top[127]                                 # exact ties of the largest
    top[132:] = top[torch.randint(0, 127, (4,), generator=g)]
    filler = torch.randn(3000, k, generator=g) * 0.3 / k
    w = torch.cat([top, filler]).bfloat16()
    return x, w[torch.randperm(w.shape[0], generator=g)].contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_near_ties_give_the_first_maximum(isa, mode, dtype):
    """Rows built to tie exactly or to differ by one fp32 ulp (and, for bf16 outputs, to tie
    once rounded): the token is the first maximum, as argmax_rows answers."""
    one_ulp = ties = 0
    for m, seed in ((1, 0), (4, 1), (16, 2)):
        x, w = _near_ties(16, m, dtype, seed)
        exact = _exact(x, w, mode)
        tokens, counts = _screen(x, w, mode, isa)
        assert torch.equal(tokens, argmax_rows(exact)), (m, tokens, argmax_rows(exact))
        assert bool((counts >= 8).all())                     # the built rows all compete
        raw = _exact(x.float(), w, mode)                      # before any bf16 rounding
        for row in raw:
            values = row.unique()
            one_ulp += int((torch.nextafter(values[:-1], values[1:]) == values[1:]).sum())
        ties += int((exact == exact.max(dim=1, keepdim=True).values).sum(1).gt(1).sum())
    assert one_ulp > 0 and ties > 0                          # the case is what it claims


def _rounding_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """x [3, K] integers (x[:, 0] = 1) and weights s·q with s = 2^-7 (so the copy is exact
    and the margins tiny): rows 0..15 are row 16 with q[0] lowered by 15..0 — exact logits
    1/128 apart, ascending, all rounding to one bf16 — and the other rows far below."""
    g = torch.Generator().manual_seed(4)
    k, n = 24, 600
    x = torch.randint(1, 4, (1, k), generator=g).float().repeat(3, 1)
    x[:, 0] = 1
    q = torch.randint(-20, 21, (n, k), generator=g).float()
    q[:, 1] = 127                                          # every row's scale is 2^-7 exactly
    q[16, 2:] = 100
    for base in range(-127, 128):                          # row 16's q[0]: one bf16 for all
        q[16, 0] = base
        logits = (q[16] * x[0]).sum() / 128 - torch.arange(16.0) / 128
        if base >= -112 and logits.bfloat16().unique().numel() == 1:
            break
    q[:16] = q[16]
    q[:16, 0] = base - torch.arange(15.0, -1.0, -1.0)
    return x.bfloat16(), (q / 128).bfloat16()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
def test_ties_made_by_the_rounding_to_bf16_give_the_first_index(isa, mode):
    """bf16 outputs: rows whose exact logits differ by far more than their margins but round
    to the same bf16 tie, and the first of them wins — the lowest before rounding."""
    x, w = _rounding_ties()
    exact = _exact(x, w, mode)
    tokens, _ = _screen(x, w, mode, isa)
    assert torch.equal(tokens, argmax_rows(exact))
    raw = _exact(x.float(), w, mode)
    assert tokens.tolist() == [0, 0, 0] and bool((raw[:, 0] < raw[:, 16]).all())


# -- the exact path's turn ------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
def test_inputs_not_finite_overflowing_or_too_many_candidates_answer_minus_one(isa):
    w = _weights(600, 16, 3)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = _inputs(3, 16, 0, torch.float32)
        x[1, 5] = bad
        tokens, _ = _screen(x, w, screened.DENSE, isa)
        assert tokens.tolist() == [-1, -1, -1]
    huge = _inputs(2, 16, 1, torch.float32) * 1e36             # logits that could overflow
    assert _screen(huge, w, screened.ORDERED, isa)[0].tolist() == [-1, -1]
    x, tied = _near_ties(16, 2, torch.float32, 3)
    tokens, counts = _screen(x, tied, screened.DENSE, isa, cap=4)
    assert tokens.tolist() == [-1, -1] and bool((counts > 4).all())


def _head(n: int, k: int, dtype: torch.dtype, plan: ExecutionPlan, seed: int = 0,
          ) -> ParallelLMHead:
    head = ParallelLMHead(n, k, ParallelContext(), dtype, plan)
    with torch.no_grad():
        head.weight.copy_(_weights(n, k, seed, dtype, spread=1))
    return head


def _screening_plan() -> ExecutionPlan:
    plan = execution_plan.current()
    if not plan.screened_head:
        pytest.skip(f"this process's plan does not screen the head: {plan.describe()}")
    return plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [32, 300])
def test_the_lm_head_greedy_is_argmax_rows_of_its_logits(dtype, k):
    """`ParallelLMHead.greedy` with the screen on: the exact path's ids for every row count
    (1..16) and thread count (or None where neither the screen nor a native argmax applies:
    torch's GEMM with another order than the ordered product's), and the screen answered."""
    head = _head(5003, k, dtype, _screening_plan())
    g = torch.Generator().manual_seed(k)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 4, 5, 8, 9, 16):
                for _ in range(2):
                    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
                    ids = head.greedy(x)
                    assert ids is None or torch.equal(ids, argmax_rows(head(x).float()))
    finally:
        torch.set_num_threads(before)
    assert head.screen is not None and head.screen.stats.answered >= 6     # dense: 1, 2, 4 rows
    stats = head.screen.stats
    assert all(1 <= c <= screened.max_candidates(5003) for c in stats.candidates)
    assert stats.most == max(stats.candidates)


def test_the_head_takes_the_exact_path_for_inputs_not_finite():
    """Not finite at a key's first call (no verdict from NaN's bits) and later (a fallback)."""
    head = _head(700, 16, torch.bfloat16, _screening_plan())
    x = torch.randn(4, 16).bfloat16()
    bad = x.clone()
    bad[2, 3] = float("nan")
    for _ in range(2):
        ids = head.greedy(bad)
        assert ids is None or torch.equal(ids, argmax_rows(head(bad).float()))
        assert head.screen is not None and not head.screen.verdicts
    assert torch.equal(head.greedy(x), argmax_rows(head(x).float()))     # the key checked
    assert list(head.screen.verdicts.values()) == [True]
    ids = head.greedy(bad)
    assert ids is None or torch.equal(ids, argmax_rows(head(bad).float()))
    assert head.screen.stats.fallbacks == 1 and head.screen.stats.answered == 0


def test_a_screen_whose_candidates_differ_from_the_exact_path_is_not_used(monkeypatch):
    """The per-key check is what guards the bits: candidates one ulp off are never used."""
    head = _head(900, 16, torch.bfloat16, _screening_plan())
    real = screened._op

    def off(name: str):
        op = real(name)
        if name != "screen_exact_rows" or op is None:
            return op
        return lambda *a: (lambda y: torch.nextafter(y, torch.full_like(y, float("inf"))))(op(*a))

    monkeypatch.setattr(screened, "_op", off)
    for m in (1, 8):
        x = torch.randn(m, 16).bfloat16()
        for _ in range(3):
            ids = head.greedy(x)
            assert ids is None or torch.equal(ids, argmax_rows(head(x).float()))
    assert head.screen is not None and set(head.screen.verdicts.values()) == {False}
    assert head.screen.stats.answered == 0


def test_a_weight_changed_in_place_is_copied_and_checked_again():
    head = _head(800, 16, torch.bfloat16, _screening_plan())
    x = torch.randn(3, 16).bfloat16()
    for _ in range(2):
        head.greedy(x)
    with torch.no_grad():
        head.weight.mul_(-1.5)
    for _ in range(2):
        assert torch.equal(head.greedy(x), argmax_rows(head(x).float()))
    assert head.screen is not None and head.screen.version == head.weight._version


# -- the plan -------------------------------------------------------------------------------------
def test_the_plan_screens_where_the_dense_kernels_run_unless_told_not_to(monkeypatch):
    facts = KernelFacts(True, False, "avx2", "avx2", False)
    plan = ExecutionPlan.build(execution_plan.CpuFeatures(avx2=True), facts, PlanConfig())
    assert plan.screened_head and plan.describe().endswith("greedy head screened")
    assert not plan.without_native().screened_head
    assert not ExecutionPlan.reference().screened_head
    off = ExecutionPlan.build(execution_plan.CpuFeatures(avx2=True), facts,
                              PlanConfig(screened_head="off"))
    assert not off.screened_head and off.describe().endswith("greedy head exact")
    torch_dense = ExecutionPlan.build(execution_plan.CpuFeatures(avx2=True), facts,
                                      PlanConfig(dense="torch"))
    assert not torch_dense.screened_head
    monkeypatch.setenv(envs.SCREENED_HEAD.name, "off")
    assert PlanConfig.from_env().screened_head == "off"
    monkeypatch.setenv(envs.SCREENED_HEAD.name, "on")
    with pytest.raises(ValueError, match="KVRELAY_SCREENED_HEAD: expected auto or off"):
        PlanConfig.from_env()


def test_the_screen_takes_only_what_it_can_reproduce():
    plan = _screening_plan()
    w = torch.zeros(100, 8, dtype=torch.bfloat16)
    assert screened.exact_mode(torch.zeros(17, 8).bfloat16(), w, plan) is None
    assert screened.exact_mode(torch.zeros(1, 8).bfloat16(), w, plan) == screened.DENSE
    no_dense = dataclasses.replace(plan, dense=None)
    native = dataclasses.replace(no_dense, matmul="native")   # torch's half GEMM: not ours
    assert screened.exact_mode(torch.zeros(12, 8).bfloat16(), w, native) is None
    assert screened.exact_mode(torch.zeros(12, 8), w.float(), no_dense) == screened.ORDERED


def test_the_warm_up_checks_ahead_where_the_exact_path_is_native():
    """`warmed_ahead`: the dense kernel's keys and the ordered product's (a shallow weight)
    are checked in warm-up; torch's upcast GEMM of a wide weight is left to first use."""
    plan = dataclasses.replace(_screening_plan(), matmul="fp32")
    no_dense = dataclasses.replace(plan, dense=None)          # many rows: torch's fp32 GEMM
    shallow = torch.zeros(100, ordered.MAX_K // 8).bfloat16()
    wide = torch.zeros(100, ordered.MAX_K + 44).bfloat16()

    def x(rows: int, k: int) -> torch.Tensor:
        return torch.zeros(rows, k).bfloat16()

    assert screened.warmed_ahead(x(1, wide.shape[1]), wide, plan)               # dense kernel
    assert screened.warmed_ahead(x(12, shallow.shape[1]), shallow, no_dense)    # ordered
    assert not screened.warmed_ahead(x(12, wide.shape[1]), wide, no_dense)      # torch's GEMM
    assert not screened.warmed_ahead(x(17, shallow.shape[1]), shallow, plan)    # no screen
