// The paged decode attention kernel with explicit SIMD (contract: paged_decode.h), written
// once over a vector type P and included inside an anonymous namespace by each x86 ISA
// file (paged_decode_avx2.cpp: P::W = 8 floats, paged_decode_avx512.cpp: 16), after its
// `#pragma GCC target` and its P. P provides: T, W, zero, load, store, set1, add, sub,
// mul, fma, max, hsum, hmax, exp_neg (e^x for x <= 0), first(x, n, fill) (lanes >= n set
// to fill), transpose_sum(a) (lane j = the sum of a[j]'s lanes) and load_{f32,bf16,f16}
// (p, n) (n <= W elements, zeros beyond).
//
// Per work item (sequence, KV head), chunk by chunk (whole blocks, up to kDecodeChunk
// positions: paged_decode.h) over the visible positions [max(0, len - window), len)
// through the block table:
//  1. each block's K rows are converted to f32 in scratch (rows padded to whole vectors
//     with zeros), once for the G query heads of the KV head;
//  2. scores: for each head, W positions at a time, one vector of partial products per
//     position (q in registers, each K row read from L1), then a transposing reduction
//     puts the W dot products in one vector; every head's scores of the chunk are kept;
//  3. online softmax per head on whole vectors, once per chunk: chunk max, vector exp,
//     running sum;
//  4. P·V: per vector of the head dim, the accumulators of up to kHeadTile heads stay in
//     registers while each V row of the chunk is loaded from the cache, converted in
//     registers, once and meets every head's probability.
// The softmax's serial tail (maximum, scalar exp, the accumulators' rescale) is paid per
// chunk, not per block (session 12: see paged_decode_avx512_bf16.cpp).
// The learned sink joins the denominator at the end (as in paged_decode_generic.cpp).
// A build may pass its own steps 1, 2 and 4 as `Tiles` (the AVX2 build's for a bf16 cache:
// paged_decode_avx2_tiles.h); the AVX-512 build passes none.
#pragma once

constexpr int kHeadTile = P::W == 16 ? 8 : 4;   // accumulators in registers in P·V

#include "simd_generic.h"   // exp_neg: the scalar e^x (rescales, the sink)

// rows [0, n) of `src` (row stride D) → dst (row stride Dp, zeros after D); `load(ptr,
// k)` reads k <= W elements as f32
template <class E, class Load>
inline void rows_to_f32(const E* src, int64_t n, int64_t D, int64_t Dp, float* dst,
                        const Load& load) {
  if (D == Dp) {   // whole vectors per row: the block's rows are one contiguous run
    for (int64_t i = 0; i < n * D; i += P::W) P::store(dst + i, load(src + i, P::W));
    return;
  }
  const int64_t full = D / P::W * P::W;
  for (int64_t r = 0; r < n; ++r) {
    const E* in = src + r * D;
    float* out = dst + r * Dp;
    for (int64_t d = 0; d < full; d += P::W) P::store(out + d, load(in + d, P::W));
    if (full < D) P::store(out + full, load(in + full, int(D - full)));
    for (int64_t d = (D + P::W - 1) / P::W * P::W; d < Dp; d += P::W) P::store(out + d, P::zero());
  }
}

inline void rows_to_f32(const kvrelay::DecodeProblem& p, int64_t at, int64_t n, int64_t Dp,
                        float* dst) {
  if (p.format == kvrelay::kKvBF16) {
    rows_to_f32(static_cast<const uint16_t*>(p.kv) + at, n, p.D, Dp, dst,
                [](const uint16_t* x, int k) { return P::load_bf16(x, k); });
  } else if (p.format == kvrelay::kKvF16) {
    rows_to_f32(static_cast<const uint16_t*>(p.kv) + at, n, p.D, Dp, dst,
                [](const uint16_t* x, int k) { return P::load_f16(x, k); });
  } else {
    rows_to_f32(static_cast<const float*>(p.kv) + at, n, p.D, Dp, dst,
                [](const float* x, int k) { return P::load_f32(x, k); });
  }
}

