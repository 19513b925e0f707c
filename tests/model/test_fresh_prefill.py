"""Prefill chunks without a cached prefix attended over their own k/v (the fresh path of
`PagedAttention`: the native kernel `prefill_attention`, or SDPA in query pieces where the
kernels are not built) against the reference path (gather from the paged cache, masked SDPA)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers import paged_decode
from kvrelay.model.layers.attention import QUERY_PIECE, AttentionMetadata, PagedAttention
from kvrelay.model.parallel import ParallelContext
from tests.kernel_isas import isa_params
from tests.model.test_paged_decode import _step

B, NB = 8, 128


@pytest.fixture(params=["native", "pieces"], autouse=True)
def fresh_path(request, monkeypatch):
    """Every test runs on both fresh paths: the C++ kernel and SDPA in query pieces."""
    if request.param == "native" and not paged_decode.enabled():
        pytest.skip("the native kernels cannot be built here")
    plan = execution_plan.current()
    if request.param == "pieces":
        plan = dataclasses.replace(plan.without_native(), fresh_prefill=True)
    monkeypatch.setattr(sys.modules[__name__], "FAST_PLAN", plan)
    return request.param


FAST_PLAN = ExecutionPlan.reference()       # the fixture's plan for the fresh path


def _plan(fast: bool) -> ExecutionPlan:
    """The fresh path under test, or the reference (gather) path."""
    return FAST_PLAN if fast else ExecutionPlan.reference()


def _compare(heads: int, kv_heads: int, head_dim: int, window: int | None, q_lens: list[int],
             seq_lens: list[int] | None = None, dtype: torch.dtype = torch.float32,
             tol: float = 1e-5) -> AttentionMetadata:
    torch.manual_seed(len(q_lens) + heads)
    meta = _step(seq_lens or q_lens, q_lens, B, NB, seed=heads + (window or 0))
    layer = PagedAttention(heads, kv_heads, head_dim, window, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim).to(dtype)
    k, v = (torch.randn(T, kv_heads, head_dim).to(dtype) for _ in range(2))
    cache = torch.randn(2, NB, kv_heads, B, head_dim).to(dtype)
    outs = []
    for fast in (False, True):
        layer.plan = _plan(fast)
        meta._plans.clear()
        outs.append(layer(q, k, v, cache.clone(), meta).float())
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    return meta


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 16), (6, 3, 12), (8, 2, 8), (8, 1, 64)]
)
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize(
    "q_lens",
    [
        [B],                                   # one prompt of exactly one block
        [B + 1, B + 1, B + 1],                 # equal lengths: one batch, no padding
        [B - 1, B, B + 1],                     # unequal, close: one padded batch
        [1, 1, 2 * B, 3, 2 * QUERY_PIECE + 5],  # decodes first, then far apart: one by one
    ],
)
def test_fresh_prefill_matches_reference(heads, kv_heads, head_dim, window, q_lens):
    meta = _compare(heads, kv_heads, head_dim, window, q_lens)
    plan = meta.fresh_plan()
    assert plan is not None and plan.lens == [n for n in q_lens if n > 1]


def test_padding_choice():
    meta = _compare(4, 2, 16, None, [B - 1, B, B + 1])
    assert meta.fresh_plan().padded and meta.fresh_plan().token_seq is not None
    meta = _compare(4, 2, 16, None, [3, 3, 150])
    assert not meta.fresh_plan().padded


@pytest.mark.parametrize("window", [None, 48])
def test_fresh_prefill_bf16_long_prompts(window):
    """bf16, prompts spanning several query pieces (window both inside and across them)."""
    lens = [QUERY_PIECE * 3 + 7] * 3
    _compare(8, 2, 32, window, lens, dtype=torch.bfloat16, tol=2e-2)


def test_a_continued_chunk_keeps_the_reference_path():
    """A chunk after a cached prefix (start > 0) reads keys from the cache: no fresh plan,
    and the output is the reference's."""
    meta = _compare(4, 2, 16, 5, [20, 12], seq_lens=[20, 30])
    assert meta.fresh_plan() is None


@pytest.mark.parametrize("isa", isa_params("prefill"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_isa_build_matches_reference(fresh_path, dtype, isa):
    """Each prefill ISA build of the table (those this CPU cannot run are skipped naming
    what it lacks) against the reference path: GQA 3, head dim
    20 (not a multiple of the 16-float vectors), a window inside the tiles, block edges,
    q and k strided views of one fused tensor (as the model's qkv split gives them)."""
    if fresh_path != "native":
        pytest.skip("the ISA builds are the native path's")
    torch.manual_seed(7)
    h, kvh, hd, window = 6, 2, 20, 37
    lens = [B - 1, B + 1, 2 * B, 70]
    meta = _step(lens, lens, B, NB, seed=7)
    layer = PagedAttention(h, kvh, hd, window, 0, ParallelContext())
    layer.sinks.normal_(0, 1)
    T = sum(lens)
    q, k = torch.randn(T, h + kvh, hd).to(dtype).split([h, kvh], dim=1)
    v = torch.randn(T, kvh, hd).to(dtype)
    layer.plan = _plan(False)
    ref = layer(q, k, v, torch.zeros(2, NB, kvh, B, hd, dtype=dtype), meta).float()
    cu = torch.tensor([0, *lens]).cumsum(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = torch.ops.kvrelay_kernels.prefill_attention(q, k, v, cu, layer.sinks, layer.scale,
                                                      window, isa)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol, msg=isa)
