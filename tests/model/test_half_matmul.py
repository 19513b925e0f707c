"""The CPU half-precision matmul seam (`layers.linear.linear`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model import execution_plan
from kvrelay.model.layers import linear as L


@pytest.fixture
def mode(monkeypatch):
    def set_mode(value: str) -> None:
        monkeypatch.setenv("KVRELAY_CPU_HALF_MATMUL", value)
        execution_plan.current.cache_clear()
    monkeypatch.setenv("KVRELAY_DENSE_KERNEL", "torch")   # the torch seam, not the native kernel
    execution_plan.current.cache_clear()
    yield set_mode
    execution_plan.current.cache_clear()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    return x, w, b


def test_fp32_mode_computes_in_fp32_and_rounds_once(mode):
    mode("fp32")
    x, w, b = _inputs()
    out = L.linear(x, w, b)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).bfloat16())


def test_native_mode_is_plain_linear(mode):
    mode("native")
    x, w, b = _inputs()
    assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))


def test_fp32_weights_are_never_touched(mode):
    mode("fp32")
    x, w, b = (t.float() for t in _inputs())
    assert not L.upcasts(w)
    assert torch.equal(L.linear(x, w, b), F.linear(x, w, b))


def test_bad_mode_names_the_variable(mode):
    mode("fast")
    with pytest.raises(ValueError, match=r"KVRELAY_CPU_HALF_MATMUL.*auto, native or fp32"):
        L.linear(*_inputs())


def test_experts_agree_across_modes(mode):
    from kvrelay.model.layers.moe import Experts
    from kvrelay.model.parallel import ParallelContext
    g = torch.Generator().manual_seed(1)
    experts = Experts(32, 48, 4, ParallelContext(), torch.bfloat16, 1.702, 7.0, False)
    for p in experts.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(6, 32, generator=g).bfloat16()
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    outs = {}
    for m in ("native", "fp32"):
        mode(m)
        outs[m] = experts(x, weights, ids)
        assert outs[m].dtype == torch.bfloat16
    ref = experts.float()(x.float(), weights, ids)
    # fp32 compute is at least as close to the fp32 result as bf16 compute
    err = {m: (o.float() - ref).abs().max().item() for m, o in outs.items()}
    assert err["fp32"] <= err["native"] + 1e-6
    assert err["fp32"] < 0.05


def test_few_rows_keep_the_half_kernel(mode):
    mode("fp32")
    x, w, b = _inputs()
    few = x[: L.UPCAST_MIN_ROWS - 1]
    assert torch.equal(L.linear(few, w, b), F.linear(few, w, b))
