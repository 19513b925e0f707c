// AVX-512 builds of the dense decode kernel, chosen at run time (dense_op.cpp):
// "avx512" (F + BW + VL + DQ) widens bf16 weights to fp32 in registers; "avx512_bf16"
// (dense_avx512_bf16.cpp) multiplies bf16 pairs natively.
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

namespace {

struct V {
  static constexpr int W = 16, MR = 4;  // 32 zmm registers: up to 4 x 4 accumulators
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) {
    const __m256i bf16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float hsum(T a) { return _mm512_reduce_add_ps(a); }
  static void sum4(T a, T b, T c, T d, float* out) {  // halves added, then the AVX2 tree
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};

#include "dense_impl.h"

}  // namespace

bool kvrelay::dense_avx512(DenseKernels* out) {
  *out = DenseKernels{"avx512", &dense_fma, nullptr};
  return true;
}

#else
bool kvrelay::dense_avx512(DenseKernels*) { return false; }
#endif
