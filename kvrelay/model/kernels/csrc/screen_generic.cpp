// Portable build of the screen (screen.h, screen_impl.h): the compiler's baseline vectors.
#include "screen.h"

namespace {

#include "simd_generic.h"

struct D {
  static constexpr int MR = 4;

  using F = float;
  static constexpr int W = 1;
  static F set1(float a) { return a; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F a) { *p = a; }
  static F ints(const int32_t* p) { return static_cast<float>(*p); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F abs(F a) { return __builtin_fabsf(a); }
  static bool any_ge(F a, F b) { return a >= b; }

  template <int R>
  static void dots(const int8_t* q, const int32_t* x, int64_t pairs, int64_t kp0, int64_t kp1,
                   int32_t* acc) {
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const int8_t* step = q + kp * 32;
      for (int m = 0; m < R; ++m) {
        const uint32_t pair = static_cast<uint32_t>(x[m * pairs + kp]);
        const int32_t x0 = static_cast<int16_t>(pair & 0xFFFFu);
        const int32_t x1 = static_cast<int16_t>(pair >> 16);
        int32_t* row = acc + 16 * m;
#pragma omp simd
        for (int i = 0; i < 16; ++i) row[i] += step[2 * i] * x0 + step[2 * i + 1] * x1;
      }
    }
  }
};

#include "screen_impl.h"

}  // namespace

bool kvrelay::screen_generic(ScreenKernels* out) {
  *out = ScreenKernels{"generic", &screen_blocks};
  return true;
}
