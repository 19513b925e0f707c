// Software prefetch of a paged decode work item's next KV block, shared by the SIMD builds
// (paged_decode_simd.h, paged_decode_avx512_bf16.cpp). A block's K rows and V rows are two
// short runs (B·D elements each, 1 KB at head dim 32 in bf16) at places the block table
// picks, so the hardware prefetcher cannot guess the next ones; asked for one block ahead,
// they arrive while the current block computes (docs/benchmarks.md, "Session 10": offline
// generate +19-31 % in-process A/B against no prefetch; the first line of each run only:
// +9 %; two blocks ahead: as one).
#pragma once
#include "paged_decode.h"

namespace kvrelay {

// One cache line into all levels. Inline asm on x86: GCC 12 cuts a loop whose body is only
// __builtin_prefetch calls down to its first iteration, or to nothing (so until session 10
// the fp32 build's prefetch_block asked for one line of each run at most).
__attribute__((always_inline)) inline void prefetch_line(const char* at) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*at));
#else
  __builtin_prefetch(at);
#endif
}

// Asks for the K and V rows of positions [p0, min(p0 + B - p0 % B, len)) of work item
// `task` (its next block): the blocks of a sequence lie anywhere in the cache, so the
// hardware prefetcher cannot guess them, and without this the kernel waits on memory.
__attribute__((always_inline)) inline void prefetch_block(const DecodeProblem& p, int64_t task,
                                                         int64_t p0) {
  const int64_t seq = task / p.KVH, kh = task % p.KVH, B = p.B;
  const int64_t len = p.lens[seq];
  if (p0 >= len) return;
  const int64_t n = B - p0 % B < len - p0 ? B - p0 % B : len - p0;
  const int64_t blk = p.table[seq * p.maxb + p0 / B];
  const int64_t esize = p.format == kKvF32 ? 4 : 2;
  const char* k = static_cast<const char*>(p.kv) +
                  ((blk * p.KVH + kh) * B + p0 % B) * p.D * esize;
  const char* v = k + p.NB * p.KVH * B * p.D * esize;
  for (int64_t off = 0; off < n * p.D * esize; off += 64) {
    prefetch_line(k + off);
    prefetch_line(v + off);
  }
}

// The block of work item `task` that holds position p0 < len, as far as a softmax chunk
// (kDecodeChunk) already holding `held` positions of at most `C` can take it: its
// positions from p0 (n; 0 where the chunk is full) and the element offset of its first
// K row in the cache.
struct ChunkBlock {
  int64_t n, k_at;
};
inline ChunkBlock chunk_block(const DecodeProblem& p, int64_t task, int64_t p0, int64_t held,
                              int64_t C) {
  const int64_t seq = task / p.KVH, kh = task % p.KVH, B = p.B;
  const int64_t len = p.lens[seq], off0 = p0 % B;
  const int64_t n = B - off0 < len - p0 ? B - off0 : len - p0;
  if (held > 0 && held + n > C) return {0, 0};
  const int64_t blk = p.table[seq * p.maxb + p0 / B];
  return {n, ((blk * p.KVH + kh) * B + off0) * p.D};
}

// the first visible position of work item `task`
inline int64_t first_position(const DecodeProblem& p, int64_t task) {
  const int64_t len = p.lens[task / p.KVH];
  return p.window > 0 && len > p.window ? len - p.window : 0;
}

}  // namespace kvrelay
