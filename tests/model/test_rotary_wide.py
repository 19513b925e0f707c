"""`RotaryEmbedding.rotate` (full-width tables, four ops) equals `_rotate` bit for bit."""
from __future__ import annotations

import pytest
import torch

from kvrelay.model.config import RopeConfig
from kvrelay.model.layers.rotary import RotaryEmbedding, _rotate

YARN = RopeConfig(rope_type="yarn", theta=150000.0, factor=32.0, beta_fast=32.0,
                  beta_slow=1.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 2), (7, 3, 6), (203, 12, 64),
                                                   (33, 5, 130)])
def test_rotate_is_bit_identical(dtype: torch.dtype, tokens: int, heads: int,
                                 head_dim: int) -> None:
    rotary = RotaryEmbedding(YARN, head_dim, max_positions=4096)
    gen = torch.Generator().manual_seed(tokens * heads + head_dim)
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 30).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary.cos_sin(positions, dtype)
    expected = _rotate(x, cos, sin)
    for _ in range(2):                                      # built, then from the step cache
        assert torch.equal(rotary.rotate(positions, x), expected)
    later = torch.randint(0, 4096, (tokens,), generator=gen)   # a new step's positions
    cos, sin = rotary.cos_sin(later, dtype)
    assert torch.equal(rotary.rotate(later, x), _rotate(x, cos, sin))