// Scores of one head for positions [j0, j0 + nj) (nj <= W) of the block in scratch:
// lanes >= nj are -inf. DC: vectors per head dim (0: `dc` at run time).
template <int DC>
__attribute__((always_inline)) inline typename P::T head_scores(const float* q,
                                                                const float* kf, int64_t Dp,
                                                                int64_t nj, int dc) {
  const int n_c = DC > 0 ? DC : dc;
  typename P::T a[P::W];
  for (int j = 0; j < P::W; ++j) a[j] = P::zero();
  if (DC > 0) {
    typename P::T qv[DC > 0 ? DC : 1];
    for (int c = 0; c < DC; ++c) qv[c] = P::load(q + c * P::W);
    if (nj == P::W) {   // a whole group: fixed trip counts, a[] stays in registers
      for (int j = 0; j < P::W; ++j) {
        const float* k = kf + j * Dp;
        typename P::T s = P::mul(qv[0], P::load(k));
        for (int c = 1; c < DC; ++c) s = P::fma(qv[c], P::load(k + c * P::W), s);
        a[j] = s;
      }
      return P::transpose_sum(a);
    }
    for (int64_t j = 0; j < nj; ++j) {
      const float* k = kf + j * Dp;
      typename P::T s = P::mul(qv[0], P::load(k));
      for (int c = 1; c < DC; ++c) s = P::fma(qv[c], P::load(k + c * P::W), s);
      a[j] = s;
    }
  } else {
    for (int64_t j = 0; j < nj; ++j) {
      const float* k = kf + j * Dp;
      typename P::T s = P::mul(P::load(q), P::load(k));
      for (int c = 1; c < n_c; ++c) s = P::fma(P::load(q + c * P::W), P::load(k + c * P::W), s);
      a[j] = s;
    }
  }
  return P::first(P::transpose_sum(a), int(nj), -__builtin_inff());
}

// The V rows of a softmax chunk (whole blocks, paged_decode.h kDecodeChunk): block b has
// ns[b] rows at element offset at[b] of the cache; its probabilities follow the earlier
// blocks' in a head's score row (stride Cs).
struct ChunkRows {
  const int64_t* at;
  const int64_t* ns;
  int64_t nblk, Cs;
};

// acc[g] = acc[g] · cs[g] + Σ_j prob[g][j] · V[j] for NG heads from g0, j over the chunk's
// rows: V rows read from the cache (row stride D) and converted in registers, each vector
// of a row once for the NG heads.
template <int NG, class E, class Load>
inline void weighted_values(const E* kv, const Load& load, int64_t D, const ChunkRows& rows,
                            const float* prob, const float* cs, float* acc, int64_t g0,
                            int64_t Dp) {
  for (int64_t d = 0; d < D; d += P::W) {
    const int k = D - d < P::W ? int(D - d) : P::W;
    typename P::T a[NG];
    for (int i = 0; i < NG; ++i)
      a[i] = P::mul(P::load(acc + (g0 + i) * Dp + d), P::set1(cs[g0 + i]));
    const float* pr = prob;
    for (int64_t b = 0; b < rows.nblk; ++b) {
      const E* v = kv + rows.at[b];
      const int64_t n = rows.ns[b];
      if (k == P::W) {
        for (int64_t j = 0; j < n; ++j) {
          const typename P::T x = load(v + j * D + d, P::W);
          for (int i = 0; i < NG; ++i)
            a[i] = P::fma(P::set1(pr[(g0 + i) * rows.Cs + j]), x, a[i]);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const typename P::T x = load(v + j * D + d, k);
          for (int i = 0; i < NG; ++i)
            a[i] = P::fma(P::set1(pr[(g0 + i) * rows.Cs + j]), x, a[i]);
        }
      }
      pr += n;
    }
    for (int i = 0; i < NG; ++i) P::store(acc + (g0 + i) * Dp + d, a[i]);
  }
}

// P·V for heads [g0, g0 + ng), ng <= NG, with the accumulators of NG heads in registers
template <int NG, class E, class Load>
inline void tile_values(const E* kv, const Load& load, int64_t D, const ChunkRows& rows,
                        const float* prob, const float* cs, float* acc, int64_t g0, int64_t ng,
                        int64_t Dp) {
  if constexpr (NG > 1) {
    if (ng < NG) return tile_values<NG - 1>(kv, load, D, rows, prob, cs, acc, g0, ng, Dp);
  }
  weighted_values<NG>(kv, load, D, rows, prob, cs, acc, g0, Dp);
}

