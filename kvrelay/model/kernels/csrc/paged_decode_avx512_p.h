// The AVX-512 vector type P of the paged decode kernels (16 floats; the operations
// paged_decode_simd.h lists), shared by paged_decode_avx512.cpp and
// paged_decode_avx512_bf16.cpp. Included inside their anonymous namespace, after their
// KVRELAY_TARGET line; no include guard for that reason.

#include "simd_avx512.h"

struct P {
  static constexpr int W = 16;
  using T = __m512;
  static __mmask16 lanes(int n) {   // the first n lanes (n <= 0: none)
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
  }
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float hsum(T a) { return hsum16(a); }
  static float hmax(T a) { return hmax16(a); }
  static T first(T x, int n, float fill) { return _mm512_mask_blend_ps(lanes(n), set1(fill), x); }
  static T load_f32(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
  static T load_bf16(const uint16_t* p, int n) {
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(lanes(n), p));
  }
  static T load_f16(const uint16_t* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p));
  }
  static T exp_neg(T x) { return exp_neg16(x); }   // e^x for x <= 0
  // lane j = the sum of a[j]'s 16 lanes: halves, quarters, pairs and single lanes folded
  // in four rounds (15 adds for 16 sums). The rounds leave the sum of input m in lane
  // 4·(m % 4) + m / 4, so the inputs are taken in that order.
  static T transpose_sum(const T* a) {
    T b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) {
      const T x = a[kOrder[2 * i]], y = a[kOrder[2 * i + 1]];
      b[i] = add(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; ++i)
      c[i] = add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                 _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
      d[i] = add(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                 _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return add(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  }
  static constexpr int kOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
};
