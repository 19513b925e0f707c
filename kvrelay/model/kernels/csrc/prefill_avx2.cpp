// AVX2 + FMA build of the prefill attention kernel; chosen at run time (prefill_op.cpp).
#include "prefill.h"

#if defined(__x86_64__) || defined(__i386__)
#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {
// 8-float vectors (ymm). GCC vectorises the softmax's exp_neg loop (its clamp next to
// nearbyint) only without -ftrapping-math; the kernel never enables or reads FP traps, so
// dropping it changes no result.
#pragma GCC optimize("no-trapping-math")
constexpr int64_t kVecFloats = 8;
#include "prefill_impl.h"
}  // namespace

bool kvrelay::prefill_avx2(PrefillFn* out) {
  *out = &prefill_tasks;
  return true;
}

#else
bool kvrelay::prefill_avx2(PrefillFn*) { return false; }
#endif
