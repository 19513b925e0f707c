// AVX-512 builds of the dense decode kernel, chosen at run time (dense_op.cpp):
// "avx512" (F + BW + VL + DQ) widens bf16 weights to fp32 in registers; "avx512_bf16"
// (dense_avx512_bf16.cpp) multiplies bf16 pairs natively.
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512)

namespace {

#include "simd_avx512.h"

struct V {
  static constexpr int W = 16, MR = 4;  // 32 zmm registers: up to 4 x 4 accumulators
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) { return load_bf16x16(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float hsum(T a) { return hsum16(a); }
  static void sum4(T a, T b, T c, T d, float* out) { _mm_storeu_ps(out, sum4x16(a, b, c, d)); }
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
