// The FMA dense kernel, written once against a small vector abstraction and compiled once
// per ISA. Include inside an anonymous namespace after defining `struct V` (and including
// the build's simd_*.h: bf16_to_f32, f32_to_bf16):
//
//   V::W  float lanes     V::MR  x rows per pass (accumulators: NR·MR ≤ what the ISA holds)
//   zero() load(const float*) load_bf16(const uint16_t*) fma(a, b, c) = a·b + c
//   add(a, b)   hsum(a) = Σ lanes   sum4(a, b, c, d, out): out[0..3] = Σa, Σb, Σc, Σd
//   (one reduction tree for all four: a third of the instructions of four hsums)
//
// One x row (decode at concurrency 1) streams the weights row by row (dense_stream). More
// rows take passes that keep NR weight rows × MR x rows of accumulators in registers: each
// weight vector loaded is used MR times, each x vector NR times.
//
// The ordered product (dense.h, `dense_ordered`) also needs: fused(a, b, c) = a·b + c
// rounded once (a true FMA in every build), set1(float) (broadcast), store(float*, T) and
// round_bf16(a) (every lane as bf16_to_f32(f32_to_bf16(lane))).
#pragma once

#include "dense_argmax.h"   // the first-maximum argmax fold

using VT = V::T;

struct DenseF32W {
  static VT load(const void* w, int64_t i) { return V::load(static_cast<const float*>(w) + i); }
  static float scalar(const void* w, int64_t i) { return static_cast<const float*>(w)[i]; }
};

struct DenseBF16W {
  static VT load(const void* w, int64_t i) {
    return V::load_bf16(static_cast<const uint16_t*>(w) + i);
  }
  static float scalar(const void* w, int64_t i) {
    return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
  }
};

inline void dense_store(const kvrelay::DenseProblem& p, int64_t m, int64_t n, float v) {
  if (p.bias) v += p.bias[n];
  if (p.y_format == kvrelay::kDenseF32) static_cast<float*>(p.y)[m * p.N + n] = v;
  else static_cast<uint16_t*>(p.y)[m * p.N + n] = f32_to_bf16(v);
}

// Bytes ahead in the (contiguous, DRAM-streamed) weights that each step prefetches, one
// cache line per row: keeps loads in flight while a block computes (measured with the
// AVX512-BF16 kernel: 1.3-1.5x at 2-16 rows, neutral at 1; 16 and 48 KiB alike).
constexpr int64_t kDensePrefetch = 16384;

// y[m0 : m0 + MR, n : n + NR]
template <int NR, int MR, class WL>
inline void dense_tile(const kvrelay::DenseProblem& p, int64_t n, int64_t m0, bool prefetch) {
  const int64_t K = p.K;
  const float* x = p.x + m0 * K;
  VT acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = V::zero();
  int64_t k = 0;
  const int64_t wsize = p.w_format == kvrelay::kDenseF32 ? 4 : 2;
  const char* wbytes = static_cast<const char*>(p.w) + n * K * wsize;
  for (; k + V::W <= K; k += V::W) {
    if (prefetch && (k * wsize) % 64 < V::W * wsize)  // once per cache line of each row
      for (int r = 0; r < NR; ++r)
        __builtin_prefetch(wbytes + (r * K + k) * wsize + kDensePrefetch);
    VT xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = V::load(x + m * K + k);
    for (int r = 0; r < NR; ++r) {
      const VT w = WL::load(p.w, (n + r) * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = V::fma(w, xv[m], acc[r][m]);
    }
  }
  float out[NR][MR];
  if constexpr (NR % 4 == 0) {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; r += 4) {
        float sums[4];
        V::sum4(acc[r][m], acc[r + 1][m], acc[r + 2][m], acc[r + 3][m], sums);
        for (int j = 0; j < 4; ++j) out[r + j][m] = sums[j];
      }
  } else {
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) out[r][m] = V::hsum(acc[r][m]);
  }
  for (; k < K; ++k)  // tail when K is not a multiple of W
    for (int r = 0; r < NR; ++r) {
      const float w = WL::scalar(p.w, (n + r) * K + k);
      for (int m = 0; m < MR; ++m) out[r][m] += w * x[m * K + k];
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) dense_store(p, m0 + m, n + r, out[r][m]);
}

