"""The fused decode-only step (`DecoderLayer.forward` handed a `FusedDecode`: one native call
for RoPE + KV write + paged attention, one for the router and the experts) against the
separate ops, and the same step run from C++ (`DecodeStack`) against it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.model import gpt_oss
from kvrelay.model.generate import PagedGreedyLoop, _Seq
from kvrelay.model.layers import paged_decode
from kvrelay.model.layers.moe import route_topk_op
from kvrelay.model.loader import load_model
from tests.factories import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(
    not paged_decode.enabled(), reason="the native kernels cannot be built here"
)


def _reference_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `Router.forward` gives after the linear, as the experts read it."""
    top, ids = logits.topk(k, dim=-1)
    return torch.softmax(top, dim=-1).float(), ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("experts,k", [(2, 1), (2, 2), (5, 3), (32, 4), (32, 1)])
@pytest.mark.parametrize("tokens", [1, 16, 33])
def test_route_topk_matches_topk_then_softmax(dtype, experts, k, tokens):
    g = torch.Generator().manual_seed(experts * 100 + k * 10 + tokens)
    # distinct logits in every dtype (ties are the next test's): a permutation, 0.37 apart
    perm = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    logits = ((perm - experts / 2) * 0.37).to(dtype)
    weights, ids = route_topk_op()(logits, k)
    ref_w, ref_ids = _reference_route(logits, k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_w)


