// The AVX2 build's tiled steps for a bf16 cache (paged_decode_simd.h's `Tiles` hook):
// scores and P·V with up to 12 accumulators in registers (AVX2 has 16; one FMA's latency
// needs 8 or more chains in flight), for head dims in whole 16s and two or more query
// heads per KV head. Included by paged_decode_avx2.cpp only, inside its anonymous
// namespace, after paged_decode_simd.h and its P (W = 8).
//
// Scores as outer products. A block's K rows are transposed in scratch while widened from
// bf16, 8 positions × 16 dims at a time: two rounds of 16- and 32-bit unpacks interleave
// the rows, a third against zero makes each bf16 an f32. Each resulting vector holds one
// dim of 4 positions in its low half and the dim 8 further on of the same positions in
// its high half:
//
//   kt vector (x, R) of dims [16t, 16t + 16), positions [8r, 8r + 8):
//     lanes 0-3 = K[8r + 4R + (0..3)][16t + x],  lanes 4-7 = K[8r + 4R + (0..3)][16t + 8 + x]
//
// q is laid out to match once per work item (qt vector (t, x) of a head: q[16t + x] in
// lanes 0-3, q[16t + 8 + x] in lanes 4-7), so per (t, x) each K^T vector meets each
// head's q vector in one FMA: no horizontal reduction per position, each K^T vector
// loaded once per tile of heads (3 heads × 16 positions, or 6 heads × 8), and the last
// step adds each accumulator's two 128-bit halves.
//
// P·V: a 16-bf16 load of a V row widens to f32 by a shift (its even dims) and a mask (its
// odd dims); the accumulators of a tile (6 heads × 16 dims, or fewer heads over 32 or 64
// dims) keep that order in registers over all the chunk's V rows, each head's probability
// broadcast once per row, and go back to the natural order in scratch once per chunk.
//
// Memory: while P·V runs, the next chunk's K and V rows are asked for a few lines per V
// row, so the requests spread over the chunk's time instead of queueing at once.
#pragma once

// f32 of bf16 lanes: [x0..x3 | x8..x11] (`low`) or [x4..x7 | x12..x15], as 256-bit unpacks
// order them
inline __m256 bf16_low(__m256i x) {
  return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
}
inline __m256 bf16_high(__m256i x) {
  return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}

// [a.low + a.high | b.low + b.high]: two accumulators of interleaved halves summed
inline __m256 add_halves(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// rows [0, nr) (nr <= 8) of 16 dims from `k` (row stride D) → kt's 16 vectors (x, R) at
// kt + (2x + R) · 8; rows >= nr are zeros
inline void transpose_rows(const uint16_t* k, int64_t nr, int64_t D, float* kt) {
  __m256i r[8];
  for (int i = 0; i < 8; ++i)
    r[i] = i < nr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i * D))
                  : _mm256_setzero_si256();
  // 32-bit lanes (dim, 2 rows): a = dims 0-3 (8-11), b = dims 4-7 (12-15)
  __m256i a[4], b[4];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    b[i] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  // 16-bit lanes: 4 rows of dim x, then 4 rows of dim x + 1 (x even), rows 4R..4R+3
  const __m256i c[8] = {
      _mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpacklo_epi32(a[2], a[3]),   // x 0-1
      _mm256_unpackhi_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[2], a[3]),   // x 2-3
      _mm256_unpacklo_epi32(b[0], b[1]), _mm256_unpacklo_epi32(b[2], b[3]),   // x 4-5
      _mm256_unpackhi_epi32(b[0], b[1]), _mm256_unpackhi_epi32(b[2], b[3]),   // x 6-7
  };
  for (int i = 0; i < 8; ++i) {   // i = 2 · (x / 2) + R
    const int x = i / 2 * 2, R = i % 2;
    P::store(kt + (2 * x + R) * 8, bf16_low(c[i]));
    P::store(kt + (2 * (x + 1) + R) * 8, bf16_high(c[i]));
  }
}

