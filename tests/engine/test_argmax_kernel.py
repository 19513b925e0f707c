"""The sampler's native row argmax (`kvrelay_kernels::argmax_rows`) gives torch.argmax's
answer on every ISA this CPU has: ties, infinities, NaN, odd widths, strided rows."""
from __future__ import annotations

import pytest
import torch

from kvrelay.engine import sampler as sampler_module
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler, argmax_rows, greedy_tokens
from kvrelay.model import kernels
from kvrelay.sampling_params import SamplingParams
from tests.kernel_isas import isa_params

pytestmark = pytest.mark.skipif(not kernels.kernels_available(),
                                reason="the native kernels are not built here")
INF, NAN = float("inf"), float("nan")


def _isas() -> list:
    return isa_params("argmax")


def _native(x: torch.Tensor, isa: str) -> list[int]:
    return torch.ops.kvrelay_kernels.argmax_rows(x, isa).tolist()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("width", [1, 5, 31, 32, 33, 95, 2048, 50_001])
def test_random_rows_match_torch(isa, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=g)
    assert _native(x, isa) == x.argmax(-1).tolist()


@pytest.mark.parametrize("isa", _isas())
def test_ties_go_to_the_first_index(isa):
    x = torch.zeros(6, 100)
    x[0, [3, 35, 67]] = 5.0              # the same lane of three blocks
    x[1, [40, 9]] = 5.0                  # a later block's lower lane vs an earlier block
    x[2, [97, 98]] = 5.0                 # both in the partial last block
    x[3, [31, 96]] = 5.0                 # a full block's last lane vs the partial block
    x[4] = 1.0                           # every value equal
    x[5, [64, 65]] = INF
    assert _native(x, isa) == x.argmax(-1).tolist() == [3, 9, 97, 31, 0, 64]


@pytest.mark.parametrize("isa", _isas())
def test_infinities_and_nan_as_torch_orders_them(isa):
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(1))
    x[0] = -INF                          # no finite value: the first index
    x[1, 50] = NAN                       # NaN beats everything
    x[1, 10] = INF
    x[2, [66, 20]] = NAN                 # the first NaN, wherever the lanes put it
    x[3] = -INF
    x[3, 69] = -1e30                     # only the partial block's last value is finite
    x[4, 68] = NAN                       # NaN only in the partial block
    want = x.argmax(-1).tolist()
    assert want == [0, 50, 20, 69, 68]
    assert _native(x, isa) == want


@pytest.mark.parametrize("isa", _isas())
def test_strided_rows_and_empty_batches(isa):
    wide = torch.randn(9, 300, generator=torch.Generator().manual_seed(2))
    view = wide[1::2, 7:260]             # row stride 600, tokens contiguous
    assert _native(view, isa) == view.argmax(-1).tolist()
    assert _native(torch.empty(0, 40), isa) == []


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvrelay_kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16), "")
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.kvrelay_kernels.argmax_rows(torch.zeros(3, 4).t(), "")
    with pytest.raises(RuntimeError, match="not supported"):
        torch.ops.kvrelay_kernels.argmax_rows(torch.zeros(1, 4), "sse9")


def test_argmax_rows_falls_back_to_torch_where_the_op_cannot_run():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    for y in (x.double(), x.t(), x.bfloat16()):
        assert argmax_rows(y).tolist() == y.argmax(-1).tolist()


def _requests(n: int, **params) -> list[Request]:
    p = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    return [Request(str(i), [1, 2, 3], p) for i in range(n)]


@pytest.mark.parametrize("params", [dict(temperature=0.0),
                                    dict(temperature=0.0, logit_bias={5: 1.0}),
                                    dict(temperature=0.9, seed=7)])
def test_sampler_tokens_equal_with_and_without_the_kernel(monkeypatch, params):
    """Greedy (plain and processed) and seeded sampled rows: the same tokens as the
    torch.argmax path."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(4))
    logits[2, [10, 2000]] = 50.0                           # a tie across blocks
    native = Sampler()(logits.clone(), _requests(6, **params)).token_ids
    monkeypatch.setattr(sampler_module, "_argmax_op", lambda: None)
    reference = Sampler()(logits.clone(), _requests(6, **params)).token_ids
    assert native == reference
    if params["temperature"] == 0.0 and not params.get("logit_bias"):
        assert native == logits.argmax(-1).tolist() and native[2] == 10
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
