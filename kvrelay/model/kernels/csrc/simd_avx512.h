// AVX-512 (F + BW + DQ + VL) helpers on 16-float vectors, shared by every family's
// AVX-512 builds ("avx512" and "avx512_bf16"): bf16 loads, horizontal sums, e^x. Include
// as simd_generic.h says (inside the anonymous namespace), after <immintrin.h> and
// KVRELAY_TARGET(KVRELAY_ISA_AVX512) or a superset.
#pragma once

#include "simd_generic.h"

// 16 bf16 → 16 f32: widened and shifted up 16 (exact)
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline float hsum16(__m512 a) { return _mm512_reduce_add_ps(a); }

inline float hmax16(__m512 a) { return _mm512_reduce_max_ps(a); }

// [Σa, Σb, Σc, Σd]: each vector's halves added, then one AVX2 reduction tree for all four
// (a third of the instructions of four separate horizontal sums)
inline __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// e^x for x <= 0 (simd_generic.h's exp_neg, on 16 lanes)
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 q = _mm512_set1_ps(1.9875691500e-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  q = _mm512_fmadd_ps(_mm512_mul_ps(q, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(q, _mm512_castsi512_ps(bits));
}