// Scores of heads [g0, g0 + NH) for positions [0, 8·NR) of the transposed rows kt (NR
// groups of 8 rows, T = D / 16 groups of 16 dims each, group r at kt + r·T·128; `nr`
// positions valid, lanes after them -inf) into score rows sc (stride Cs), with the
// matching q layout qt.
template <int NH, int NR>
inline void score_tile(const float* kt, int64_t T, const float* qt, int64_t g0, int64_t nr,
                       float* sc, int64_t Cs) {
  __m256 a[NH][NR][2];
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NR; ++r) a[h][r][0] = a[h][r][1] = P::zero();
  const float* q0 = qt + g0 * T * 64;
  for (int64_t tx = 0; tx < T * 8; ++tx) {
    __m256 k[NR][2];
    for (int r = 0; r < NR; ++r) {
      k[r][0] = P::load(kt + r * T * 128 + tx * 16);
      k[r][1] = P::load(kt + r * T * 128 + tx * 16 + 8);
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 q = P::load(q0 + (h * T * 8 + tx) * 8);
      for (int r = 0; r < NR; ++r) {
        a[h][r][0] = P::fma(q, k[r][0], a[h][r][0]);
        a[h][r][1] = P::fma(q, k[r][1], a[h][r][1]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NR; ++r)
      P::store(sc + (g0 + h) * Cs + 8 * r,
               P::first(add_halves(a[h][r][0], a[h][r][1]), int(nr - 8 * r), -__builtin_inff()));
}

// the score tile of nh <= NH heads from g0
template <int NH, int NR>
inline void score_cut(const float* kt, int64_t T, const float* qt, int64_t g0, int64_t nh,
                      int64_t nr, float* sc, int64_t Cs) {
  if constexpr (NH > 1) {
    if (nh < NH) return score_cut<NH - 1, NR>(kt, T, qt, g0, nh, nr, sc, Cs);
  }
  score_tile<NH, NR>(kt, T, qt, g0, nr, sc, Cs);
}

// score tiles of up to NH heads (NR row groups) over every head
template <int NH, int NR>
inline void score_heads(const float* kt, int64_t T, const float* qt, int64_t G, int64_t nr,
                        float* sc, int64_t Cs) {
  for (int64_t g0 = 0; g0 < G; g0 += NH)
    score_cut<NH, NR>(kt, T, qt, g0, G - g0 < NH ? G - g0 : NH, nr, sc, Cs);
}

// The blocks of the chunk from position p0 of work item `task` (the first chunk of the next
// work item before `end` where `task` has no positions left): their K rows' element
// offsets and row counts; returns how many
inline int64_t next_chunk(const kvrelay::DecodeProblem& p, int64_t task, int64_t p0,
                          int64_t end, int64_t* at, int64_t* ns) {
  if (p0 >= p.lens[task / p.KVH]) {
    if (++task >= end) return 0;
    p0 = kvrelay::first_position(p, task);
  }
  const int64_t len = p.lens[task / p.KVH], C = kvrelay::decode_chunk(p.B);
  int64_t nb = 0;
  for (int64_t held = 0; p0 < len; ++nb) {
    const auto [n, k_at] = kvrelay::chunk_block(p, task, p0, held, C);
    if (n == 0) break;
    at[nb] = k_at;
    ns[nb] = n;
    held += n;
    p0 += n;
  }
  return nb;
}

// Asks for the next chunk's K and V rows while P·V runs, spread evenly over it so the
// requests never queue up at once: each V row a P·V tile reads earns `lines` credits
// (the next chunk's K lines), and each `steps` of them (the V rows all the chunk's P·V
// tiles read) ask for one line of K and one of V; `rest` asks for what is left.
struct NextChunk {
  const char* kv;          // the cache, bytes
  const ChunkRows& next;   // K rows: element offsets, row counts
  int64_t row_bytes, v_off, lines, steps, credit = 0;   // steps > 0
  int64_t b = 0, off = 0;  // the next line: block b, byte offset within its K (and V) rows

  void rows(int64_t n) {
    credit += n * lines;
    for (; credit >= steps && b < next.nblk; credit -= steps) step();
  }
  void rest() {
    while (b < next.nblk) step();
  }
  __attribute__((always_inline)) void step() {
    const char* k = kv + next.at[b] * 2 + off;
    kvrelay::prefetch_line(k);
    kvrelay::prefetch_line(k + v_off);
    off += 64;
    if (off >= next.ns[b] * row_bytes) {
      ++b;
      off = 0;
    }
  }
};

// V accumulators of NH heads for dims [d0, d0 + 16·ND): acc · cs + Σ_j prob[j] · V[j][d0..].
// A 16-bf16 load of V widens to f32 by a shift (its even dims) and a mask (its odd dims);
// the accumulators keep that order and go back to the natural one in scratch.
template <int NH, int ND>
inline void value_tile(const uint16_t* kv, int64_t D, const ChunkRows& rows, const float* prob,
                       const float* cs, float* acc, int64_t Dp, int64_t g0, int64_t d0,
                       NextChunk& ahead) {
  __m256 a[NH][ND][2];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < ND; ++c) {
      const float* in = acc + (g0 + h) * Dp + d0 + 16 * c;
      const __m256 lo = P::load(in), hi = P::load(in + 8), s = P::set1(cs[g0 + h]);
      // [0..3 | 8..11] and [4..7 | 12..15], then the even and the odd dims of each quad
      const __m256 x = _mm256_permute2f128_ps(lo, hi, 0x20), y = _mm256_permute2f128_ps(lo, hi, 0x31);
      a[h][c][0] = P::mul(_mm256_shuffle_ps(x, y, 0x88), s);   // dims 0 2 4 6 | 8 10 12 14
      a[h][c][1] = P::mul(_mm256_shuffle_ps(x, y, 0xDD), s);   // dims 1 3 5 7 | 9 11 13 15
    }
  const __m256i odd = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const float* pr = prob + g0 * rows.Cs;
  for (int64_t b = 0; b < rows.nblk; ++b) {
    const uint16_t* v = kv + rows.at[b] + d0;
    const int64_t n = rows.ns[b];
    ahead.rows(n);
    for (int64_t j = 0; j < n; ++j) {
      for (int c = 0; c < ND; ++c) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * D + 16 * c));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        const __m256 odd_dims = _mm256_castsi256_ps(_mm256_and_si256(x, odd));
        for (int h = 0; h < NH; ++h) {
          const __m256 w = P::set1(pr[h * rows.Cs + j]);
          a[h][c][0] = P::fma(w, even, a[h][c][0]);
          a[h][c][1] = P::fma(w, odd_dims, a[h][c][1]);
        }
      }
    }
    pr += n;
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < ND; ++c) {
      float* out = acc + (g0 + h) * Dp + d0 + 16 * c;
      // interleaved back: [0..3 | 8..11], [4..7 | 12..15], then the halves in order
      const __m256 x = _mm256_unpacklo_ps(a[h][c][0], a[h][c][1]);
      const __m256 y = _mm256_unpackhi_ps(a[h][c][0], a[h][c][1]);
      P::store(out, _mm256_permute2f128_ps(x, y, 0x20));
      P::store(out + 8, _mm256_permute2f128_ps(x, y, 0x31));
    }
}

