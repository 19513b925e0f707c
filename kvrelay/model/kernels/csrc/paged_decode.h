// Plain-C++ contract between the torch-facing paged decode op (paged_decode_op.cpp) and
// its per-ISA builds (paged_decode_impl.h, compiled inside moe_generic.cpp, moe_avx2.cpp,
// moe_avx512.cpp). No torch or STL here, for the reason moe.h gives.
#pragma once
#include <stdint.h>

namespace kvrelay {

enum KvFormat : int32_t { kKvF32 = 0, kKvBF16 = 1, kKvF16 = 2 };

// Decode attention, one query token per sequence, reading the paged cache in place:
//
//   q [S, H, D] f32, kv [2, NB, KVH, B, D] (K plane, then V plane) in `format`,
//   table [S, maxb] block ids, lens [S] context after this step, sinks [H] f32
//     → out [S, H, D] f32
//
// Work item `task` = seq · KVH + kv_head: the G = H / KVH query heads of that KV head.
struct DecodeProblem {
  int32_t format;
  const float* q;
  const void* kv;
  const int64_t* table;
  const int64_t* lens;
  const float* sinks;
  float* out;
  int64_t S, H, KVH, D, B, NB, maxb;
  int64_t window;   // 0: full attention; else positions [len - window, len) are visible
  float scale;
};

// Floats of scratch one thread needs for `DecodeFn` (q, accumulators, scores, one block
// of K and V in f32).
inline int64_t decode_scratch_floats(const DecodeProblem& p) {
  const int64_t G = p.H / p.KVH;
  return 2 * G * p.D + 2 * G + G * p.B + 2 * p.B * p.D;
}

// Runs work items [begin, end) with `scratch` (decode_scratch_floats of them).
using DecodeFn = void (*)(const DecodeProblem&, int64_t begin, int64_t end, float* scratch);

}  // namespace kvrelay
