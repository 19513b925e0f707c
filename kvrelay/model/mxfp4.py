"""MXFP4: 4-bit e2m1 values in blocks of 32 sharing one power-of-two scale.

On disk (gpt-oss): `<name>_blocks` `[E, out, in/32, 16]` uint8 — two FP4 codes per
byte, the low nibble the even element — and `<name>_scales` `[E, out, in/32]` uint8,
an E8M0 exponent biased by 127. Value = FP4_VALUES[code] · 2^(scale-127).

`MXFP4Tensor` keeps the packed bytes in memory (4.25 bits per weight) and
dequantises one expert at a time when it is used.
"""
from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


# Byte → its two values (low nibble first) and E8M0 byte → 2^(s-127), in float32 (every
# product value · scale is exact there; one rounding to the target dtype, as ldexp does).
_PAIRS = torch.tensor(FP4_VALUES)[torch.stack((torch.arange(256) & 0x0F,
                                               torch.arange(256) >> 4), dim=-1)]  # [256, 2]
_SCALES = torch.ldexp(torch.ones(256), torch.arange(256) - 127)                  # [256]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents → [..., G*32] values.

    Two table lookups (a code byte's pair of values, a group's scale) and one multiply:
    ~2× faster than decoding the nibbles separately, with bit-identical results."""
    pairs, table = _PAIRS.to(blocks.device), _SCALES.to(blocks.device)
    values = pairs.index_select(0, blocks.reshape(-1).long()).view(*scales.shape, 2 * 16)
    values = values * table.index_select(0, scales.reshape(-1).long()).view(*scales.shape, 1)
    return values.to(dtype).flatten(-2)                                    # [..., G*32]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of `weight` [..., in] (in % 32 == 0) → (blocks, scales).

    Used to write test checkpoints in the official layout; the scale is chosen so the
    block's largest magnitude fits in ±6.
    """
    *lead, n = weight.shape
    if n % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {n}")
    w = weight.float().reshape(*lead, n // BLOCK, BLOCK)                    # [..., G, 32]
    amax = w.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)              # [..., G]
    scaled = w / torch.exp2(exp)[..., None]
    grid = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - grid).abs().argmin(-1)              # [..., G, 32]
    codes = codes + 8 * ((scaled < 0) & (codes > 0)).long()
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [..., G, 16]
    return packed, (exp + 127).to(torch.uint8)


class MXFP4Tensor:
    """A packed `[E, out, in]` expert weight; `expert(e)` dequantises one `[out, in]`."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError("MXFP4 blocks and scales must be uint8")
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                             f"{tuple(scales.shape)}")
        self.blocks, self.scales = blocks, scales

    @property
    def shape(self) -> tuple[int, int, int]:
        e, out, groups, _ = self.blocks.shape
        return e, out, groups * BLOCK

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.blocks[e], self.scales[e], dtype)            # [out, in]

    def to(self, device: torch.device) -> MXFP4Tensor:
        return MXFP4Tensor(self.blocks.to(device), self.scales.to(device))
