"""MXFP4 expert decode through bf16 dot products (the "avx512_bf16" build) and every other
ISA build, against the PyTorch reference (`mxfp4.dequantize` + fp32 matmuls).

The bf16 route multiplies e2m1 values by bf16 hidden states exactly and scales each
group's fp32 partial sum, so it may differ from the reference only by fp32 summation
order: checked on odd shapes (hidden a multiple of 32 but not of 128, so blocks of four
groups end part-way), 1-8 token rows per expert, row tiles cut at every size (two
threads), extreme E8M0 scales, all-zero and negative codes. Hidden states that are not
exactly bf16, or hold a nonzero below 2^-100, take the fp32 route: bit for bit the
"avx512" build's result.
"""
from __future__ import annotations

import pytest
import torch

from kvrelay.model import kernels, mxfp4
from kvrelay.model.kernels import isa as isa_table
from tests.kernel_isas import skip_unless_runs

ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module")
def isas() -> tuple[str, ...]:
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    status = kernels.status()
    assert status.available, f"native kernels failed to build: {status.reason}"
    # the SIMD builds (generic MXFP4 is test_moe_kernels.py's), as the table picks them
    usable = isa_table.variants("moe")
    return tuple(i for i in usable if i != "generic") or usable


@pytest.fixture(scope="module")
def bf16_isa(isas) -> str:
    skip_unless_runs("moe", "avx512_bf16")
    return "avx512_bf16"


