// AVX2 build of the screen (screen.h, screen_impl.h): int8 codes widened to int16 pairs,
// multiplied with the input's int16 pairs and summed into int32 (vpmaddwd), 16 rows per block
// as two 8-lane halves. Chosen at run time (screen_op.cpp).
#include "screen.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {

#include "simd_avx2.h"

struct D {
  static constexpr int MR = 4;   // 16 ymm: 4 x 2 accumulators, the two halves, the broadcast

  using F = __m256;
  static constexpr int W = 8;
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F a) { _mm256_store_ps(p, a); }
  static F ints(const int32_t* p) {
    return _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static bool any_ge(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }

  template <int R>
  static void dots(const int8_t* q, const int32_t* x, int64_t pairs, int64_t kp0, int64_t kp1,
                   int32_t* acc) {
    __m256i a[R][2];
    for (int m = 0; m < R; ++m) {
      a[m][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 16 * m));
      a[m][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 16 * m + 8));
    }
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const int8_t* step = q + kp * 32;
      const __m256i w0 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
      const __m256i w1 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16)));
      for (int m = 0; m < R; ++m) {
        const __m256i xb = _mm256_set1_epi32(x[m * pairs + kp]);
        a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(w0, xb));
        a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(w1, xb));
      }
    }
    for (int m = 0; m < R; ++m) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 16 * m), a[m][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 16 * m + 8), a[m][1]);
    }
  }
};

#include "screen_impl.h"

}  // namespace

bool kvrelay::screen_avx2(ScreenKernels* out) {
  *out = ScreenKernels{"avx2", &screen_blocks};
  return true;
}

#else
bool kvrelay::screen_avx2(ScreenKernels*) { return false; }
#endif
