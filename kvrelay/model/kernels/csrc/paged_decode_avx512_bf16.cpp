// AVX512-BF16 build of the paged decode kernel (contract: paged_decode.h), the decode of
// the "avx512_bf16" ISA (decode_fn_for). It serves a bf16 KV cache with a head dim of 32,
// 64, 96 or 128; anything else goes to the "avx512" build (paged_decode_simd.h).
//
// Why: at the offline shapes (64 sequences, head dim 32, 2 query heads per KV head) the
// fp32 build is bound by instructions, not memory: each block's K rows were widened to
// fp32 in scratch, each score took D/16 FMAs per row, each V row two widening ops per 16
// values. Here, per work item (sequence, KV head), chunk by chunk (whole blocks, up to
// kDecodeChunk positions: paged_decode.h):
//  1. scores: each K row (32 bf16 per vector, read from the cache in place) meets each
//     query head's q, packed to bf16 once per work item, in `vdpbf16ps`: 32 products
//     per instruction, then the transposing reduction of paged_decode_avx512_p.h puts 16
//     positions' dot products in one vector, times the softmax scale; every head's
//     scores of the chunk's blocks are kept;
//  2. online softmax per head as in paged_decode_simd.h, once per chunk;
//  3. P·V: each 32-value vector of a V row is widened to fp32 by a shift (the even
//     elements) and a mask (the odd ones), once for up to kTile heads whose accumulators
//     stay in registers over the chunk's rows (split into partial sums by row where the
//     heads alone give too few independent FMA chains); the accumulators hold even and
//     odd elements apart until the end.
// A chunk rather than a block per softmax step (session 12): the serial tail each step
// ends in (the scores' maximum, a scalar exp, the accumulators' rescale and their trip
// through memory) is paid once per 128 positions instead of once per 16, and the scores
// of a chunk's blocks are independent work the core overlaps.
//
// Software prefetch as in the fp32 build: each work item's next block's K and V rows, and
// the next item's first block (paged_decode_prefetch.h). Session 7 asked for whole
// sequences ahead into L2 and saw no change; one block ahead is what pays (offline
// generate +19-31 %; docs/benchmarks.md "Session 10").
//
// Exactness: q and K are bf16 values (the ops check q's dtype is the cache's; the fused
// op rounds q to it), so each product is exact in fp32 and only the fp32 summation order
// of a score differs from the fp32 build, which also scales q before the dot product
// where this scales the sum (one rounding of the score either way). P·V is the fp32
// build's arithmetic but for where the running maximum is taken (per chunk, not per
// block) and, with partial sums, the order of the sum. `vdpbf16ps` treats denormal
// inputs and results as zero: a product or partial sum below 2^-126 in magnitude
// (|q·k| < 1.2e-38) counts as 0, a change to a logit far below its fp32 rounding.
#include "paged_decode.h"
#include "paged_decode_prefetch.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512_BF16)

namespace {

#include "paged_decode_avx512_p.h"   // and simd_avx512.h: the scalar exp_neg (rescales, the sink)

using T = __m512;

constexpr int64_t kRows = 16;   // positions scored per transposing reduction

// K row j of a block as DW vectors of 32 bf16 against one head's packed q: the 16 dot
// products of positions [0, nj) in one vector, times `scale`; lanes >= nj are -inf
template <int DW>
__attribute__((always_inline)) inline T head_scores(const uint16_t* q, const uint16_t* k,
                                                    int64_t nj, float scale) {
  __m512bh qb[DW];
  for (int c = 0; c < DW; ++c) qb[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  T a[kRows];
  if (nj == kRows) {   // fixed trip counts: a[] stays in registers
    for (int j = 0; j < kRows; ++j) {
      const uint16_t* row = k + j * DW * 32;
      T s = _mm512_dpbf16_ps(P::zero(), (__m512bh)_mm512_loadu_si512(row), qb[0]);
      for (int c = 1; c < DW; ++c)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(row + 32 * c), qb[c]);
      a[j] = s;
    }
    return P::mul(P::transpose_sum(a), P::set1(scale));
  }
  for (int j = 0; j < kRows; ++j) a[j] = P::zero();
  for (int64_t j = 0; j < nj; ++j) {
    const uint16_t* row = k + j * DW * 32;
    T s = _mm512_dpbf16_ps(P::zero(), (__m512bh)_mm512_loadu_si512(row), qb[0]);
    for (int c = 1; c < DW; ++c)
      s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(row + 32 * c), qb[c]);
    a[j] = s;
  }
  return P::first(P::mul(P::transpose_sum(a), P::set1(scale)), int(nj), -__builtin_inff());
}

