// exp(x) for x <= 0 in float, the one scalar copy the attention kernels share
// (paged_decode_generic.cpp, paged_decode_simd.h, prefill_impl.h): x = n ln2 + r,
// |r| <= ln2/2, a degree-6 polynomial for e^r and 2^n through the exponent bits.
// Branch-free so loops over keys vectorise (expf does not without -ffast-math); relative
// error ~2e-7, clamped at x = -87 (~1e-38). The SIMD builds' vector `P::exp_neg` is the
// same polynomial on whole registers.
//
// No include guard on purpose: each ISA file includes this inside its own anonymous
// namespace (after its `#pragma GCC target`), and one translation unit may hold several.
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
