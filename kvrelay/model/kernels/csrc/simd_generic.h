// Scalar helpers every kernel build shares (the generic builds' whole toolkit; the SIMD
// builds' tails and scalar steps): bf16 <-> f32 and e^x for x <= 0.
//
// Include inside the including file's anonymous namespace, after its KVRELAY_TARGET line
// (isa.h), so each build compiles its own copy with its own instructions: nothing here is
// a symbol another translation unit could link to.
#pragma once

// bf16 → f32: the bits shifted up 16 (exact)
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// f32 → bf16, round to nearest even (as Tensor.to does), NaN kept quiet
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0 in float, the one scalar copy the attention and MoE kernels share:
// x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r and 2^n through the exponent
// bits. Branch-free so loops over keys vectorise (expf does not without -ffast-math);
// relative error ~2e-7, clamped at x = -87 (~1e-38). The SIMD builds' exp_neg8 / exp_neg16
// (simd_avx2.h, simd_avx512.h) are the same polynomial on whole registers.
inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
