// AVX-512 build of the prefill attention kernel; chosen at run time (prefill_op.cpp).
#include "prefill.h"

#if defined(__x86_64__) || defined(__i386__)
#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512)

namespace {
constexpr int64_t kVecFloats = 16;  // zmm
#include "prefill_impl.h"
}  // namespace

bool kvrelay::prefill_avx512(PrefillFn* out) {
  *out = &prefill_tasks;
  return true;
}

#else
bool kvrelay::prefill_avx512(PrefillFn*) { return false; }
#endif
