"""Rotary position embedding: rotate-half RoPE with optional YaRN scaling.

YaRN (gpt-oss: theta 150000, factor 32, beta_fast 32, beta_slow 1, original context
4096, no truncation of the correction range) blends interpolated and extrapolated
frequencies along a linear ramp over the rotary dims, and scales cos/sin by
0.1·ln(factor) + 1.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvrelay.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, cos/sin scale)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim   # [hd/2]
    pos_freqs = rope.theta ** exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # the rotary dim whose wavelength fits `rotations` times in the original context
        return (head_dim * math.log(rope.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp                                            # [hd/2]
    inv_freq = interpolation * ramp + extrapolation * extrapolation_weight
    return inv_freq, rope.scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]                         # [max_pos, hd/2]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        # the last step's (positions, its version, dtype, cos, sin): every layer of a step
        # rotates the same positions, so the gather and casts run once per step, not per layer
        self._last: tuple[torch.Tensor, int, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # (the cached cos it was built from, [cos, cos], [-sin, sin]) for `rotate`
        self._wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, hd] rotated: q and k heads side by side take one call.
        Four elementwise ops on full-width tables instead of `_rotate`'s seven (a prefill
        of hundreds of rows pays per op, and per OpenMP barrier where cores are shared);
        the same values bit for bit (see `_rotate_wide`)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if torch.compiler.is_compiling():
            return _rotate(x, cos, sin)
        last = self._wide
        if last is None or last[0] is not cos:
            last = self._wide = (cos, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        return _rotate_wide(x, last[1], last[2])

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_positions, hd/2] float32, scaled: the native fused decode
        (`PagedAttention.rope_attend`) gathers and rounds the rows itself."""
        cos, sin = self.cos, self.sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)     # buffers
        return cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, hd/2] of `positions` in `dtype` (cast after the gather, as
        the reference does, so the values are the same)."""
        if torch.compiler.is_compiling():                  # the graph computes it once anyway
            return self._gather(positions, dtype)
        # inference tensors (the runner's) have no version counter; the runner builds new
        # positions every step and nothing writes them in place
        version = 0 if positions.is_inference() else positions._version
        last = self._last
        if last is not None and last[0] is positions and last[1] == version and last[2] == dtype:
            return last[3], last[4]
        cos, sin = self._gather(positions, dtype)
        self._last = (positions, version, dtype, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos, self.sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)     # buffers
        return (cos[positions].to(dtype)[:, None, :],                          # [tokens, 1, hd/2]
                sin[positions].to(dtype)[:, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)  # [tokens, heads, hd/2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rotate_wide(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """`_rotate(x, cos, sin)` given cos2 = [cos, cos] and sin2 = [-sin, sin]: each output is
    one product of x and one of the swapped halves, rounded as `_rotate` rounds them, and
    a - b equals a + (-b) exactly, so the result is the same bit for bit."""
    first, second = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat((second, first), dim=-1) * sin2