// acc[g] = acc[g] · cs[g] + Σ_j prob[g][j] · V[j] for heads [g0, g0 + NG), j over the
// rows of a chunk's blocks (block b: ns[b] rows at vb[b], probabilities from offset
// Σ ns[<b]): V rows read from the cache once for the NG heads. acc row layout per 32
// elements: the 16 even ones, then the 16 odd ones (what the shift and the mask give).
// S partial sums per accumulator (rows j ≡ s mod S) when the heads' accumulators alone
// are too few independent FMA chains to hide the FMA latency.
template <int NG, int DW>
inline void tile_values(const uint16_t* const* vb, const int64_t* ns, int64_t nblk,
                        const float* prob, int64_t Cs, const float* cs, float* acc, int64_t g0) {
  constexpr int D = 32 * DW;
  constexpr int S = 2 * NG * DW >= 8 ? 1 : 2 * NG * DW >= 4 ? 2 : 4;
  T a[S][NG][DW][2];
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < DW; ++c)
      for (int h = 0; h < 2; ++h) {
        a[0][i][c][h] = P::mul(P::load(acc + (g0 + i) * D + 32 * c + 16 * h), P::set1(cs[g0 + i]));
        for (int s = 1; s < S; ++s) a[s][i][c][h] = P::zero();
      }
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  auto row = [&](T(&t)[NG][DW][2], const uint16_t* v, const float* pr) __attribute__((always_inline)) {
    for (int c = 0; c < DW; ++c) {
      const __m512i x = _mm512_loadu_si512(v + 32 * c);
      const T even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const T odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      for (int i = 0; i < NG; ++i) {
        const T w = P::set1(pr[(g0 + i) * Cs]);
        t[i][c][0] = P::fma(w, even, t[i][c][0]);
        t[i][c][1] = P::fma(w, odd, t[i][c][1]);
      }
    }
  };
  const float* pr = prob;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint16_t* v = vb[b];
    const int64_t n = ns[b];
    int64_t j = 0;
    for (; j + S <= n; j += S)
      for (int s = 0; s < S; ++s) row(a[s], v + (j + s) * D, pr + j + s);
    for (; j < n; ++j) row(a[0], v + j * D, pr + j);
    pr += n;
  }
  for (int s = 1; s < S; ++s)
    for (int i = 0; i < NG; ++i)
      for (int c = 0; c < DW; ++c)
        for (int h = 0; h < 2; ++h) a[0][i][c][h] = P::add(a[0][i][c][h], a[s][i][c][h]);
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < DW; ++c)
      for (int h = 0; h < 2; ++h) P::store(acc + (g0 + i) * D + 32 * c + 16 * h, a[0][i][c][h]);
}

// P·V for heads [g0, g0 + ng), ng <= NG
template <int NG, int DW>
inline void some_values(const uint16_t* const* vb, const int64_t* ns, int64_t nblk,
                        const float* prob, int64_t Cs, const float* cs, float* acc, int64_t g0,
                        int64_t ng) {
  if constexpr (NG > 1) {
    if (ng < NG) return some_values<NG - 1, DW>(vb, ns, nblk, prob, Cs, cs, acc, g0, ng);
  }
  tile_values<NG, DW>(vb, ns, nblk, prob, Cs, cs, acc, g0);
}

