"""The decode stack past the dense kernel's rows (`DecodeStack.set_forms`,
csrc/decode_stack_op.cpp): each projection in the form the Python path computes it
(`linear.stack_form`: the dense kernel, the ordered kernel where checked equal to torch's fp32
GEMM, or that GEMM), so whole decode steps of any batch size are one native call and bitwise
the layer-by-layer decode."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.model.generate import PagedGreedyLoop
from kvrelay.model.layers import linear, paged_decode
from kvrelay.model.layers.ordered import OrderedProduct
from kvrelay.model.loader import load_model
from tests.factories import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(
    not paged_decode.enabled(), reason="the native kernels cannot be built here"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Sliding and full layers, GQA 2, top-2 of 4 experts: qkv 64 -> 128, o_proj 64 -> 64
    (shallow enough for the ordered kernel), the router 64 -> 4."""
    hf = make_hf_model(seed=11, num_key_value_heads=2, sliding_window=6, num_experts_per_tok=2)
    return save_checkpoint(hf, tmp_path_factory.mktemp("stack-forms"))


def _decode(model, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, list]:
    """Prefill, then `steps` decode steps of every sequence (its own greedy token each
    time): every decode step's logits and the KV caches."""
    loop = PagedGreedyLoop(model, 8 * len(prompts), 4, shuffle_blocks=True, seed=3)
    return loop.decode_batch(prompts, steps), loop.kv_caches


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 150, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 9, (n,), generator=g)]


def _forms(model, n: int) -> set[int]:
    """The stack forms of every layer's qkv and o_proj for n rows, as `_usable` saw them."""
    forms = set()
    for layer in model.layers:
        m = layer.mods
        h = torch.empty(n, m.qkv.weight.shape[1], dtype=m.qkv.weight.dtype)
        out = torch.empty(n, m.o_proj.weight.shape[1], dtype=m.qkv.weight.dtype)
        forms |= {m.qkv.stack_form(h), m.o_proj.stack_form(out)}
    return forms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("checked", [True, False], ids=["ordered-where-checked", "fp32-gemm"])
def test_every_batch_size_runs_as_one_call_bitwise_the_layers(checkpoint, dtype, threads,
                                                              checked, monkeypatch):
    """Batches on the dense kernel (few rows) and past it (the ordered kernel where checked,
    torch's fp32 GEMM where not — forced here by a check that never passes): the stack
    runs every one of them and gives the layer-by-layer decode's logits and KV caches."""
    if not checked:
        monkeypatch.setattr(OrderedProduct, "checked", lambda self, rows, plan: False)
    model = load_model(checkpoint, dtype=dtype, progress=False).model
    full = model.plan
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (3, 6, 9, 17):
            prompts = _prompts(n)
            model.use_plan(dataclasses.replace(full, decode_stack=False))
            ref, ref_caches = _decode(model, prompts, 3)
            model.use_plan(full)
            got, got_caches = _decode(model, prompts, 3)
            assert model._stack is not None and model._stack.usable[(n, threads)]
            assert torch.equal(got, ref)
            for a, b in zip(got_caches, ref_caches):
                assert torch.equal(a, b)
            if not checked and not linear.runs_on_dense_kernel(
                    torch.empty(n, 64, dtype=dtype), model.layers[0].mods.qkv.weight, full):
                assert _forms(model, n) == {linear.STACK_FP32}
    finally:
        torch.set_num_threads(before)


def test_a_projection_changed_in_place_remakes_the_stack(checkpoint):
    """A qkv weight copied into in place (a reload): the stack registered the old packed copy,
    so it is made again, and the step equals the layer-by-layer decode's on the new weight."""
    model = load_model(checkpoint, dtype=torch.bfloat16, progress=False).model
    prompts = _prompts(8)
    _decode(model, prompts, 1)
    stack = model._stack
    assert stack is not None
    with torch.no_grad():
        for layer in model.layers:
            layer.mods.qkv.weight.mul_(-0.5)
    got, _ = _decode(model, prompts, 2)
    assert model._stack is not stack
    model.use_plan(dataclasses.replace(model.plan, decode_stack=False))
    ref, _ = _decode(model, prompts, 2)
    assert torch.equal(got, ref)


def test_a_stale_packed_copy_is_never_computed_with(checkpoint, monkeypatch):
    """The stack's own guard: run with a registration older than an in-place change of the
    weight (the Python side told it is current), a product falls back to torch's fp32 GEMM
    rather than use the old packed copy, and the step stays the layer-by-layer decode's."""
    from kvrelay.model import gpt_oss
    model = load_model(checkpoint, dtype=torch.bfloat16, progress=False).model
    prompts = _prompts(8)
    _decode(model, prompts, 1)
    stack = model._stack
    assert stack is not None and stack.registered        # 8 rows: some ordered form
    monkeypatch.setattr(gpt_oss.DecodeStack, "current", lambda self: True)
    with torch.no_grad():
        for layer in model.layers:
            layer.mods.o_proj.weight.mul_(1.5)
    got, _ = _decode(model, prompts, 2)
    assert model._stack is stack
    model.use_plan(dataclasses.replace(model.plan, decode_stack=False))
    ref, _ = _decode(model, prompts, 2)
    assert torch.equal(got, ref)
