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
  static float hsum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
