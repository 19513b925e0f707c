// AVX2 + FMA build of the MoE and paged decode kernels; chosen at run time (moe_op.cpp),
// so the rest of the extension stays runnable on CPUs without AVX2.
#include "moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {

#include "simd_avx2.h"

struct V {
  static constexpr int W = 8, NB = 4, kChains = 8, kChainsFp4 = 4;
  // MXFP4 weight rows per x load (moe_impl.h). Two rows need ~17 of the 16 ymm registers
  // at 2-4 token rows (a spill or two), yet measured (gpt-oss-20b layer, 4 experts, forced
  // AVX2 on Zen 4, one thread, CPU ms) 2/4/8 tokens per expert 8.0/14.7/27.5 with one row
  // against 7.7/11.0/21.4 with two: FMA-bound, the x loads and loop overhead halve.
  static constexpr int kRowBlock = 2;
  static constexpr bool kScaledDecode = false;
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) { return load_bf16x8(p); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(T a) { return hsum8(a); }
  static void fp4x2(const uint8_t* codes, T* out) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(packed, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));   // even columns
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));   // odd columns
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
  static void fp4x2_scaled(const uint8_t* codes, float scale, T* out) {
    fp4x2(codes, out);
    const T s = set1(scale);
    for (int c = 0; c < 4; ++c) out[c] = mul(out[c], s);
  }
  static bool mxfp4_bf16(const kvrelay::Projection&, int64_t, int64_t, int64_t, const float*,
                         int64_t, float*, int64_t) {
    return false;   // no bf16 dot products in this build
  }
  static void inputs_changed() {}
};

#include "moe_impl.h"
#include "paged_decode_impl.h"

}  // namespace

bool kvrelay::avx2_kernels(IsaKernels* out) {
  *out = IsaKernels{"avx2", &gate_up_tiles, &down_tiles, &decode_tasks};
  return true;
}

#else
bool kvrelay::avx2_kernels(IsaKernels*) { return false; }
#endif