// P·V for every head of the work item, kHeadTile heads at a time
template <class E, class Load>
inline void all_values(const E* kv, const Load& load, int64_t D, const ChunkRows& rows,
                       const float* prob, const float* cs, float* acc, int64_t G, int64_t Dp) {
  for (int64_t g0 = 0; g0 < G; g0 += kHeadTile)
    tile_values<kHeadTile>(kv, load, D, rows, prob, cs, acc, g0, G - g0, Dp);
}

inline void all_values(const kvrelay::DecodeProblem& p, const ChunkRows& rows,
                       const float* prob, const float* cs, float* acc, int64_t G, int64_t Dp) {
  if (p.format == kvrelay::kKvBF16) {
    all_values(static_cast<const uint16_t*>(p.kv),
               [](const uint16_t* x, int k) { return P::load_bf16(x, k); }, p.D, rows, prob,
               cs, acc, G, Dp);
  } else if (p.format == kvrelay::kKvF16) {
    all_values(static_cast<const uint16_t*>(p.kv),
               [](const uint16_t* x, int k) { return P::load_f16(x, k); }, p.D, rows, prob,
               cs, acc, G, Dp);
  } else {
    all_values(static_cast<const float*>(p.kv),
               [](const float* x, int k) { return P::load_f32(x, k); }, p.D, rows, prob, cs,
               acc, G, Dp);
  }
}

// The default `Tiles` of simd_decode_tasks: none (every problem on the steps above). A
// build's own (paged_decode_avx2_tiles.h) provides kEnabled = true, applies(p), and
// prepare_q / scores / values to run in place of the q copy, the block's scores and P·V.
struct Untiled {
  static constexpr bool kEnabled = false;
};

