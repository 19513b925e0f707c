// AVX-512 build of the MoE kernels (F + BW + VL + DQ: Skylake-SP, Zen 4 and later);
// chosen at run time (moe_op.cpp).
#include "moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace {

struct V {
  static constexpr int W = 16, NB = 8, kChains = 8, kChainsFp4 = 8;
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) {
    const __m256i bf16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i wide = _mm512_cvtepu16_epi32(bf16);
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T a) { return _mm512_reduce_add_ps(a); }
  static void fp4x2(const uint8_t* codes, T* out) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(packed, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(lo, hi)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(lo, hi)));
  }
};

#include "moe_impl.h"

}  // namespace

bool kvrelay::avx512_kernels(IsaKernels* out) {
  *out = IsaKernels{"avx512", &gate_up_tiles, &down_tiles};
  return true;
}

#else
bool kvrelay::avx512_kernels(IsaKernels*) { return false; }
#endif
