// Plain-C++ contract between the torch-facing paged decode op (paged_decode_op.cpp) and
// its per-ISA builds (paged_decode_generic.cpp, paged_decode_avx2.cpp,
// paged_decode_avx512.cpp; reached through moe.h's IsaKernels::decode, see
// paged_decode_impl.h). No torch or STL here, for the reason moe.h gives.
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

// Head dims and block rows as the SIMD builds lay them out in scratch: rounded up to
// whole vectors of the widest ISA (16 floats), so their inner loops need no tails.
constexpr int64_t kDecodePad = 16;
inline int64_t decode_padded(int64_t n) { return (n + kDecodePad - 1) / kDecodePad * kDecodePad; }

// Positions whose scores a work item keeps at once (the SIMD builds' softmax chunk: whole
// blocks, at least one): one max, one rescale and one pass over the V rows per chunk
// instead of per block, so the serial chain a block used to end in (the scores' maximum, a
// scalar exp, the accumulators' rescale) is paid once per kDecodeChunk positions.
constexpr int64_t kDecodeChunk = 128;
inline int64_t decode_chunk(int64_t B) { return B >= kDecodeChunk ? B : kDecodeChunk / B * B; }
// a head's score row in scratch: the chunk, padded, and one vector of slack (a block's
// last 16-position store runs past its positions)
inline int64_t decode_chunk_stride(int64_t B) { return decode_padded(decode_chunk(B)) + kDecodePad; }

// Floats of scratch one thread needs for `DecodeFn` (q, accumulators, running max/sum and
// rescale per head, the running sum by lane, scores, one block of K and V in f32, and q
// as the AVX2 build's tiles lay it out), enough for every build.
inline int64_t decode_scratch_floats(const DecodeProblem& p) {
  const int64_t G = p.H / p.KVH, Dp = decode_padded(p.D), Bp = decode_padded(p.B);
  // a score row per head (decode_chunk_stride >= Bp: the generic build's rows fit too)
  return 2 * G * Dp + 3 * G + G * kDecodePad + G * decode_chunk_stride(p.B) + 2 * Bp * Dp +
         4 * G * Dp;
}

// Runs work items [begin, end) with `scratch` (decode_scratch_floats of them).
using DecodeFn = void (*)(const DecodeProblem&, int64_t begin, int64_t end, float* scratch);

// The per-ISA builds; the avx2/avx512 ones exist on x86 only.
void decode_tasks_generic(const DecodeProblem& p, int64_t begin, int64_t end, float* scratch);
void decode_tasks_avx2(const DecodeProblem& p, int64_t begin, int64_t end, float* scratch);
void decode_tasks_avx512(const DecodeProblem& p, int64_t begin, int64_t end, float* scratch);

// The decode build the ops run for ISA `isa_name` (an IsaKernels name): its `decode`
// (`fallback`), except "avx512_bf16", whose bf16-cache build is
// paged_decode_avx512_bf16.cpp's.
DecodeFn decode_fn_for(const char* isa_name, DecodeFn fallback);

}  // namespace kvrelay