template <int DC, class Tiles>
void simd_decode_tasks(const kvrelay::DecodeProblem& p, int64_t begin, int64_t end,
                       float* scratch) {
  using T = typename P::T;
  const int64_t G = p.H / p.KVH, D = p.D, B = p.B;
  const int64_t Dp = kvrelay::decode_padded(D);
  const int64_t C = kvrelay::decode_chunk(B), Cs = kvrelay::decode_chunk_stride(B);
  const int dc = int(Dp / P::W);
  const int64_t v_off = p.NB * p.KVH * B * D;          // K plane, then V plane
  float* qf = scratch;                                 // [G, Dp] scaled, zero-padded
  float* acc = qf + G * Dp;                            // [G, Dp]
  float* m = acc + G * Dp;                             // [G] running max
  float* l = m + G;                                    // [G] running sum
  float* cs = l + G;                                   // [G] this chunk's rescale
  float* lv = cs + G;                                  // [G, kDecodePad] sums by lane
  float* sc = lv + G * kvrelay::kDecodePad;            // [G, Cs] scores, then probabilities
  float* kf = sc + G * Cs;                             // [Bp, Dp] a block's keys
  float* qt = kf + 2 * kvrelay::decode_padded(B) * Dp;  // [G, 4 Dp] the tiles' q
  bool tiled = false;
  if constexpr (Tiles::kEnabled) tiled = Tiles::applies(p);
  int64_t vat[kvrelay::kDecodeChunk + 1], ns[kvrelay::kDecodeChunk + 1];   // the chunk's blocks
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / p.KVH, kh = task % p.KVH;
    const int64_t len = p.lens[seq];
    const int64_t first = kvrelay::first_position(p, task);
    if (task == begin) kvrelay::prefetch_block(p, task, first);
    if (task + 1 < end)
      kvrelay::prefetch_block(p, task + 1, kvrelay::first_position(p, task + 1));
    const float* qs = p.q + (seq * p.H + kh * G) * D;
    if constexpr (Tiles::kEnabled) {
      if (tiled) Tiles::prepare_q(qs, p.scale, G, D, qt);
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < Dp; ++d) {
        qf[g * Dp + d] = d < D ? qs[g * D + d] * p.scale : 0.f;
        acc[g * Dp + d] = 0.f;
      }
      m[g] = -__builtin_inff();
      P::store(lv + g * kvrelay::kDecodePad, P::zero());
    }
    for (int64_t p0 = first; p0 < len;) {
      // 1. the chunk: whole blocks of up to C positions; every head's scores of them
      int64_t nblk = 0, o = 0;
      // the tiles ask for a chunk's rows while the chunk before computes P·V: all but the
      // range's first chunk are on their way
      const bool asked = tiled && !(task == begin && p0 == first);
      while (p0 < len) {
        const auto [n, k_at] = kvrelay::chunk_block(p, task, p0, o, C);
        if (n == 0) break;
        if (!asked) kvrelay::prefetch_block(p, task, p0 + n);
        if (tiled) {
          if constexpr (Tiles::kEnabled) Tiles::scores(p, k_at, n, qt, kf, sc + o, G, Cs);
        } else {
          rows_to_f32(p, k_at, n, Dp, kf);
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j0 = 0; j0 < n; j0 += P::W) {
              const int64_t nj = n - j0 < P::W ? n - j0 : P::W;
              P::store(sc + g * Cs + o + j0,
                       head_scores<DC>(qf + g * Dp, kf + j0 * Dp, Dp, nj, dc));
            }
        }
        vat[nblk] = k_at + v_off;
        ns[nblk++] = n;
        o += n;
        p0 += n;
      }
      // 2. online softmax per head on whole vectors: chunk max, vector exp, running sum
      for (int64_t g = 0; g < G; ++g) {
        float* sg = sc + g * Cs;
        T mx = P::set1(-__builtin_inff());
        for (int64_t j0 = 0; j0 < o; j0 += P::W)
          mx = P::max(mx, P::first(P::load(sg + j0), int(o - j0), -__builtin_inff()));
        const float bm = P::hmax(mx);
        const float mnew = m[g] > bm ? m[g] : bm;
        const float c = __builtin_isinf(m[g]) ? 0.f : exp_neg(m[g] - mnew);  // first: 0
        const T mv = P::set1(mnew);
        // the running sum stays a vector (one horizontal sum per work item, at the end)
        T sum = P::mul(P::load(lv + g * kvrelay::kDecodePad), P::set1(c));
        for (int64_t j0 = 0; j0 < o; j0 += P::W) {
          const T e = P::first(P::exp_neg(P::sub(P::load(sg + j0), mv)), int(o - j0), 0.f);
          P::store(sg + j0, e);
          sum = P::add(sum, e);
        }
        P::store(lv + g * kvrelay::kDecodePad, sum);
        cs[g] = c;
        m[g] = mnew;
      }
      // 3. P·V over the chunk's V rows
      if (tiled) {
        if constexpr (Tiles::kEnabled)
          Tiles::values(p, task, p0, end, ChunkRows{vat, ns, nblk, Cs}, sc, cs, acc, G, Dp);
      } else {
        all_values(p, ChunkRows{vat, ns, nblk, Cs}, sc, cs, acc, G, Dp);
      }
    }
    float* os = p.out + (seq * p.H + kh * G) * D;
    for (int64_t g = 0; g < G; ++g) l[g] = P::hsum(P::load(lv + g * kvrelay::kDecodePad));
    for (int64_t g = 0; g < G; ++g) {
      const float sink = p.sinks[kh * G + g];
      const float mx = m[g] > sink ? m[g] : sink;
      const float c = exp_neg(m[g] - mx);
      const float f = c / (l[g] * c + exp_neg(sink - mx));
      for (int64_t d = 0; d < D; ++d) os[g * D + d] = acc[g * Dp + d] * f;
    }
  }
}

// The build for this problem: head dims of up to kMaxDC vectors with their count fixed at
// compile time (q in registers), longer ones with a run-time count.
template <int DC, int kMaxDC, class Tiles = Untiled>
kvrelay::DecodeFn pick_decode(int64_t dc) {
  if constexpr (DC <= kMaxDC) {
    if (dc == DC) return &simd_decode_tasks<DC, Tiles>;
    return pick_decode<DC + 1, kMaxDC, Tiles>(dc);
  } else {
    return &simd_decode_tasks<0, Tiles>;
  }
}
