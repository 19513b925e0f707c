// Portable build of the prefill attention kernel (any CPU; the compiler's baseline vectors).
#include "prefill.h"

namespace {
constexpr int64_t kVecFloats = 4;  // the baseline's 128-bit vectors (SSE2, NEON)
#include "prefill_impl.h"
}  // namespace

bool kvrelay::prefill_generic(PrefillFn* out) {
  *out = &prefill_tasks;
  return true;
}
