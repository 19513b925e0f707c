// AVX512-BF16 build of the dense decode kernel (Cooper Lake, Sapphire Rapids, Zen 4):
// vdpbf16ps multiplies pairs of bf16 weights and bf16 inputs exactly and accumulates them
// in fp32, 32 weights per instruction, so bf16 weights are never widened. Chosen at run
// time (dense_op.cpp) for bf16 inputs and weights; fp32 ones take the "avx512" kernel.
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512_BF16)

namespace {

#include "simd_avx512.h"

// The weights stream from DRAM. Measured here (Zen 5, one thread, one input row): reading
// one weight row after the other — a single sequential stream, the pattern the hardware
// prefetchers follow best — with software prefetches kStreamAhead bytes ahead reaches 1.4x
// the rate of eight rows read side by side with a prefetch per row (eight streams, eight
// pages touched per step); 4 and 16 KiB ahead measured alike.
constexpr int64_t kStreamAhead = 4096;
// Many input rows: each block of weight rows is read from DRAM once and then used from L1
// for several passes of compute, so the prefetches run further ahead: past the next block
// by kTileAhead bytes (the next block itself: 1.4x no prefetch at 16 rows; 8-32 KiB past
// it: 1.9-2x).
constexpr int64_t kTileAhead = 16384;

inline __m512bh load_pairs(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) {  // masked lanes read as 0
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

inline __mmask32 tail_mask(int64_t left) {  // the first min(left, 32) lanes
  return left >= 32 ? ~__mmask32(0) : __mmask32((uint32_t(1) << left) - 1);
}

inline void store(const kvrelay::DenseProblem& p, int64_t m, int64_t n, float v) {
  if (p.bias) v += p.bias[n];
  const int64_t i = m * p.N + n;
  if (p.y_format == kvrelay::kDenseF32) static_cast<float*>(p.y)[i] = v;
  else static_cast<uint16_t*>(p.y)[i] = f32_to_bf16(v);
}

// y[m, n : n + 4] = v (+ bias): one vector store; bf16 rounded as `f32_to_bf16` does, lane-wise.
inline void store4(const kvrelay::DenseProblem& p, int64_t m, int64_t n, __m128 v) {
  if (p.bias) v = _mm_add_ps(v, _mm_loadu_ps(p.bias + n));
  const int64_t i = m * p.N + n;
  if (p.y_format == kvrelay::kDenseF32) {
    _mm_storeu_ps(static_cast<float*>(p.y) + i, v);
    return;
  }
  const __m128i u = _mm_castps_si128(v);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  const __m128i rounded =
      _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), odd), 16);
  const __m128i quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7FFFFFFF)),
                                      _mm_set1_epi32(0x7F800000));
  const __m128i bits = _mm_blendv_epi8(rounded, quiet, nan);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p.y) + i),
                   _mm_packus_epi32(bits, bits));
}

// Few input rows (memory-bound): y[0 : MR, n0 : n1], one weight row at a time, read once
// for all MR inputs; U independent accumulators per input along k keep the dot-product
// chains apart. Prefetches stay inside this thread's rows [n0, n1).
template <int MR, int U>
void stream_rows(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K;
  const uint16_t* x = p.x_bf16;
  const uint16_t* w_all = static_cast<const uint16_t*>(p.w);
  const char* w_end = reinterpret_cast<const char*>(w_all + n1 * K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = w_all + n * K;
    __m512 acc[U][MR];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MR; ++m) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
      const char* ahead = reinterpret_cast<const char*>(w + k) + kStreamAhead;
      if (ahead + 64 * U <= w_end)
        for (int u = 0; u < U; ++u) _mm_prefetch(ahead + 64 * u, _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m512bh wv = load_pairs(w + k + 32 * u);
        for (int m = 0; m < MR; ++m)
          acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv, load_pairs(x + m * K + k + 32 * u));
      }
    }
    for (; k < K; k += 32) {  // whole vectors left, then the masked tail
      const __mmask32 mask = tail_mask(K - k);
      const __m512bh wv = load_pairs(w + k, mask);
      for (int m = 0; m < MR; ++m)
        acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, load_pairs(x + m * K + k, mask));
    }
    for (int m = 0; m < MR; ++m) {
      __m512 sum = acc[0][m];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m]);
      store(p, m, n, _mm512_reduce_add_ps(sum));
    }
  }
}