def test_route_topk_ties_go_to_the_lower_expert_and_k_equals_e():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, ids = route_topk_op()(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    weights, ids = route_topk_op()(logits, 5)
    assert ids[0].tolist() == [1, 2, 4, 0, 3]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    with pytest.raises(RuntimeError, match="1 <= k <= E"):
        route_topk_op()(logits, 6)


CONFIGS = {
    # sliding + full layers (two KV-cache groups), GQA 2, top-2 of 4 experts
    "window-gqa2-top2": dict(num_key_value_heads=2, sliding_window=6, num_experts_per_tok=2),
    # MQA, top-1, YaRN
    "mqa-top1": dict(num_key_value_heads=1, num_experts_per_tok=1, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    hf = make_hf_model(seed=7, **CONFIGS[request.param])
    return save_checkpoint(hf, tmp_path_factory.mktemp(request.param))


def _decode(model, fused: bool, prompts: list[list[int]], steps: int, num_blocks: int = 64):
    """Prefill the prompts, then `steps` decode steps of every sequence (its own greedy
    token each time); returns every decode step's logits and the KV caches. `fused` False:
    the separate ops (a plan without the fused decode)."""
    plan = model.plan
    if not fused:
        model.use_plan(dataclasses.replace(plan, fused_decode=False, decode_stack=False))
    try:
        loop = PagedGreedyLoop(model, num_blocks, 4, shuffle_blocks=True, seed=5)
        return loop.decode_batch(prompts, steps), loop.kv_caches
    finally:
        if not fused:
            model.use_plan(plan)


def _without_stack(model) -> None:
    model.use_plan(dataclasses.replace(model.plan, decode_stack=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 5])
def test_fused_decode_steps_are_bitwise_the_separate_ops(checkpoint, dtype, num_seqs):
    """Whole decode steps (block-edge lengths with block size 4, past the window): the
    logits and every KV cache equal the separate-op path's exactly."""
    model = load_model(checkpoint, dtype=dtype, progress=False).model
    g = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist()
               for n in (7, 8, 3, 12, 9)[:num_seqs]]
    ref, ref_caches = _decode(model, False, prompts, 6)
    got, got_caches = _decode(model, True, prompts, 6)
    assert torch.equal(got, ref)
    for a, b in zip(got_caches, ref_caches):
        assert torch.equal(a, b)


def test_the_fused_path_is_taken_only_for_decode_only_steps(checkpoint, monkeypatch):
    """The model hands its layers a `FusedDecode` for decode-only steps only (and the
    attention then takes its fused call: `rope_attend` with it)."""
    model = load_model(checkpoint, dtype=torch.float32, progress=False).model
    calls: list[int] = []
    forward = gpt_oss.DecoderLayer.forward

    def counted(self, h, residual, positions, kv_cache, meta, fused=None):
        if fused is not None:
            calls.append(h.shape[0])
        return forward(self, h, residual, positions, kv_cache, meta, fused)

    monkeypatch.setattr(gpt_oss.DecoderLayer, "forward", counted)
    _without_stack(model)                  # layer by layer, so each layer's step is seen
    loop = PagedGreedyLoop(model, 64, 4)
    seqs = [_Seq([1, 2, 3, 4, 5]), _Seq([6, 7, 8])]
    loop.step(seqs, [5, 3])                              # prefill: separate ops
    assert calls == []
    seqs[0].tokens.append(9)
    seqs[1].tokens += [10, 11]
    loop.step(seqs, [1, 2])                              # a decode + a chunk: separate ops
    assert calls == []
    seqs[0].tokens.append(12)
    seqs[1].tokens.append(13)
    loop.step(seqs, [1, 1])                              # decode-only: every layer fused
    assert calls == [2] * len(model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_the_decode_stack_is_bitwise_the_layer_by_layer_decode(checkpoint, dtype, num_seqs,
                                                               monkeypatch):
    """Every layer in one native call (`DecodeStack`) gives exactly the logits and KV caches
    of the fused `DecoderLayer.forward` layer by layer, and is what decode-only steps take."""
    model = load_model(checkpoint, dtype=dtype, progress=False).model
    g = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (9, 4, 12)[:num_seqs]]
    full = model.plan
    assert full.decode_stack
    _without_stack(model)
    ref, ref_caches = _decode(model, True, prompts, 5)
    assert model._stack is None                              # never made: stack off
    model.use_plan(full)
    got, got_caches = _decode(model, True, prompts, 5)
    assert model._stack is not None
    assert model._stack.usable == {(num_seqs, torch.get_num_threads()): True}
    assert torch.equal(got, ref)
    for a, b in zip(got_caches, ref_caches):
        assert torch.equal(a, b)


def test_the_decode_stack_takes_more_than_the_dense_row_limit_on_a_small_model(checkpoint,
                                                                            monkeypatch):
    """Past DENSE_MAX_ROWS sequences a small model's decode steps stay one native call where
    every projection is within the dense kernel's small-call budget (linear.py) or is
    torch's fp32 GEMM (a plan that upcasts half matmuls: the stack computes them as `linear`
    does, tests/model/test_decode_stack_forms.py), bitwise the layer-by-layer decode; where
    neither holds they go layer by layer."""
    from kvrelay.model.layers import linear
    model = load_model(checkpoint, dtype=torch.bfloat16, progress=False).model
    isa = linear.dense_kernel_isa()
    n = linear.DENSE_MAX_ROWS.get(isa or "", {}).get(torch.bfloat16, 16) + 4
    mods = model.layers[0].mods
    weights = (mods.qkv.weight, mods.o_proj.weight, mods.router.weight)
    fits = all(n * w.numel() <= linear.DENSE_SMALL_CALL_MACS.get(isa or "", 0) for w in weights)
    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(0, 100, (int(k),), generator=g).tolist()
               for k in torch.randint(2, 7, (n,), generator=g)]
    full = model.plan
    _without_stack(model)
    ref, ref_caches = _decode(model, True, prompts, 3, num_blocks=4 * n)
    model.use_plan(full)
    got, got_caches = _decode(model, True, prompts, 3, num_blocks=4 * n)
    assert model._stack is not None
    assert model._stack.usable == {(n, torch.get_num_threads()): fits or full.half_in_fp32}
    assert torch.equal(got, ref)
    for a, b in zip(got_caches, ref_caches):
        assert torch.equal(a, b)
    if isa == "avx512_bf16":
        assert fits                    # the TINY factory model's projections are small


def test_the_decode_stack_follows_reloaded_experts(checkpoint, monkeypatch):
    """New expert biases (a reload copies in place) make the stack again: a step after the
    change equals the layer-by-layer decode's."""
    model = load_model(checkpoint, dtype=torch.float32, progress=False).model
    _decode(model, True, [[3, 1, 4, 1, 5]], 1)
    stack = model._stack
    assert stack is not None
    for layer in model.layers:
        layer.mlp.experts.down_bias.add_(0.25)
    got, _ = _decode(model, True, [[3, 1, 4, 1, 5]], 2)
    assert model._stack is not stack
    _without_stack(model)
    ref, _ = _decode(model, True, [[3, 1, 4, 1, 5]], 2)
    assert torch.equal(got, ref)


def test_a_new_plan_reaches_every_layers_experts(checkpoint, monkeypatch):
    """`model.use_plan` makes each layer's expert paths again (`Experts.use_plan`): a plan
    with moe "torch" sends the next decode step's experts to the reference path."""
    from kvrelay.model.layers.moe import Experts
    model = load_model(checkpoint, dtype=torch.float32, progress=False).model
    calls: list[int] = []
    reference = Experts.forward_torch
    monkeypatch.setattr(Experts, "forward_torch",
                        lambda self, x, *a: calls.append(x.shape[0]) or reference(self, x, *a))
    _decode(model, True, [[3, 1, 4, 1, 5]], 1)
    assert calls == []                                    # the kernel: few rows per expert
    model.use_plan(dataclasses.replace(model.plan, moe="torch", moe_tiles=False))
    _decode(model, True, [[3, 1, 4, 1, 5]], 1)
    assert calls == [5] * len(model.layers) + [1] * len(model.layers)
