// AVX2 + FMA helpers on 8-float vectors, shared by every family's AVX2 build: bf16 loads,
// horizontal sums and maxima, e^x. Include as simd_generic.h says (inside the anonymous
// namespace), after <immintrin.h> and KVRELAY_TARGET(KVRELAY_ISA_AVX2) or a superset.
#pragma once

#include "simd_generic.h"

// 8 bf16 → 8 f32: widened and shifted up 16 (exact)
inline __m256 bf16x8_to_f32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the halves added, then pairs, then the last two
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [Σa, Σb, Σc, Σd]: hadd pairs lanes within each 128-bit half, so after two rounds the low
// half holds the four low-half sums and the high half the four high-half sums, added last
inline __m128 sum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// e^x for x <= 0 (simd_generic.h's exp_neg, on 8 lanes)
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 q = _mm256_set1_ps(1.9875691500e-4f);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894e-2f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459e-1f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201e-1f));
  q = _mm256_fmadd_ps(_mm256_mul_ps(q, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(q, _mm256_castsi256_ps(bits));
}
