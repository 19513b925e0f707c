// Portable build of the MoE and paged decode kernels (any CPU; the compiler's baseline
// vectorisation).
#include "moe.h"

namespace {

#include "simd_generic.h"

struct V {
  static constexpr int W = 1, NB = 4, kChains = 4, kChainsFp4 = 4;
  static constexpr int kRowBlock = 1;   // MXFP4 weight rows per x load (moe_impl.h)
  static constexpr bool kScaledDecode = false;
  using T = float;
  static T zero() { return 0.0f; }
  static T load(const float* p) { return *p; }
  static T load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static T set1(float v) { return v; }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static float hsum(T a) { return a; }
  static void fp4x2(const uint8_t* codes, T* out) {
    static const int8_t kDoubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    for (int i = 0; i < 16; ++i) {
      out[i] = kDoubled[codes[i] & 0x0F];
      out[16 + i] = kDoubled[codes[i] >> 4];
    }
  }
  static void fp4x2_scaled(const uint8_t* codes, float scale, T* out) {
    fp4x2(codes, out);
    for (int c = 0; c < 32; ++c) out[c] *= scale;
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

bool kvrelay::generic_kernels(IsaKernels* out) {
  *out = IsaKernels{"generic", &gate_up_tiles, &down_tiles, &decode_tasks};
  return true;
}
