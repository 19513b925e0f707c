// AVX2 + FMA build of the dense decode kernel (bf16 weights widened to fp32 in registers);
// chosen at run time (dense_op.cpp).
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx2,fma")

namespace {

struct V {
  static constexpr int W = 8, MR = 2;  // 16 ymm registers: 4 x 2 accumulators + operands
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) {
    const __m128i bf16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float hsum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // hadd pairs lanes within each 128-bit half: after two rounds the low half holds the
  // four low-half sums and the high half the four high-half sums, added last
  static void sum4(T a, T b, T c, T d, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};

#include "dense_impl.h"

}  // namespace

bool kvrelay::dense_avx2(DenseKernels* out) {
  *out = DenseKernels{"avx2", &dense_fma, nullptr};
  return true;
}

#else
bool kvrelay::dense_avx2(DenseKernels*) { return false; }
#endif
