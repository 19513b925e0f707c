// The MoE expert kernels, written once against a small vector abstraction and compiled
// once per ISA. Include this inside an anonymous namespace after defining `struct V`:
//
//   V::W            float lanes of V::T          V::NB  token rows per pass (4 or 8)
//   V::kChains, V::kChainsFp4   accumulators to keep in flight (dense, MXFP4)
//   zero() load(const float*) load_bf16(const uint16_t*) set1(float)
//   mul(a, b) add(a, b) fma(a, b, c) = a·b + c   hsum(a) = Σ lanes
//   fp4x2(const uint8_t* codes16, T out[32 / W])  one MXFP4 group as floats, each
//                                                 2 × its e2m1 value (an integer in ±12),
//                                                 low nibbles first (moe.h: column order)
// hence the group scale 2^(s - 128) (MoeProblem::half_scales, a table: one load a group).
//   fp4x2_scaled(codes16, scale, out)            the same times scale (exact: a power of 2)
//   kScaledDecode   one token row also takes Fp4Rows and fp4x2_scaled (one multiply a group
//                   on AVX-512, where the 16-entry table is scaled before the lookups)
//   kRowBlock       MXFP4 weight rows that share each x load when several token rows are
//                   routed to one expert (Fp4Rows: R·NT·A accumulators must fit the registers)
//   mxfp4_bf16(w, e, r0, r1, x, nt, out, ldo)    MXFP4 rows [r0, r1) of expert e against
//                   nt ≤ NB token rows of x by another route (bf16 dot products), writing
//                   out[(r - r0)·ldo + t]; false, having done nothing, where
//                   the build has none or x does not qualify (then fp4_rows runs)
//   inputs_changed()  called as each down sweep starts: what mxfp4_bf16 kept of the gate_up
//                   inputs (packed x) must not be used again
//
// MXFP4 is dequantised in registers: per group of 32 weights the doubled e2m1 values
// are dotted with x and the partial sum is scaled once by 2^(scale-128) (the E8M0
// exponent, halved). Only powers of two differ from dequantise-then-dot, so the result
// matches the reference up to float summation order.
#pragma once

using VT = V::T;

inline float bits_to_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

struct F32Row {
  const float* p;
  VT load(int64_t k) const { return V::load(p + k); }
  float scalar(int64_t k) const { return p[k]; }
  const char* bytes(int64_t k) const { return reinterpret_cast<const char*>(p + k); }
};

struct BF16Row {
  const uint16_t* p;
  VT load(int64_t k) const { return V::load_bf16(p + k); }
  float scalar(int64_t k) const { return bf16_to_f32(p[k]); }
  const char* bytes(int64_t k) const { return reinterpret_cast<const char*>(p + k); }
};

// Software prefetch of a dense weight stream: the bytes `kStreamAhead` past those a row
// pass reads, kept inside the work item's weights (`end`; null: none). Each row prefetches
// exactly its own byte range shifted by the distance, so consecutive rows of an item cover
// the stream without gaps. Bounded by the item, not the expert: another thread may be
// streaming the next item. Measured (embedded experts, bf16, 1 token, one thread, DRAM-
// streamed): none 25-28 GB/s, 2 KiB 25-28, 4 KiB 28-30, 8 KiB 32, 16 KiB 28-32.
constexpr int64_t kStreamAhead = 8192;

struct Prefetch {
  const char* end;
  // lines of [from, to) + kStreamAhead that lie before `end`
  inline void lines(const char* from, const char* to) const {
    if (!end) return;
    const char* a = from + kStreamAhead;
    const char* b = to + kStreamAhead < end ? to + kStreamAhead : end;
    for (; a < b; a += 64) __builtin_prefetch(a);
  }
};

// Dot products of one weight row with NT token rows x[t·ldx : t·ldx + K].
// U·NT independent accumulators keep both FMA pipes busy (latency 4: 8 chains) when NT
// is small; MXFP4 needs more registers per chain, hence its own count (V::kChainsFp4).
template <int NT>
struct Dots {
  static constexpr int U = NT >= V::kChains ? 1 : V::kChains / NT;
  static constexpr int UF = NT >= V::kChainsFp4 ? 1 : V::kChainsFp4 / NT;

