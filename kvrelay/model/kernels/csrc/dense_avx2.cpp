// AVX2 + FMA build of the dense decode kernel (bf16 weights widened to fp32 in registers);
// chosen at run time (dense_op.cpp).
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {

#include "simd_avx2.h"

struct V {
  static constexpr int W = 8, MR = 2;  // 16 ymm registers: 4 x 2 accumulators + operands
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) { return load_bf16x8(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float hsum(T a) { return hsum8(a); }
  static void sum4(T a, T b, T c, T d, float* out) { _mm_storeu_ps(out, sum4x8(a, b, c, d)); }
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
