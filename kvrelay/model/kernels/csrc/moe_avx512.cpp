// AVX-512 build of the MoE and paged decode kernels (F + BW + VL + DQ: Skylake-SP, Zen 4
// and later); chosen at run time (moe_op.cpp).
#include "moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
// Auto-vectorised loops (the paged decode kernel) in 256-bit vectors, as GCC's own tuning
// for AVX-512 CPUs does; the MoE intrinsics stay 512-bit. Measured 4-9% faster on decode
// shapes (Zen 4) than 512-bit; clang does not take the option in a target pragma.
#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512)
#if !defined(__clang__)
#pragma GCC target("prefer-vector-width=256")
#endif

namespace {

#include "moe_avx512_v.h"

struct V : V512 {
  static bool mxfp4_bf16(const kvrelay::Projection&, int64_t, int64_t, int64_t, const float*,
                         int64_t, float*, int64_t) {
    return false;   // no bf16 dot products in this build (moe_avx512_bf16.cpp has them)
  }
  static void inputs_changed() {}
};

#include "moe_impl.h"
#include "paged_decode_impl.h"

}  // namespace

bool kvrelay::avx512_kernels(IsaKernels* out) {
  *out = IsaKernels{"avx512", &gate_up_tiles, &down_tiles, &decode_tasks};
  return true;
}

#else
bool kvrelay::avx512_kernels(IsaKernels*) { return false; }
#endif