  // out[t] += Σ_{k0 ≤ k < K} row[k] · x[t·ldx + k]
  // `pf` prefetches the stream ahead of the row (see Prefetch).
  template <class Row>
  static inline void dense(const Row& row, const float* x, int64_t ldx, int64_t k0, int64_t K,
                           float* out, const Prefetch& pf = Prefetch{nullptr}) {
    VT acc[U][NT];
    for (int u = 0; u < U; ++u)
      for (int t = 0; t < NT; ++t) acc[u][t] = V::zero();
    int64_t k = k0;
    for (; k + U * V::W <= K; k += U * V::W) {
      pf.lines(row.bytes(k), row.bytes(k + U * V::W));
      for (int u = 0; u < U; ++u) {
        const VT w = row.load(k + u * V::W);
        for (int t = 0; t < NT; ++t)
          acc[u][t] = V::fma(w, V::load(x + t * ldx + k + u * V::W), acc[u][t]);
      }
    }
    pf.lines(row.bytes(k), row.bytes(K));
    for (; k + V::W <= K; k += V::W) {
      const VT w = row.load(k);
      for (int t = 0; t < NT; ++t) acc[0][t] = V::fma(w, V::load(x + t * ldx + k), acc[0][t]);
    }
    finish(acc, out);
    for (int64_t j = k; j < K; ++j) {  // tail when K is not a multiple of W
      const float w = row.scalar(j);
      for (int t = 0; t < NT; ++t) out[t] += w * x[t * ldx + j];
    }
  }

  // out[t] += the same over groups [g0, groups) of 32 weights
  static inline void mxfp4(const uint8_t* codes, const uint8_t* scales, const float* table,
                           int64_t g0, int64_t groups, const float* x, int64_t ldx,
                           float* out) {
    VT acc[UF][NT];
    for (int u = 0; u < UF; ++u)
      for (int t = 0; t < NT; ++t) acc[u][t] = V::zero();
    int64_t g = g0;
    for (; g + UF <= groups; g += UF)
      for (int u = 0; u < UF; ++u) group(codes, table[scales[g + u]], g + u, x, ldx, acc[u]);
    for (; g < groups; ++g) group(codes, table[scales[g]], g, x, ldx, acc[0]);
    finish(acc, out);
  }

  // One group against NT token rows (one row on ISAs without kScaledDecode; the others
  // take Fp4Rows): the doubled e2m1 values are dotted with x and the sum scaled.
  static inline void group(const uint8_t* codes, float half_scale, int64_t g, const float* x,
                           int64_t ldx, VT* acc) {
    constexpr int C = 32 / V::W;
    VT w[C];
    const float* xg = x + g * 32;
    V::fp4x2(codes + g * 16, w);
    const VT scale = V::set1(half_scale);
    for (int t = 0; t < NT; ++t) {
      VT s = V::mul(w[0], V::load(xg + t * ldx));
      for (int c = 1; c < C; ++c) s = V::fma(w[c], V::load(xg + t * ldx + c * V::W), s);
      acc[t] = V::fma(s, scale, acc[t]);
    }
  }

  template <int N>
  static inline void finish(VT (&acc)[N][NT], float* out) {
    for (int t = 0; t < NT; ++t) {
      VT s = acc[0][t];
      for (int u = 1; u < N; ++u) s = V::add(s, acc[u][t]);
      out[t] += V::hsum(s);
    }
  }
};

// MXFP4 rows [r, r + R) of one expert against NT token rows: each group of each row is
// decoded and scaled once (V::fp4x2_scaled) for all NT tokens, and each x vector is loaded
// once for all R rows (row blocking: R·NT·A accumulators in registers). A row's sums do not
// depend on R (A partial sums per (row, token); part c of a step's s-th group goes to sum
// (s·C + c) % A), so rows give the same bits whichever block they fall in.
// Fp4Rows reads kRowBlock weight rows side by side: the hardware prefetcher follows one
// sequential stream well, several poorly (20b layer, 1 token, 2 rows: 6.3 ms without
// prefetches, 2.5 with each row prefetching 8 KiB past itself; 1 KiB: 4.9, 4 KiB: 3.0).
// The R rows of a block are one contiguous range of codes (and of scales, 1/16 of the
// bytes), so the prefetches walk that range once, in order, kFp4SeqAhead bytes ahead of
// the block's start: step g of the block's pass fetches bytes g·R·16 of it (the R rows'
// group g), and memory sees one sequential stream.

// Prefetches for step g (a group) of a pass over a block of R rows starting at
// codes/scales: one line of codes per 64 bytes consumed, one of scales per 64 groups.
template <int R>
inline void prefetch_block_step(const uint8_t* codes, const uint8_t* scales, int64_t g) {
  const int64_t at = g * R * 16;
  if (R >= 4 || at % 64 == 0) __builtin_prefetch(codes + kvrelay::kFp4SeqAhead + at);
  if ((g * R) % 64 == 0) __builtin_prefetch(scales + kvrelay::kFp4SeqAhead / 16 + g * R);
}

