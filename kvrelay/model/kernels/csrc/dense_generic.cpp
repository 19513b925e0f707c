// Portable build of the dense decode kernel (any CPU; the compiler's baseline vectorisation).
#include "dense.h"

namespace {

#include "simd_generic.h"

struct V {
  static constexpr int W = 1, MR = 4;
  using T = float;
  static T zero() { return 0.0f; }
  static T load(const float* p) { return *p; }
  static T load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T fused(T a, T b, T c) { return __builtin_fmaf(a, b, c); }  // one rounding
  static T set1(float a) { return a; }
  static void store(float* p, T a) { *p = a; }
  static T round_bf16(T a) { return bf16_to_f32(f32_to_bf16(a)); }
  static T add(T a, T b) { return a + b; }
  static float hsum(T a) { return a; }
  static void sum4(T a, T b, T c, T d, float* out) {
    out[0] = a, out[1] = b, out[2] = c, out[3] = d;
  }
};

#include "dense_impl.h"

}  // namespace

bool kvrelay::dense_generic(DenseKernels* out) {
  *out = DenseKernels{"generic", &dense_fma, nullptr, &dense_ordered, &dense_ordered_argmax};
  return true;
}
