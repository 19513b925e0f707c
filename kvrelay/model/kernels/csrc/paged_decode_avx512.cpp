// AVX-512 build of the paged decode kernel (F + BW + DQ + VL: isa.h): 16 floats per
// vector. See paged_decode_simd.h.
#include "paged_decode.h"
#include "paged_decode_prefetch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512)

namespace {

#include "paged_decode_avx512_p.h"

#include "paged_decode_simd.h"

}  // namespace

void kvrelay::decode_tasks_avx512(const DecodeProblem& p, int64_t begin, int64_t end,
                                  float* scratch) {
  pick_decode<1, 8>(decode_padded(p.D) / P::W)(p, begin, end, scratch);
}

#endif