// value tiles of NH heads from g0 over every dim: ND groups of 16 at a time, then one
template <int NH, int ND>
inline void value_dims(const uint16_t* kv, int64_t D, const ChunkRows& rows, const float* prob,
                       const float* cs, float* acc, int64_t Dp, int64_t g0, NextChunk& ahead) {
  int64_t d0 = 0;
  for (; d0 + 16 * ND <= D; d0 += 16 * ND)
    value_tile<NH, ND>(kv, D, rows, prob, cs, acc, Dp, g0, d0, ahead);
  for (; d0 < D; d0 += 16) value_tile<NH, 1>(kv, D, rows, prob, cs, acc, Dp, g0, d0, ahead);
}

// 16-dim groups per P·V tile of nh heads (value_heads): up to 12 accumulators
constexpr int value_groups(int64_t nh) { return nh >= 4 ? 1 : nh >= 2 ? 2 : 4; }

// value_tile calls per chunk for G heads (6 a tile, then what is left)
inline int64_t value_passes(int64_t G, int64_t D) {
  int64_t passes = 0;
  for (int64_t g0 = 0; g0 < G; g0 += 6) {
    const int64_t nd = value_groups(G - g0 > 6 ? 6 : G - g0), T = D / 16;
    passes += T / nd + T % nd;
  }
  return passes;
}

