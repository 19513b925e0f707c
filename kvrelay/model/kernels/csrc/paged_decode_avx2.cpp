// AVX2 + FMA + F16C build of the paged decode kernel: 8 floats per vector. See
// paged_decode_simd.h.
#include "paged_decode.h"
#include "paged_decode_prefetch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {

#include "simd_avx2.h"

struct P {
  static constexpr int W = 8;
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float hsum(T a) { return hsum8(a); }
  static float hmax(T a) { return hmax8(a); }
  static __m256i lanes(int n) {   // all-ones in the first n lanes
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static T first(T x, int n, float fill) {
    return n >= 8 ? x : _mm256_blendv_ps(set1(fill), x, _mm256_castsi256_ps(lanes(n)));
  }
  static T load_f32(const float* p, int n) {
    return n >= 8 ? load(p) : _mm256_maskload_ps(p, lanes(n));
  }
  static __m128i load_u16(const uint16_t* p, int n) {   // no masked 16-bit loads in AVX2
    if (n >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    __builtin_memcpy(tmp, p, sizeof(uint16_t) * n);
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  static T load_bf16(const uint16_t* p, int n) { return bf16x8_to_f32(load_u16(p, n)); }
  static T load_f16(const uint16_t* p, int n) { return _mm256_cvtph_ps(load_u16(p, n)); }
  static T exp_neg(T x) { return exp_neg8(x); }   // e^x for x <= 0
  // lane j = the sum of a[j]'s 8 lanes: pairwise horizontal adds, then the 128-bit halves
  static T transpose_sum(const T* a) {
    const T h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
    const T h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
    const T g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    return add(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
  }
};

#include "paged_decode_simd.h"
#include "paged_decode_avx2_tiles.h"

}  // namespace

void kvrelay::decode_tasks_avx2(const DecodeProblem& p, int64_t begin, int64_t end,
                                float* scratch) {
  pick_decode<1, 8, Bf16Tiles>(decode_padded(p.D) / P::W)(p, begin, end, scratch);
}

#endif