template <int NT>
struct Fp4Rows {
  static constexpr int C = 32 / V::W;
  static constexpr int A = NT >= 4 ? 1 : NT == 2 ? 2 : 4;  // multiply-add chains in flight
  static constexpr int S = A > C ? A / C : 1;              // groups per step: S·C ≥ A parts

  template <int R, int Steps>
  static inline void step(const uint8_t* codes, const uint8_t* scales, int64_t groups,
                          const float* table, int64_t g, const float* x, int64_t ldx,
                          VT (&acc)[R][A][NT]) {
    for (int s = 0; s < Steps; ++s) {
      VT w[R][C];
      prefetch_block_step<R>(codes, scales, g + s);
      for (int i = 0; i < R; ++i) {
        const uint8_t* row = codes + (i * groups + g + s) * 16;
        V::fp4x2_scaled(row, table[scales[i * groups + g + s]], w[i]);
      }
      const float* xg = x + (g + s) * 32;
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < C; ++c) {
          const VT xv = V::load(xg + t * ldx + c * V::W);
          for (int i = 0; i < R; ++i) {
            VT& a = acc[i][(s * C + c) % A][t];
            a = V::fma(w[i][c], xv, a);
          }
        }
    }
  }

  template <int R>
  static inline void dots(const uint8_t* codes, const uint8_t* scales, int64_t groups,
                          const float* table, int64_t g0, int64_t g1, const float* x,
                          int64_t ldx, float* out, int64_t ldo) {
    VT acc[R][A][NT];
    for (int i = 0; i < R; ++i)
      for (int a = 0; a < A; ++a)
        for (int t = 0; t < NT; ++t) acc[i][a][t] = V::zero();
    int64_t g = g0;
    for (; g + S <= g1; g += S) step<R, S>(codes, scales, groups, table, g, x, ldx, acc);
    for (; g < g1; ++g) step<R, 1>(codes, scales, groups, table, g, x, ldx, acc);
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < NT; ++t) {
        VT sum = acc[i][0][t];
        for (int a = 1; a < A; ++a) sum = V::add(sum, acc[i][a][t]);
        out[i * ldo + t] += V::hsum(sum);
      }
  }
};

// Weight rows per block for NT token rows: V::kRowBlock while the R·A·NT accumulators and
// R·C decoded vectors fit the registers (AVX-512, 8 token rows: 4 rows would need 40 of 32).
template <int NT>
constexpr int fp4_row_block() {
  constexpr int C = 32 / V::W, A = Fp4Rows<NT>::A;
  return V::kRowBlock > 1 && V::kRowBlock * (A * NT + C) > 28 ? V::kRowBlock / 2
                                                              : V::kRowBlock;
}

// Columns [k0, k1) of MXFP4 rows [r0, r1) of expert e against NT token rows, fp4_row_block
// rows at a time; row r adds into out[(r - r0) · ldo : + NT].
template <int NT>
inline void fp4_rows(const kvrelay::Projection& w, const float* table, int64_t e, int64_t r0,
                     int64_t r1, int64_t k0, int64_t k1, const float* x, float* out, int64_t ldo) {
  constexpr int R = fp4_row_block<NT>();
  const int64_t groups = w.cols / 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data);
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    const int64_t index = e * w.rows + r;
    Fp4Rows<NT>::template dots<R>(codes + index * groups * 16, w.scales + index * groups,
                                  groups, table, k0 / 32, k1 / 32, x, w.cols,
                                  out + (r - r0) * ldo, ldo);
  }
  for (; r < r1; ++r) {
    const int64_t index = e * w.rows + r;
    Fp4Rows<NT>::template dots<1>(codes + index * groups * 16, w.scales + index * groups, groups,
                                  table, k0 / 32, k1 / 32, x, w.cols, out + (r - r0) * ldo, ldo);
  }
}

