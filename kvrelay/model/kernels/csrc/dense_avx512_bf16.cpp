// AVX512-BF16 build of the dense decode kernel (Cooper Lake, Sapphire Rapids, Zen 4):
// vdpbf16ps multiplies pairs of bf16 weights and bf16 inputs exactly and accumulates them
// in fp32, 32 weights per instruction, so bf16 weights are never widened. Chosen at run
// time (dense_op.cpp) for bf16 inputs and weights; fp32 ones take the "avx512" kernel.
#include "dense.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Bytes ahead that each step prefetches (see tile); 16 and 48 KiB measured alike, both
// 1.3-1.5x faster than none at 2-16 rows.
constexpr int64_t kPrefetch = 16384;

inline __m512bh load_pairs(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) {  // masked lanes read as 0
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// The sums of four accumulators, [Σa, Σb, Σc, Σd]: one reduction tree for all four
// (a third of the instructions of four separate horizontal sums).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline void store(const kvrelay::DenseProblem& p, int64_t m, int64_t n, float v) {
  if (p.bias) v += p.bias[n];
  const int64_t i = m * p.N + n;
  if (p.y_format == kvrelay::kDenseF32) static_cast<float*>(p.y)[i] = v;
  else static_cast<uint16_t*>(p.y)[i] = to_bf16(v);
}

// y[m0 : m0 + MR, n : n + NR]; the last K % 32 columns are read with a mask (zeros add 0).
// The weights stream from DRAM: each step also prefetches the cache lines kPrefetch bytes
// further on in the (contiguous) weight matrix, one per row, so that many loads are in
// flight while this block computes.
template <int NR, int MR>
inline void tile(const kvrelay::DenseProblem& p, int64_t n, int64_t m0, bool prefetch) {
  const int64_t K = p.K;
  const uint16_t* x = p.x_bf16 + m0 * K;
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + n * K;
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (prefetch)
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetch, _MM_HINT_T0);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_pairs(x + m * K + k);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = load_pairs(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k < K) {
    const __mmask32 mask = __mmask32((uint32_t(1) << (K - k)) - 1);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_pairs(x + m * K + k, mask);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = load_pairs(w + r * K + k, mask);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if constexpr (NR % 4 == 0) {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; r += 4) {
        float v[4];
        _mm_storeu_ps(v, sum4(acc[r][m], acc[r + 1][m], acc[r + 2][m], acc[r + 3][m]));
        for (int j = 0; j < 4; ++j) store(p, m0 + m, n + r + j, v[j]);
      }
  } else {
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) store(p, m0 + m, n + r, _mm512_reduce_add_ps(acc[r][m]));
  }
}

// The first pass over a block of rows prefetches (while inside this thread's range).
template <int NR>
inline void rows(const kvrelay::DenseProblem& p, int64_t n, int64_t n1) {
  const bool prefetch = (n + NR) * p.K * 2 + kPrefetch <= n1 * p.K * 2;
  int64_t m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) tile<NR, 4>(p, n, m0, prefetch && m0 == 0);
  for (; m0 + 2 <= p.M; m0 += 2) tile<NR, 2>(p, n, m0, prefetch && m0 == 0);
  if (m0 < p.M) tile<NR, 1>(p, n, m0, prefetch && m0 == 0);
}

void bf16_dot(const kvrelay::DenseProblem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M <= 2)  // 8 rows x 1-2 inputs: 8-16 accumulators, as many chains as 4 x 4
    for (; n + 8 <= n1; n += 8) rows<8>(p, n, n1);
  for (; n + 4 <= n1; n += 4) rows<4>(p, n, n1);
  for (; n < n1; ++n) rows<1>(p, n, n1);
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
