"""MXFP4 decoding and packed-in-memory experts."""
from __future__ import annotations

import torch

from kvrelay.model import mxfp4
from kvrelay.model.loader import load_model
from tests.factories import make_hf_model, save_checkpoint


def test_dequantize_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    # [E, out, G, 16]
    blocks = torch.randint(0, 256, (3, 40, 6, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 40, 6), dtype=torch.uint8, generator=g)     # [E, out, G]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)          # [E, in, out]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)                            # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)
    theirs_bf16 = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).transpose(1, 2),
                       theirs_bf16)


def test_nibble_order_and_scale():
    # low nibble = even element; code 0x1 = 0.5, 0xF = -6.0; scale byte 128 = ×2
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0xF1
    values = mxfp4.dequantize(blocks, torch.tensor([128], dtype=torch.uint8))
    assert values[:2].tolist() == [1.0, -12.0] and values[2:].abs().sum() == 0


def test_quantize_round_trips_representable_values():
    grid = torch.tensor(mxfp4.FP4_VALUES)
    w = grid[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(1))]
    w[:, 0] = 6.0                                        # every block's max maps to ±6 exactly
    w[:, 32] = -6.0
    blocks, scales = mxfp4.quantize(w * 0.25)
    assert torch.equal(mxfp4.dequantize(blocks, scales), w * 0.25)


def test_packed_experts_use_about_a_quarter_of_the_memory(tmp_path):
    hf = make_hf_model(seed=3, hidden_size=128, intermediate_size=256, num_local_experts=8)
    path = save_checkpoint(hf, tmp_path, mxfp4_experts=True)
    packed = load_model(path, dtype=torch.bfloat16, progress=False)
    dense = load_model(path, dtype=torch.bfloat16, quantization=None, progress=False)
    assert packed.mxfp4_on_disk and dense.mxfp4_on_disk
    experts_packed = packed.model.layers[0].mlp.experts
    experts_dense = dense.model.layers[0].mlp.experts
    weights = 8 * (2 * 256 * 128 + 128 * 256)
    assert isinstance(experts_packed.gate_up, mxfp4.MXFP4Tensor)
    # 4.25 bits per weight packed, 16 bits per weight in bf16, plus the same biases
    biases = experts_dense.gate_up_bias.nbytes + experts_dense.down_bias.nbytes
    assert experts_packed.nbytes() - biases == weights * 17 // 32
    assert experts_dense.nbytes() - biases == weights * 2
    assert packed.weight_bytes < dense.weight_bytes