// Columns [k0, k1) of row r of expert e against NT token rows; adds into out[0:NT].
template <int NT>
inline void row_dots(const kvrelay::Projection& w, const float* table, int64_t e, int64_t r,
                     int64_t k0, int64_t k1, const float* x, float* out, const Prefetch& pf) {
  const int64_t index = e * w.rows + r;
  if (w.format == kvrelay::kF32) {
    Dots<NT>::dense(F32Row{static_cast<const float*>(w.data) + index * w.cols}, x, w.cols, k0,
                    k1, out, pf);
  } else if (w.format == kvrelay::kBF16) {
    Dots<NT>::dense(BF16Row{static_cast<const uint16_t*>(w.data) + index * w.cols}, x, w.cols,
                    k0, k1, out, pf);
  } else {
    const int64_t groups = w.cols / 32;
    Dots<NT>::mxfp4(static_cast<const uint8_t*>(w.data) + index * groups * 16,
                    w.scales + index * groups, table, k0 / 32, k1 / 32, x, w.cols, out);
  }
}

// Columns per pass: NB token rows × kChunk floats stay in L1 while a tile's weight rows
// stream past them (a multiple of 32 and of every W). Where the block's token rows fit in
// kRowPassBytes whole (1-8 token rows of a 20b layer) each weight row is read in one pass
// instead: a single sequential stream for the prefetcher and one reduction per row, with
// x read from L1/L2 (shared by V::kRowBlock weight rows). Measured on a gpt-oss-20b layer
// (AVX-512, CPU time): 1 token 7.5 -> 2.5 ms; 8 tokens on 4 experts 24 -> 16 ms.
constexpr int64_t kChunk = 1024;
constexpr int64_t kRowPassBytes = 96 * 1024;

using TileOut = float[V::NB][kvrelay::kMaxTileRows];

// The end of the dense weights of rows [tile.row0, row1) of tile.expert: how far a row pass
// of the tile may prefetch (null for MXFP4, which prefetches its own way).
inline const char* dense_end(const kvrelay::Projection& w, const kvrelay::Tile& tile) {
  if (w.format == kvrelay::kMXFP4) return nullptr;
  const int64_t size = w.format == kvrelay::kF32 ? 4 : 2;
  return static_cast<const char*>(w.data) + (tile.expert * w.rows + tile.row1) * w.cols * size;
}

// h[t][r - row0] = x_t · W_e[r] for the n token rows of x, NB rows at a time; `epilogue`
// consumes each block. With n ≤ NB (decode) every weight row is read exactly once, and
// dense rows prefetch up to `stream_end` (dense_end of the whole work item: a tile may be a
// part of one, see for_each_part).
template <class Epilogue>
inline void project(const kvrelay::Projection& w, const float* table, const kvrelay::Tile& tile,
                    const float* x, int64_t n, const char* stream_end,
                    const Epilogue& epilogue) {
  TileOut h;
  for (int64_t t0 = 0; t0 < n; t0 += V::NB) {
    const int64_t nt = n - t0 < V::NB ? n - t0 : V::NB;
    const float* xb = x + t0 * w.cols;
    float o[kvrelay::kMaxTileRows][V::NB] = {};
    float bf16_dots[kvrelay::kMaxTileRows][V::NB];   // its own: `o` stays in this function
    const int64_t chunk = nt * w.cols * 4 <= kRowPassBytes ? w.cols : kChunk;
    const Prefetch pf{chunk == w.cols && n <= V::NB ? stream_end : nullptr};
    const bool done = w.format == kvrelay::kMXFP4 &&
                      V::mxfp4_bf16(w, tile.expert, tile.row0, tile.row1, xb, nt,
                                    bf16_dots[0], V::NB);
    const float(*sums)[V::NB] = done ? bf16_dots : o;
    for (int64_t k0 = 0; !done && k0 < w.cols; k0 += chunk) {
      const int64_t k1 = w.cols - k0 < chunk ? w.cols : k0 + chunk;
      if (w.format == kvrelay::kMXFP4 && (nt >= 2 || V::kScaledDecode)) {
        float* out = o[0];
        const int64_t e = tile.expert;
        if (nt == 1) fp4_rows<1>(w, table, e, tile.row0, tile.row1, k0, k1, xb, out, V::NB);
        else if (nt == 2) fp4_rows<2>(w, table, e, tile.row0, tile.row1, k0, k1, xb, out, V::NB);
        else if (nt <= 4 || V::NB == 4)
          fp4_rows<4>(w, table, e, tile.row0, tile.row1, k0, k1, xb, out, V::NB);
        else fp4_rows<V::NB>(w, table, e, tile.row0, tile.row1, k0, k1, xb, out, V::NB);
        continue;
      }
      for (int32_t r = tile.row0; r < tile.row1; ++r) {
        float* out = o[r - tile.row0];
        if (nt == 1) row_dots<1>(w, table, tile.expert, r, k0, k1, xb, out, pf);
        else if (nt == 2) row_dots<2>(w, table, tile.expert, r, k0, k1, xb, out, pf);
        else if (nt <= 4 || V::NB == 4)
          row_dots<4>(w, table, tile.expert, r, k0, k1, xb, out, pf);
        else row_dots<V::NB>(w, table, tile.expert, r, k0, k1, xb, out, pf);
      }
    }
    for (int32_t r = tile.row0; r < tile.row1; ++r)
      for (int64_t t = 0; t < nt; ++t) h[t][r - tile.row0] = sums[r - tile.row0][t];
    epilogue(t0, nt, h);
  }
}

