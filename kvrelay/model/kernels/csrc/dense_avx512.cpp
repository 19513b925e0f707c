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
  static T fused(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }  // one rounding
  static T set1(float a) { return _mm512_set1_ps(a); }
  static void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  // each lane rounded to bf16 and widened back, as f32_to_bf16 then bf16_to_f32
  static T round_bf16(T a) {
    const __m512i u = _mm512_castps_si512(a), high = _mm512_set1_epi32(int(0xFFFF0000u));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i near = _mm512_and_si512(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), high);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, high), _mm512_set1_epi32(0x400000));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_castsi512_ps(near),
                                _mm512_castsi512_ps(quiet));
  }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float hsum(T a) { return hsum16(a); }
  static void sum4(T a, T b, T c, T d, float* out) { _mm_storeu_ps(out, sum4x16(a, b, c, d)); }
};

#include "dense_impl.h"

}  // namespace

bool kvrelay::dense_avx512(DenseKernels* out) {
  *out = DenseKernels{"avx512", &dense_fma, nullptr, &dense_ordered, &dense_ordered_argmax};
  return true;
}

#else
bool kvrelay::dense_avx512(DenseKernels*) { return false; }
#endif