// the P·V tile for `nh` heads from g0: up to 12 accumulators (heads × 16-dim groups × 2)
inline void value_heads(const uint16_t* kv, int64_t D, const ChunkRows& rows, const float* prob,
                        const float* cs, float* acc, int64_t Dp, int64_t g0, int64_t nh,
                        NextChunk& ahead) {
  switch (nh) {
    case 6: return value_dims<6, value_groups(6)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
    case 5: return value_dims<5, value_groups(5)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
    case 4: return value_dims<4, value_groups(4)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
    case 3: return value_dims<3, value_groups(3)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
    case 2: return value_dims<2, value_groups(2)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
    default: return value_dims<1, value_groups(1)>(kv, D, rows, prob, cs, acc, Dp, g0, ahead);
  }
}

struct Bf16Tiles {
  static constexpr bool kEnabled = true;

  static bool applies(const kvrelay::DecodeProblem& p) {
    return p.format == kvrelay::kKvBF16 && p.D % 16 == 0 && p.H / p.KVH >= 2;
  }

  // G heads of scaled q (row stride D) → qt [G, D / 16, 8 (x), 8 lanes]
  static void prepare_q(const float* qs, float scale, int64_t G, int64_t D, float* qt) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < D / 16; ++t)
        for (int x = 0; x < 8; ++x) {
          const float* q = qs + g * D + 16 * t + x;
          P::store(qt + ((g * (D / 16) + t) * 8 + x) * 8,
                   _mm256_setr_m128(_mm_set1_ps(q[0] * scale), _mm_set1_ps(q[8] * scale)));
        }
  }

  // every head's scores of a block's n positions (K rows from element k_at) into score
  // rows sc (stride Cs); kt: scratch for the transposed rows (16 × D floats)
  static void scores(const kvrelay::DecodeProblem& p, int64_t k_at, int64_t n, const float* qt,
                     float* kt, float* sc, int64_t G, int64_t Cs) {
    const uint16_t* k = static_cast<const uint16_t*>(p.kv) + k_at;
    const int64_t D = p.D, T = D / 16;
    for (int64_t r0 = 0; r0 < n; r0 += 16) {   // 16 rows (two groups) or what is left
      const int64_t nr = n - r0 < 16 ? n - r0 : 16;
      for (int64_t g8 = 0; g8 < nr; g8 += 8)
        for (int64_t t = 0; t < T; ++t)
          transpose_rows(k + (r0 + g8) * D + 16 * t, nr - g8 < 8 ? nr - g8 : 8, D,
                         kt + (g8 / 8 * T + t) * 128);
      if (nr > 8) {
        score_heads<3, 2>(kt, T, qt, G, nr, sc + r0, Cs);
      } else {
        score_heads<6, 1>(kt, T, qt, G, nr, sc + r0, Cs);
      }
    }
  }

  // P·V over the chunk's V rows for every head (paged_decode_simd.h's all_values), the
  // K and V rows of the chunk that follows (from position p0 of work item `task`, else
  // the first of the next one before `end`) asked for along the way
  static void values(const kvrelay::DecodeProblem& p, int64_t task, int64_t p0, int64_t end,
                     const ChunkRows& rows, const float* prob, const float* cs, float* acc,
                     int64_t G, int64_t Dp) {
    const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
    int64_t at[kvrelay::kDecodeChunk + 1], ns[kvrelay::kDecodeChunk + 1];
    const ChunkRows next{at, ns, next_chunk(p, task, p0, end, at, ns), 0};
    int64_t lines = 0, steps = 0;
    for (int64_t b = 0; b < next.nblk; ++b) lines += (next.ns[b] * p.D * 2 + 63) / 64;
    for (int64_t b = 0; b < rows.nblk; ++b) steps += rows.ns[b];
    steps *= value_passes(G, p.D);
    NextChunk ahead{static_cast<const char*>(p.kv), next, p.D * 2,
                    p.NB * p.KVH * p.B * p.D * 2, lines, steps};
    for (int64_t g0 = 0; g0 < G;) {
      // heads per tile: 6, then what is left (8 = 6 + 2; 3 as one)
      const int64_t nh = G - g0 > 6 ? 6 : G - g0;
      value_heads(kv, p.D, rows, prob, cs, acc, Dp, g0, nh, ahead);
      g0 += nh;
    }
    ahead.rest();
  }
};
