// The AVX-512 vector abstraction of moe_impl.h (see there), shared by the "avx512" and
// "avx512_bf16" builds: include inside their anonymous namespace, after their target pragma
// (the code is compiled once per build, with that build's instructions).
#pragma once

#include "simd_avx512.h"

struct V512 {
  static constexpr int W = 16, NB = 8, kChains = 8, kChainsFp4 = 8;
  // MXFP4 weight rows per x load (moe_impl.h; 2 at 8 token rows, for the registers).
  // 4 rows against 2: 4 x 4 independent accumulator chains and one x load per 4 rows at one
  // token row. Measured (one thread, CPU ms): L3-resident 4 experts of hidden 1024, 1 token
  // 0.313 -> 0.27, 4 tokens on 4 experts 0.75 -> 0.66; DRAM-streamed 20b layers +20-25 %.
  static constexpr int kRowBlock = 4;
  static constexpr bool kScaledDecode = true;
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) { return load_bf16x16(p); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T a) { return hsum16(a); }
  // vpermps looks up the 16-entry table with the low 4 bits of each dword: the code
  // bytes widened to dwords index the low nibbles directly, shifted by 4 the high ones.
  static void fp4x2(const uint8_t* codes, T* out) {
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m512i bytes = _mm512_cvtepu8_epi32(packed);
    out[0] = _mm512_permutexvar_ps(bytes, lut);                          // even columns
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut);    // odd columns
  }
  // The same with the table scaled first: one multiply for the whole group.
  static void fp4x2_scaled(const uint8_t* codes, float scale, T* out) {
    const __m512 lut = _mm512_mul_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
        _mm512_set1_ps(scale));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m512i bytes = _mm512_cvtepu8_epi32(packed);
    out[0] = _mm512_permutexvar_ps(bytes, lut);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut);
  }
};