template <int DW>
void bf16_decode_tasks(const kvrelay::DecodeProblem& p, int64_t begin, int64_t end,
                       float* scratch) {
  constexpr int64_t D = 32 * DW;
  constexpr int kTile = 8 / DW > 1 ? 8 / DW : 1;   // 2·kTile·DW accumulators in registers
  const int64_t G = p.H / p.KVH, B = p.B;
  const int64_t C = kvrelay::decode_chunk(B), Cs = kvrelay::decode_chunk_stride(B);
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
  const int64_t v_off = p.NB * p.KVH * B * D;          // K plane, then V plane
  float* acc = scratch;                                // [G, D] even/odd halves
  float* m = acc + G * D;                              // [G] running max
  float* cs = m + G;                                   // [G] this chunk's rescale
  float* lv = cs + G;                                  // [G, 16] running sums by lane
  float* sc = lv + G * kvrelay::kDecodePad;            // [G, Cs] scores, then probabilities
  uint16_t* qb = reinterpret_cast<uint16_t*>(sc + G * Cs);   // [G, D] q in bf16
  const uint16_t* vbs[kvrelay::kDecodeChunk + 1];      // the chunk's blocks (V rows)
  int64_t ns[kvrelay::kDecodeChunk + 1];               // and their positions
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / p.KVH, kh = task % p.KVH;
    const int64_t len = p.lens[seq];
    const int64_t first = kvrelay::first_position(p, task);
    if (task == begin) kvrelay::prefetch_block(p, task, first);
    if (task + 1 < end)
      kvrelay::prefetch_block(p, task + 1, kvrelay::first_position(p, task + 1));
    const float* qs = p.q + (seq * p.H + kh * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      for (int c = 0; c < DW; ++c)   // exact: q holds bf16 values
        _mm512_storeu_si512(qb + g * D + 32 * c,
                            (__m512i)_mm512_cvtne2ps_pbh(P::load(qs + g * D + 32 * c + 16),
                                                         P::load(qs + g * D + 32 * c)));
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.f;
      m[g] = -__builtin_inff();
      P::store(lv + g * kvrelay::kDecodePad, P::zero());
    }
    for (int64_t p0 = first; p0 < len;) {
      // 1. the chunk: whole blocks of up to C positions; every head's scores of them
      int64_t nblk = 0, o = 0;
      while (p0 < len) {
        const auto [n, k_at] = kvrelay::chunk_block(p, task, p0, o, C);
        if (n == 0) break;
        const uint16_t* kb = kv + k_at;
        kvrelay::prefetch_block(p, task, p0 + n);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j0 = 0; j0 < n; j0 += kRows) {
            const int64_t nj = n - j0 < kRows ? n - j0 : kRows;
            P::store(sc + g * Cs + o + j0, head_scores<DW>(qb + g * D, kb + j0 * D, nj, p.scale));
          }
        vbs[nblk] = kb + v_off;
        ns[nblk++] = n;
        o += n;
        p0 += n;
      }
      // 2. online softmax per head over the chunk, as in paged_decode_simd.h
      for (int64_t g = 0; g < G; ++g) {
        float* sg = sc + g * Cs;
        T mx = P::set1(-__builtin_inff());
        for (int64_t j0 = 0; j0 < o; j0 += kRows)
          mx = P::max(mx, P::first(P::load(sg + j0), int(o - j0), -__builtin_inff()));
        const float bm = P::hmax(mx);
        const float mnew = m[g] > bm ? m[g] : bm;
        const float c = __builtin_isinf(m[g]) ? 0.f : exp_neg(m[g] - mnew);  // first: 0
        const T mv = P::set1(mnew);
        T sum = P::mul(P::load(lv + g * kvrelay::kDecodePad), P::set1(c));
        for (int64_t j0 = 0; j0 < o; j0 += kRows) {
          const T e = P::first(P::exp_neg(P::sub(P::load(sg + j0), mv)), int(o - j0), 0.f);
          P::store(sg + j0, e);
          sum = P::add(sum, e);
        }
        P::store(lv + g * kvrelay::kDecodePad, sum);
        cs[g] = c;
        m[g] = mnew;
      }
      // 3. P·V over the chunk's V rows
      for (int64_t g0 = 0; g0 < G; g0 += kTile)
        some_values<kTile, DW>(vbs, ns, nblk, sc, Cs, cs, acc, g0,
                               G - g0 < kTile ? G - g0 : kTile);
    }
    float* os = p.out + (seq * p.H + kh * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float l = P::hsum(P::load(lv + g * kvrelay::kDecodePad));
      const float sink = p.sinks[kh * G + g];
      const float mx = m[g] > sink ? m[g] : sink;
      const float c = exp_neg(m[g] - mx);
      const float f = c / (l * c + exp_neg(sink - mx));
      for (int64_t d0 = 0; d0 < D; d0 += 32)
        for (int64_t i = 0; i < 16; ++i) {
          os[g * D + d0 + 2 * i] = acc[g * D + d0 + i] * f;
          os[g * D + d0 + 2 * i + 1] = acc[g * D + d0 + 16 + i] * f;
        }
    }
  }
}

void decode_tasks_bf16(const kvrelay::DecodeProblem& p, int64_t begin, int64_t end,
                       float* scratch) {
  if (p.format == kvrelay::kKvBF16) {
    switch (p.D) {
      case 32: return bf16_decode_tasks<1>(p, begin, end, scratch);
      case 64: return bf16_decode_tasks<2>(p, begin, end, scratch);
      case 96: return bf16_decode_tasks<3>(p, begin, end, scratch);
      case 128: return bf16_decode_tasks<4>(p, begin, end, scratch);
      default: break;
    }
  }
  kvrelay::decode_tasks_avx512(p, begin, end, scratch);
}

}  // namespace

#endif

kvrelay::DecodeFn kvrelay::decode_fn_for(const char* isa_name, DecodeFn fallback) {
#if defined(__x86_64__) || defined(__i386__)
  if (strcmp(isa_name, "avx512_bf16") == 0) return &decode_tasks_bf16;
#endif
  (void)isa_name;
  return fallback;
}