// Many input rows (compute-bound: vdpbf16ps throughput): y[m0 : m0 + MR, n : n + NR], the
// NR weight rows kept in L1 across the passes over the inputs. Every pass prefetches its
// share of the next block of rows (`ahead`, `lines` cache lines a step), so the block's
// DRAM reads are spread over all passes instead of bursting in the first.
template <int NR, int MR>
inline void tile(const kvrelay::DenseProblem& p, int64_t n, int64_t m0, const char* ahead,
                 int lines) {
  const int64_t K = p.K;
  const uint16_t* x = p.x_bf16 + m0 * K;
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + n * K;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (ahead) {
      for (int l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      ahead += 64 * lines;
    }
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_pairs(x + m * K + k);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = load_pairs(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k < K) {
    const __mmask32 mask = tail_mask(K - k);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_pairs(x + m * K + k, mask);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = load_pairs(w + r * K + k, mask);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if constexpr (NR % 4 == 0) {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; r += 4)
        store4(p, m0 + m, n + r, sum4x16(acc[r][m], acc[r + 1][m], acc[r + 2][m], acc[r + 3][m]));
  } else {
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) store(p, m0 + m, n + r, _mm512_reduce_add_ps(acc[r][m]));
  }
}

// Rows [n, n + NR) against every input row, in passes of up to 4 inputs. The passes
// together prefetch the block at kTileAhead past the next one, `lines` cache lines a step.
template <int NR>
inline void tile_rows(const kvrelay::DenseProblem& p, int64_t n, int64_t n1) {
  const int64_t K = p.K, steps = K / 32, passes = (p.M + 3) / 4;
  const int64_t block_lines = NR * ((K * 2 + 63) / 64);
  const int lines = steps ? int((block_lines + passes * steps - 1) / (passes * steps)) : 0;
  const int64_t ahead_bytes = (n + NR) * K * 2 + kTileAhead;  // from the matrix start
  const bool prefetch = lines && ahead_bytes + NR * K * 2 <= n1 * K * 2;
  const char* next = static_cast<const char*>(p.w) + ahead_bytes;
  int64_t m0 = 0;
  for (int64_t pass = 0; m0 < p.M; ++pass) {
    const char* ahead = prefetch ? next + pass * steps * lines * 64 : nullptr;
    const int64_t left = p.M - m0;
    if (left >= 4) tile<NR, 4>(p, n, m0, ahead, lines), m0 += 4;
    else if (left == 3) tile<NR, 3>(p, n, m0, ahead, lines), m0 += 3;
    else if (left == 2) tile<NR, 2>(p, n, m0, ahead, lines), m0 += 2;
    else tile<NR, 1>(p, n, m0, ahead, lines), m0 += 1;
  }
}

// Up to 4 input rows stream the weights row by row (memory-bound); more take 4x4 tiles
// (compute-bound).
void bf16_dot(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  switch (p.M) {
    case 1: return stream_rows<1, 4>(p, n0, n1);
    case 2: return stream_rows<2, 2>(p, n0, n1);
    case 3: return stream_rows<3, 2>(p, n0, n1);
    case 4: return stream_rows<4, 2>(p, n0, n1);
    default: break;
  }
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_rows<4>(p, n, n1);
  for (; n < n1; ++n) tile_rows<1>(p, n, n1);
}

}  // namespace

bool kvrelay::dense_avx512_bf16(DenseKernels* out) {
  out->name = "avx512_bf16";
  out->bf16_dot = &bf16_dot;
  return true;
}

#else
bool kvrelay::dense_avx512_bf16(DenseKernels*) { return false; }
#endif
