// Portable build of the prefill attention kernel (any CPU; the compiler's baseline vectors).
#include "prefill.h"

namespace {
#include "prefill_impl.h"
}  // namespace

bool kvrelay::prefill_generic(PrefillFn* out) {
  *out = &prefill_tasks;
  return true;
}
