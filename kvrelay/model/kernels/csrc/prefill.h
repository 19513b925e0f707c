// Plain-C++ contract between the torch-facing prefill attention op (prefill_op.cpp) and its
// per-ISA builds (prefill_impl.h, compiled inside prefill_generic.cpp, prefill_avx2.cpp,
// prefill_avx512.cpp). No torch or STL here, as for moe.h.
#pragma once
#include <stdint.h>

namespace kvrelay {

// Causal attention of prompts from position 0 over their own keys and values (no cached
// prefix, so nothing is read from the paged cache):
//
//   q [T, H, D], k/v [T, KVH, D] (f32, bf16 or f16, all one `format`; a token's heads
//   contiguous, tokens `*_stride` elements apart), cu [S + 1] token offsets of the S prompts,
//   sinks [H] f32 → out [T, H, D] contiguous, in `format` (computed in f32)
//
// Query at position p of a prompt sees keys (p - window, p] (window 0: [0, p]); the learned
// sink joins each row's softmax denominator. Work item = (prompt, KV head, tile of
// kPrefillTile query positions), listed in `items` as prompt · 2^32 + kv_head · 2^16 + tile.
constexpr int64_t kPrefillTile = 32;

enum PrefillFormat : int32_t { kPrefillF32 = 0, kPrefillBF16 = 1, kPrefillF16 = 2 };

struct PrefillProblem {
  int32_t format;
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride, k_stride, v_stride;
  const int64_t* cu;
  const int64_t* items;
  const float* sinks;
  void* out;
  int64_t H, KVH, D;
  int64_t window;
  float scale;
  // K transposed and V in f32, converted once per call by the op (every query tile of a
  // prompt reads the same key blocks): kt [KVH][D][ld_kt] with token columns (zero from T
  // to ld_kt, `prefill_ld_kt`), vf [KVH][T][Dp] (one head's values contiguous; head dims
  // zero-padded to Dp, a multiple of 16)
  const float* kt;
  const float* vf;
  int64_t ld_kt;
  int64_t tokens;  // T
};

// Keys per block of the kernel's loop (64 floats of scores per query row).
constexpr int64_t kPrefillKeys = 64;

// The row stride of PrefillProblem::kt for T tokens: at least T + kPrefillKeys (a block
// starting at the last token reads zeros past it), an odd number of 64-byte lines, so a
// block's D rows fall in different cache sets (a multiple of 4 KB put them all in one set).
inline int64_t prefill_ld_kt(int64_t T) {
  return ((T + kPrefillKeys + 15) / 16 | 1) * 16;
}

// Floats of scratch one thread needs for `PrefillFn` (the tile's queries and accumulators
// with head dims padded to 16, its running max and sum, its scores).
inline int64_t prefill_scratch_floats(const PrefillProblem& p) {
  const int64_t R = p.H / p.KVH * kPrefillTile, Dp = (p.D + 15) / 16 * 16;
  return 2 * R * Dp + 2 * R + R * kPrefillKeys;
}

// Runs work items [begin, end) of `p.items` with `scratch`.
using PrefillFn = void (*)(const PrefillProblem&, int64_t begin, int64_t end, float* scratch);

// The ISA builds (false where this compiler cannot build one).
bool prefill_generic(PrefillFn* out);
bool prefill_avx2(PrefillFn* out);
bool prefill_avx512(PrefillFn* out);

}  // namespace kvrelay
