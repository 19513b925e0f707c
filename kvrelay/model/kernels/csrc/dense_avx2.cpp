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
  static T fused(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }  // one rounding
  static T set1(float a) { return _mm256_set1_ps(a); }
  static void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  // each lane rounded to bf16 and widened back, as f32_to_bf16 then bf16_to_f32
  static T round_bf16(T a) {
    const __m256i u = _mm256_castps_si256(a), high = _mm256_set1_epi32(int(0xFFFF0000u));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i near = _mm256_and_si256(
        _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), high);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x400000));
    return _mm256_blendv_ps(_mm256_castsi256_ps(near), _mm256_castsi256_ps(quiet),
                            _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float hsum(T a) { return hsum8(a); }
  static void sum4(T a, T b, T c, T d, float* out) { _mm_storeu_ps(out, sum4x8(a, b, c, d)); }
};

#include "dense_impl.h"

}  // namespace

bool kvrelay::dense_avx2(DenseKernels* out) {
  *out = DenseKernels{"avx2", &dense_fma, nullptr, &dense_ordered, &dense_ordered_argmax};
  return true;
}

#else
bool kvrelay::dense_avx2(DenseKernels*) { return false; }
#endif