// The first pass over a block of rows prefetches (while inside this thread's range).
template <int NR, class WL>
inline void dense_rows(const kvrelay::DenseProblem& p, int64_t n, int64_t n1) {
  const int64_t wsize = p.w_format == kvrelay::kDenseF32 ? 4 : 2;
  const bool prefetch = (n + NR) * p.K * wsize + kDensePrefetch <= n1 * p.K * wsize;
  int64_t m0 = 0;
  for (; m0 + V::MR <= p.M; m0 += V::MR) dense_tile<NR, V::MR, WL>(p, n, m0, prefetch && !m0);
  for (; m0 + 2 <= p.M; m0 += 2) dense_tile<NR, 2, WL>(p, n, m0, prefetch && !m0);
  if (m0 < p.M) dense_tile<NR, 1, WL>(p, n, m0, prefetch && !m0);
}

// One input row (memory-bound): one weight row after the other, a single sequential
// stream (see dense_avx512_bf16.cpp: 1.2-1.4x eight rows side by side), four independent
// accumulators along k, prefetches kDenseStreamAhead bytes ahead inside [n0, n1).
constexpr int64_t kDenseStreamAhead = 4096;

template <class WL>
inline void dense_stream(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  constexpr int64_t U = 4, step = U * V::W;
  const int64_t K = p.K, wsize = p.w_format == kvrelay::kDenseF32 ? 4 : 2;
  const char* w_end = static_cast<const char*>(p.w) + n1 * K * wsize;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = n * K;
    VT acc[U];
    for (int64_t u = 0; u < U; ++u) acc[u] = V::zero();
    int64_t k = 0;
    for (; k + step <= K; k += step) {
      const char* ahead = static_cast<const char*>(p.w) + (row + k) * wsize + kDenseStreamAhead;
      if ((k * wsize) % 64 < step * wsize && ahead + step * wsize <= w_end)
        for (int64_t b = 0; b < step * wsize; b += 64) __builtin_prefetch(ahead + b);
      for (int64_t u = 0; u < U; ++u)
        acc[u] = V::fma(WL::load(p.w, row + k + u * V::W), V::load(p.x + k + u * V::W), acc[u]);
    }
    for (; k + V::W <= K; k += V::W)
      acc[0] = V::fma(WL::load(p.w, row + k), V::load(p.x + k), acc[0]);
    float out = V::hsum(V::add(V::add(acc[0], acc[1]), V::add(acc[2], acc[3])));
    for (; k < K; ++k) out += WL::scalar(p.w, row + k) * p.x[k];
    dense_store(p, 0, n, out);
  }
}

template <class WL>
inline void dense_range(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M == 1) return dense_stream<WL>(p, n0, n1);
  for (; n + 4 <= n1; n += 4) dense_rows<4, WL>(p, n, n1);
  for (; n < n1; ++n) dense_rows<1, WL>(p, n, n1);
}

void dense_fma(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  if (p.w_format == kvrelay::kDenseF32) dense_range<DenseF32W>(p, n0, n1);
  else dense_range<DenseBF16W>(p, n0, n1);
}

// -- the ordered product (dense.h) ------------------------------------------------------------
// A pass over a block takes all its 16 output lanes (kOrderedGroups vectors of W) for a few rows
// of x: one accumulator per (lane vector, row) stays in registers beside the block's weight
// vectors of the step and one broadcast x value, which every lane vector of its row reuses.
// Eight chains in flight cover the FMA latency at two a cycle (AVX2: 4 rows of 2 vectors. The
// LM head's shape, 201k x 32, on one Zen 3 core against 8 rows of one vector, each vector's
// pass broadcasting x again: 1.3-1.4x at 1-16 rows writing the outputs, 1.05-1.15x at 8-16
// rows folding their argmax, 1.3x at 1-4; the same bits). With k blocks
// (`ordered_tile_blocked`) a running sum sits beside each chain, so fewer rows. Every output
// is the chain fused(x[m, k], w[n, k], acc) for k = 0 .. K-1 from 0 (per k block), whatever
// the tile.
constexpr int kOrderedGroups = int(kvrelay::kOrderedLanes) / V::W;
constexpr int kOrderedRows = kOrderedGroups >= 8 ? 1 : 8 / kOrderedGroups;   // AVX2 4, AVX-512 8
constexpr int kBlockedRows = kOrderedGroups == 1 ? 4 : kOrderedGroups == 2 ? 3 : 1;

