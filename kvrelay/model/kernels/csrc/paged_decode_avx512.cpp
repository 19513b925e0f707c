// AVX-512 build of the paged decode kernel (F + BW + VL + DQ, the set moe_op.cpp checks
// before choosing "avx512"): 16 floats per vector. See paged_decode_simd.h.
#include "paged_decode.h"
#include "paged_decode_prefetch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace {

#include "paged_decode_avx512_p.h"

#include "paged_decode_simd.h"

}  // namespace

void kvrelay::decode_tasks_avx512(const DecodeProblem& p, int64_t begin, int64_t end,
                                  float* scratch) {
  pick_decode<1, 8>(decode_padded(p.D) / P::W)(p, begin, end, scratch);
}

#endif
