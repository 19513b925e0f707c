// Included inside the anonymous namespace of each MoE ISA file (moe_generic.cpp,
// moe_avx2.cpp, moe_avx512.cpp), whose `IsaKernels` entry names `decode_tasks`: forwards
// to the paged decode build of the same ISA, which lives in its own file
// (paged_decode_generic.cpp / _avx2.cpp / _avx512.cpp). The including file's vector width
// V::W tells which: 1 generic, 8 AVX2, 16 AVX-512.
#pragma once

inline void decode_tasks(const kvrelay::DecodeProblem& p, int64_t begin, int64_t end,
                         float* scratch) {
  if constexpr (V::W == 16) {
    kvrelay::decode_tasks_avx512(p, begin, end, scratch);
  } else if constexpr (V::W == 8) {
    kvrelay::decode_tasks_avx2(p, begin, end, scratch);
  } else {
    kvrelay::decode_tasks_generic(p, begin, end, scratch);
  }
}