// Rows [m0, m0 + MR) of lanes [lane0, lane0 + W) of block b, stored at dst (row stride ld,
// dst at the block's lane 0): lanes at or past N are skipped, or set to -inf where `pad` (a
// scratch block, whose padding must never win an argmax).
template <int MR>
inline void ordered_store(const kvrelay::OrderedProblem& p, int64_t b, int64_t lane0,
                          int64_t m0, VT* acc, float* dst, int64_t ld, bool pad) {
  if (p.round_bf16)
    for (int m = 0; m < MR; ++m) acc[m] = V::round_bf16(acc[m]);
  const int64_t valid = p.N - (b * kvrelay::kOrderedLanes + lane0);
  if (valid >= V::W) {
    for (int m = 0; m < MR; ++m) V::store(dst + (m0 + m) * ld + lane0, acc[m]);
    return;
  }
  float out[V::W];                          // the last block: only its rows below N
  for (int m = 0; m < MR; ++m) {
    V::store(out, acc[m]);
    float* row = dst + (m0 + m) * ld + lane0;
    for (int64_t i = 0; i < V::W; ++i) {
      if (i < valid) row[i] = out[i];
      else if (pad) row[i] = -__builtin_inff();
    }
  }
}

// Rows [m0, m0 + MR) of block b into dst (row stride ld, dst at the block's lane 0), without k
// blocks: y = chain (+ the bias after it, as b + chain_0 of one k block).
template <int MR, class WL>
inline void ordered_tile(const kvrelay::OrderedProblem& p, int64_t b, int64_t m0, float* dst,
                         int64_t ld, bool pad) {
  constexpr int G = kOrderedGroups;
  constexpr int64_t L = kvrelay::kOrderedLanes;
  const int64_t K = p.K;
  const float* x = p.x + m0 * K;
  const int64_t base = b * K * L;
  VT acc[G][MR];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MR; ++m) acc[g][m] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    VT w[G];
    for (int g = 0; g < G; ++g) w[g] = WL::load(p.w, base + k * L + g * V::W);
    for (int m = 0; m < MR; ++m) {
      const VT xb = V::set1(x[m * K + k]);
      for (int g = 0; g < G; ++g) acc[g][m] = V::fused(xb, w[g], acc[g][m]);
    }
  }
  for (int g = 0; g < G; ++g) {
    if (p.bias) {
      const VT bias = V::load(p.bias + b * L + g * V::W);
      for (int m = 0; m < MR; ++m) acc[g][m] = V::add(bias, acc[g][m]);
    }
    ordered_store<MR>(p, b, g * V::W, m0, acc[g], dst, ld, pad);
  }
}

// The same with k blocks (dense.h): the running sum (from the bias, where there is one) beside
// each block's chain.
template <int MR, class WL>
inline void ordered_tile_blocked(const kvrelay::OrderedProblem& p, int64_t b, int64_t m0,
                                 float* dst, int64_t ld, bool pad) {
  constexpr int G = kOrderedGroups;
  constexpr int64_t L = kvrelay::kOrderedLanes;
  const int64_t K = p.K;
  const float* x = p.x + m0 * K;
  const int64_t base = b * K * L;
  VT sum[G][MR];
  const bool bias = p.bias != nullptr;
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MR; ++m) sum[g][m] = bias ? V::load(p.bias + b * L + g * V::W) : V::zero();
  for (int64_t k0 = 0; k0 < K; k0 += p.kc) {
    const int64_t k1 = k0 + p.kc < K ? k0 + p.kc : K;
    VT acc[G][MR];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MR; ++m) acc[g][m] = V::zero();
    for (int64_t k = k0; k < k1; ++k) {
      VT w[G];
      for (int g = 0; g < G; ++g) w[g] = WL::load(p.w, base + k * L + g * V::W);
      for (int m = 0; m < MR; ++m) {
        const VT xb = V::set1(x[m * K + k]);
        for (int g = 0; g < G; ++g) acc[g][m] = V::fused(xb, w[g], acc[g][m]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MR; ++m)
        sum[g][m] = (k0 == 0 && !bias) ? acc[g][m] : V::add(sum[g][m], acc[g][m]);
  }
  for (int g = 0; g < G; ++g) ordered_store<MR>(p, b, g * V::W, m0, sum[g], dst, ld, pad);
}