class Layer:
    """Random MXFP4 experts [E, 2I, H] / [E, H, I] with biases, and their fp32 reference;
    `scales` (an E8M0 range) and `codes` (one byte everywhere) shape gate_up, which reads
    the hidden states."""

    def __init__(self, H: int, I: int, E: int, seed: int,  # noqa: E741 -- I: shapes
                 scales: tuple[int, int] = (121, 126), codes: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(seed)

        def packed(rows: int, cols: int, scales: tuple[int, int] = (121, 126),
                   codes: torch.Tensor | None = None) -> mxfp4.MXFP4Tensor:
            shape = (E, rows, cols // 32)
            blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g) \
                if codes is None else codes.expand(*shape, 16).contiguous()
            s = torch.randint(scales[0], scales[1] + 1, shape, dtype=torch.uint8, generator=g)
            return mxfp4.MXFP4Tensor(blocks, s)

        self.H, self.I, self.E = H, I, E
        self.gate_up, self.down = packed(2 * I, H, scales, codes), packed(H, I)
        self.gate_up_bias = torch.randn(E, 2 * I, generator=g) * 0.5
        self.down_bias = torch.randn(E, H, generator=g) * 0.5

    def native(self, x: torch.Tensor, weights, ids, isa: str) -> torch.Tensor:
        return kernels.moe_experts(
            x, weights, ids, 0, (self.gate_up.blocks, self.gate_up.scales), self.gate_up_bias,
            (self.down.blocks, self.down.scales), self.down_bias, ALPHA, LIMIT, isa)

    def reference(self, x: torch.Tensor, weights, ids) -> torch.Tensor:
        """Dequantise, then fp32 matmuls, one (token, choice) at a time."""
        x = x.float()
        out = torch.zeros(x.shape[0], self.H)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                h = self.gate_up.expert(e, torch.float32) @ x[t] + self.gate_up_bias[e]
                gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
                act = (up + 1) * gate * torch.sigmoid(gate * ALPHA)
                out[t] += weights[t, j] * (self.down.expert(e, torch.float32) @ act
                                           + self.down_bias[e])
        return out


def shared_routing(rows_per_expert: tuple[int, ...], k: int = 1):
    """Expert e gets rows_per_expert[e] token rows (top-k: the next k-1 experts too)."""
    E = len(rows_per_expert)
    first = torch.tensor([e for e, n in enumerate(rows_per_expert) for _ in range(n)])
    ids = torch.stack([(first + j) % E for j in range(k)], dim=1)                   # [T, k]
    weights = torch.softmax(torch.randn(len(first), k,
                                        generator=torch.Generator().manual_seed(3)), -1)
    return weights, ids


def bf16_x(T: int, H: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 2e-5) -> None:
    assert torch.isfinite(ref).all()
    scale = ref.abs().max().clamp(min=1e-30)
    err = (out.float() - ref).abs().max() / scale
    assert err < rel, f"max error {err:.2e} of the output scale (allowed {rel:.0e})"


def test_the_bf16_build_is_offered_where_the_cpu_has_avx512_bf16(isas):
    skip_unless_runs("moe", "avx512_bf16")
    assert kernels.status().isas[0] == "avx512_bf16"


# hidden: 3, 5 and 7 groups of 32 (blocks of four groups end part-way); token rows per
# expert 1-5 and 8 (and 9: a block of 8 and one more)
@pytest.mark.parametrize("H,I", [(96, 64), (160, 96), (224, 32), (544, 160)])
@pytest.mark.parametrize("rows", [(1,), (2,), (3, 1), (4,), (5, 2), (8,), (9, 0, 1)])
def test_matches_the_reference(H, I, rows, isas):  # noqa: E741 -- I as in the shape notation
    layer = Layer(H, I, 4, seed=H + len(rows))
    weights, ids = shared_routing(rows + (0,) * (4 - len(rows)))
    x = bf16_x(len(ids), H, seed=sum(rows))
    expected = layer.reference(x, weights, ids)
    for isa in isas:
        out = layer.native(x.float(), weights, ids, isa)
        assert_close(out, expected)
        assert torch.equal(layer.native(x, weights, ids, isa), out.bfloat16()), isa


@pytest.mark.parametrize("scales,codes,x_scale", [
    ((0, 0), None, 1.0),             # 2^-127: every weight denormal in the reference
    ((1, 1), None, 1.0),
    ((127, 127), None, 1.0),
    ((254, 254), 0x21, 2.0 ** -100),  # 2^127 x {0.5, 1}: the largest finite weights
    ((0, 254), 0x11, 2.0 ** -60),     # mixed extremes in one row
    ((120, 127), 0x00, 1.0),          # all-zero codes: the biases alone
    ((120, 127), 0x88, 1.0),          # negative zeros
    ((120, 127), 0xFE, 1.0),          # negative codes only (-4, -6)
])
def test_extreme_scales_and_codes(scales, codes, x_scale, isas):
    code = None if codes is None else torch.tensor(codes, dtype=torch.uint8)
    layer = Layer(160, 64, 3, seed=scales[1], scales=scales, codes=code)
    weights, ids = shared_routing((2, 1, 1))
    x = bf16_x(4, 160, seed=5, scale=x_scale)
    expected = layer.reference(x, weights, ids)
    for isa in isas:
        assert_close(layer.native(x.float(), weights, ids, isa), expected)


@pytest.mark.parametrize("rows", [(1, 1, 1, 1), (2, 0, 3, 1), (8, 4, 0, 0)])
def test_two_threads_give_the_single_thread_bits(rows, isas):
    layer = Layer(2880 // 9, 96, 4, seed=7)           # 10 groups: two whole blocks and a half
    weights, ids = shared_routing(rows, k=2)
    x = bf16_x(len(ids), layer.H, seed=8).float()
    before = torch.get_num_threads()
    try:
        for isa in isas:
            torch.set_num_threads(1)
            one = layer.native(x, weights, ids, isa)
            torch.set_num_threads(2)
            assert torch.equal(layer.native(x, weights, ids, isa), one), isa
    finally:
        torch.set_num_threads(before)


def test_hidden_states_not_exactly_bf16_take_the_fp32_route(bf16_isa):
    """fp32 values, or bf16 ones with a tiny nonzero (vdpbf16ps would flush its products):
    the avx512 build's bits; exact bf16 values: the bf16 route, equally close."""
    layer = Layer(224, 96, 2, seed=11)
    weights, ids = shared_routing((3, 2))
    fp32 = torch.randn(5, 224, generator=torch.Generator().manual_seed(12))
    tiny = bf16_x(5, 224, seed=13).float()
    tiny[2, 77] = 2.0 ** -110                      # expert 0's block: tokens 0-2
    assert torch.equal(layer.native(fp32, weights, ids, bf16_isa),
                       layer.native(fp32, weights, ids, "avx512"))
    out, fp32_route = (layer.native(tiny, weights, ids, i) for i in (bf16_isa, "avx512"))
    assert torch.equal(out[:3], fp32_route[:3])
    assert not torch.equal(out[3:], fp32_route[3:])   # expert 1's block is exactly bf16
    exact = bf16_x(5, 224, seed=13).float()
    out = layer.native(exact, weights, ids, bf16_isa)
    assert not torch.equal(out, layer.native(exact, weights, ids, "avx512"))
    assert_close(out, layer.reference(exact, weights, ids))


def test_consecutive_calls_never_reuse_packed_inputs(isas):
    """The bf16 build keeps a thread's packed hidden states between the row tiles of one
    call; decode steps call the same layer with the same buffer and new values. With dense
    down weights nothing else is packed in between."""
    layer = Layer(160, 64, 4, seed=21)
    down = torch.stack([layer.down.expert(e, torch.float32) for e in range(4)])
    weights, ids = shared_routing((1, 0, 0, 0))
    xs = [bf16_x(1, 160, seed=s).float() for s in range(3)]

    def native(x: torch.Tensor, isa: str) -> torch.Tensor:
        return kernels.moe_experts(
            x, weights, ids, 0, (layer.gate_up.blocks, layer.gate_up.scales),
            layer.gate_up_bias, (down, None), layer.down_bias, ALPHA, LIMIT, isa)

    for isa in isas:
        fresh = [native(x, isa) for x in xs]
        again = [native(x, isa) for x in reversed(xs)]
        for a, b in zip(fresh, reversed(again)):
            assert torch.equal(a, b), isa
        assert not torch.equal(fresh[0], fresh[1])
        assert_close(fresh[1], layer.reference(xs[1], weights, ids))