// fn(part) for the parts of `tile` of at most kMaxTileRows rows (a decode work item of
// dense weights spans many: one long stream per item, see moe_op.cpp `tiles`). A part's
// rows are computed as they would be in a tile of their own.
template <class F>
inline void for_each_part(const kvrelay::Tile& tile, const F& fn) {
  for (int32_t r = tile.row0; r < tile.row1; r += kvrelay::kMaxTileRows) {
    kvrelay::Tile part = tile;
    part.row0 = r;
    part.row1 = tile.row1 - r < kvrelay::kMaxTileRows ? tile.row1 : r + kvrelay::kMaxTileRows;
    fn(part);
  }
}

// gate_up rows come in (gate, up) pairs; a tile starts on an even row.
inline void gate_up_tile(const kvrelay::MoeProblem& p, const kvrelay::Tile& tile,
                         const char* stream_end) {
  const int64_t H = p.gate_up.cols, I = p.down.cols;
  const int64_t off = p.offsets[tile.expert] + tile.tok0, n = tile.tok1 - tile.tok0;
  const float* bias = p.gate_up.bias ? p.gate_up.bias + tile.expert * p.gate_up.rows : nullptr;
  const float* x = p.x + off * H;
  project(p.gate_up, p.half_scales, tile, x, n, stream_end,
          [&](int64_t t0, int64_t nt, TileOut& h) {
    for (int64_t t = 0; t < nt; ++t) {
      float* act = p.act + (off + t0 + t) * I;
      const bool fp4_order = p.down.format == kvrelay::kMXFP4;
      for (int32_t r = tile.row0; r < tile.row1; r += 2) {
        float gate = h[t][r - tile.row0] + (bias ? bias[r] : 0.0f);
        float up = h[t][r + 1 - tile.row0] + (bias ? bias[r + 1] : 0.0f);
        gate = gate > p.limit ? p.limit : gate;
        up = up > p.limit ? p.limit : (up < -p.limit ? -p.limit : up);
        const float sig = 1.0f / (1.0f + __builtin_expf(-(gate * p.alpha)));
        act[fp4_order ? kvrelay::fp4_column(r / 2) : r / 2] = (up + 1.0f) * gate * sig;
      }
    }
  });
}

inline void down_tile(const kvrelay::MoeProblem& p, const kvrelay::Tile& tile,
                      const char* stream_end) {
  const int64_t H = p.down.rows, I = p.down.cols;
  const int64_t off = p.offsets[tile.expert] + tile.tok0, n = tile.tok1 - tile.tok0;
  const float* bias = p.down.bias ? p.down.bias + tile.expert * H : nullptr;
  const float* act = p.act + off * I;
  project(p.down, p.half_scales, tile, act, n, stream_end,
          [&](int64_t t0, int64_t nt, TileOut& h) {
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t row = off + t0 + t;
      float* y = p.y + row * H;
      const float weight = p.route_weight[row];
      for (int32_t r = tile.row0; r < tile.row1; ++r)
        y[r] = (h[t][r - tile.row0] + (bias ? bias[r] : 0.0f)) * weight;
    }
  });
}

void gate_up_tiles(const kvrelay::MoeProblem& p, const kvrelay::Tile* tiles, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const char* stream_end = dense_end(p.gate_up, tiles[i]);
    for_each_part(tiles[i], [&](const kvrelay::Tile& part) { gate_up_tile(p, part, stream_end); });
  }
}

void down_tiles(const kvrelay::MoeProblem& p, const kvrelay::Tile* tiles, int64_t count) {
  V::inputs_changed();
  for (int64_t i = 0; i < count; ++i) {
    const char* stream_end = dense_end(p.down, tiles[i]);
    for_each_part(tiles[i], [&](const kvrelay::Tile& part) { down_tile(p, part, stream_end); });
  }
}