// Every row of block b into dst (row stride ld), a few rows per pass: the block's weights stay
// in L1 between the passes.
template <class WL>
inline void ordered_block(const kvrelay::OrderedProblem& p, int64_t b, float* dst, int64_t ld,
                          bool pad) {
  int64_t m = 0;
  if (p.kc < p.K) {
    for (; m + kBlockedRows <= p.M; m += kBlockedRows)
      ordered_tile_blocked<kBlockedRows, WL>(p, b, m, dst, ld, pad);
    if (kBlockedRows > 2 && p.M - m >= 2)
      ordered_tile_blocked<2, WL>(p, b, m, dst, ld, pad), m += 2;
    if (kBlockedRows > 1 && p.M - m >= 1) ordered_tile_blocked<1, WL>(p, b, m, dst, ld, pad);
    return;
  }
  for (; m + kOrderedRows <= p.M; m += kOrderedRows)
    ordered_tile<kOrderedRows, WL>(p, b, m, dst, ld, pad);
  if (kOrderedRows > 4 && p.M - m >= 4) ordered_tile<4, WL>(p, b, m, dst, ld, pad), m += 4;
  if (kOrderedRows > 2 && p.M - m >= 2) ordered_tile<2, WL>(p, b, m, dst, ld, pad), m += 2;
  if (kOrderedRows > 1 && p.M - m >= 1) ordered_tile<1, WL>(p, b, m, dst, ld, pad);
}

template <class WL>
inline void ordered_range(const kvrelay::OrderedProblem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    ordered_block<WL>(p, b, p.y + b * kvrelay::kOrderedLanes, p.N, false);
}

void dense_ordered(const kvrelay::OrderedProblem& p, int64_t b0, int64_t b1) {
  if (p.w_format == kvrelay::kDenseF32) ordered_range<DenseF32W>(p, b0, b1);
  else ordered_range<DenseBF16W>(p, b0, b1);
}

// The greedy form: each block's outputs into the scratch, then folded into the row's lanes
// as argmax_rows folds a row (dense_argmax.h: one lane per output of the block), NaNs noted
// by their first index.
template <class WL>
inline void ordered_argmax_range(const kvrelay::OrderedProblem& p, int64_t b0, int64_t b1,
                                 const kvrelay::OrderedArgmax& a) {
  constexpr int64_t L = kvrelay::kOrderedLanes;
  for (int64_t m = 0; m < p.M; ++m) argmax_lanes_reset<L>(a.best + m * L, a.at + m * L);
  for (int64_t m = 0; m < p.M; ++m) a.nan[m] = -1;
  for (int64_t b = b0; b < b1; ++b) {
    ordered_block<WL>(p, b, a.scratch, L, true);
    for (int64_t m = 0; m < p.M; ++m) {
      const ArgmaxF32 v{a.scratch + m * L};
      const bool nan = argmax_lanes_step<L>(a.best + m * L, a.at + m * L,
                                            static_cast<int32_t>(b), v);
      if (nan && a.nan[m] < 0) a.nan[m] = b * L + argmax_first_nan(L, v);
    }
  }
  for (int64_t m = 0; m < p.M; ++m) {
    a.value[m] = -__builtin_inff();
    a.index[m] = -1;
    argmax_lanes_best<L>(a.best + m * L, a.at + m * L, a.value + m, a.index + m);
  }
}

void dense_ordered_argmax(const kvrelay::OrderedProblem& p, int64_t b0, int64_t b1,
                          const kvrelay::OrderedArgmax& a) {
  if (p.w_format == kvrelay::kDenseF32) ordered_argmax_range<DenseF32W>(p, b0, b1, a);
  else ordered_argmax_range<DenseBF16W>(p, b0, b1, a);
}
