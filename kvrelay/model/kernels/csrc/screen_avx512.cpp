// AVX-512 build of the screen (screen.h, screen_impl.h): a block's 16 rows in one register,
// int8 codes widened to int16 pairs and multiplied with the input's pairs (vpmaddwd).
// Chosen at run time (screen_op.cpp).
#include "screen.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512)

namespace {

#include "simd_avx512.h"

struct D {
  static constexpr int MR = 8;   // 32 zmm: 8 accumulators, the codes, the broadcasts

  using F = __m512;
  static constexpr int W = 16;
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F a) { _mm512_store_ps(p, a); }
  static F ints(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_load_si512(p)); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static bool any_ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) != 0; }

  template <int R>
  static void dots(const int8_t* q, const int32_t* x, int64_t pairs, int64_t kp0, int64_t kp1,
                   int32_t* acc) {
    __m512i a[R];
    for (int m = 0; m < R; ++m) a[m] = _mm512_loadu_si512(acc + 16 * m);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const __m512i w =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kp * 32)));
      for (int m = 0; m < R; ++m)
        a[m] = _mm512_add_epi32(a[m], _mm512_madd_epi16(w, _mm512_set1_epi32(x[m * pairs + kp])));
    }
    for (int m = 0; m < R; ++m) _mm512_storeu_si512(acc + 16 * m, a[m]);
  }
};

#include "screen_impl.h"

}  // namespace

bool kvrelay::screen_avx512(ScreenKernels* out) {
  *out = ScreenKernels{"avx512", &screen_blocks};
  return true;
}

#else
bool kvrelay::screen_avx512(ScreenKernels*) { return false; }
#endif
