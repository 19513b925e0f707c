// The prefill attention kernel (contract: prefill.h), written once and compiled once per
// ISA: included inside an anonymous namespace by each `#pragma GCC target` file, after the
// file defines `kVecFloats`, the floats of its own vector register (AVX-512 16, AVX2 8,
// generic 4). Vectors are GCC vector extensions of that width: a type wider than the
// registers is split into pieces the compiler spills to the stack.
//
// A work item is one tile of kPrefillTile query positions of one prompt for one KV head: its
// R = G · tile rows (the G query heads of the KV head at each position) walk the visible keys
// in blocks of kPrefillKeys with an online softmax (running max m, sum l, rescaled
// accumulator, all f32), as paged_decode_impl.h does for one row. Scores and the
// probability-weighted values are computed four rows at a time against a block of keys
// (transposed to f32 once per call by the op: every tile of a prompt reads them), so each
// key load feeds four rows. The sink joins the denominator last.
#pragma once

typedef float vec __attribute__((vector_size(4 * kVecFloats)));
typedef float vecu __attribute__((vector_size(4 * kVecFloats), aligned(4)));

inline vec vload(const float* p) { return *reinterpret_cast<const vecu*>(p); }
inline void vstore(float* p, vec x) { *reinterpret_cast<vecu*>(p) = x; }

// The products run in passes of 4 rows × kCols vectors, their accumulators held in
// registers: 16 of AVX-512's 32 (a pass is a whole block of 64 keys), 8 of AVX2's or
// SSE's 16 (each pass leaves room for its key or value loads and the broadcast).
constexpr int64_t W = kVecFloats;
constexpr int kCols = W == 16 ? 4 : 2;
constexpr int64_t kPass = kCols * W;    // keys (scores4) or head dims (values4) per pass

#include "simd_generic.h"   // bf16_to_f32, exp_neg

constexpr int64_t KB = kvrelay::kPrefillKeys;

// n elements at element offset `at` of `src` (in the problem's format) as f32, times `mul`
inline void row_to_f32(int32_t format, const void* src, int64_t at, int64_t n, float mul,
                       float* dst) {
  if (format == kvrelay::kPrefillF32) {
    const float* s = static_cast<const float*>(src) + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i] * mul;
  } else if (format == kvrelay::kPrefillBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]) * mul;
  } else {
    const _Float16* s = static_cast<const _Float16*>(src) + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]) * mul;
  }
}

// n floats `src · mul` into `dst` at element offset `at`, rounded to the format (bf16:
// to nearest even, as torch rounds)
inline void row_from_f32(int32_t format, const float* src, float mul, int64_t n, void* dst,
                         int64_t at) {
  if (format == kvrelay::kPrefillF32) {
    float* d = static_cast<float*>(dst) + at;
    for (int64_t i = 0; i < n; ++i) d[i] = src[i] * mul;
  } else if (format == kvrelay::kPrefillBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + at;
    for (int64_t i = 0; i < n; ++i) {
      const float f = src[i] * mul;
      uint32_t u;
      __builtin_memcpy(&u, &f, 4);
      d[i] = __builtin_isnan(f) ? uint16_t(0x7FC0)
                                : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
  } else {
    _Float16* d = static_cast<_Float16*>(dst) + at;
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(src[i] * mul);
  }
}

// s[4][KB] = the 4 query rows q (stride Dp) · the block's keys kt [D][ldk]: its n columns,
// rounded up to a pass (those past n stay unread: softmax_row reads the visible ones only)
inline void scores4(const float* q, int64_t Dp, int64_t D, const float* kt, int64_t ldk,
                    int64_t n, float* s) {
  for (int64_t c0 = 0; c0 < n; c0 += kPass) {
    vec a[4][kCols] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* k = kt + d * ldk + c0;
      vec kv[kCols];
      for (int c = 0; c < kCols; ++c) kv[c] = vload(k + c * W);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const float x = q[r * Dp + d];
        for (int c = 0; c < kCols; ++c) a[r][c] += kv[c] * x;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < kCols; ++c) vstore(s + r * KB + c0 + c * W, a[r][c]);
  }
}

// acc[4][NV·W] += p[4][n] · v[n][NV·W] (v rows of stride ldv, acc rows of stride Dp)
template <int NV>
inline void values4(const float* p, const float* v, int64_t n, int64_t ldv, int64_t Dp,
                    float* acc) {
  vec a[4][NV];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = vload(acc + r * Dp + c * W);
  for (int64_t j = 0; j < n; ++j) {
    vec x[NV];
    for (int c = 0; c < NV; ++c) x[c] = vload(v + j * ldv + c * W);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const float w = p[r * KB + j];
      for (int c = 0; c < NV; ++c) a[r][c] += x[c] * w;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NV; ++c) vstore(acc + r * Dp + c * W, a[r][c]);
}

// values4 over the Dp head dims (a multiple of 16: of every build's W)
inline void values4_all(const float* p, const float* v, int64_t n, int64_t ldv, int64_t Dp,
                        float* acc) {
  for (int64_t c0 = 0; c0 < Dp; c0 += kPass) {
    const int64_t left = (Dp - c0) / W;
    if (left >= kCols) values4<kCols>(p, v + c0, n, ldv, Dp, acc + c0);
    else if (left == 3) values4<3>(p, v + c0, n, ldv, Dp, acc + c0);
    else if (left == 2) values4<2>(p, v + c0, n, ldv, Dp, acc + c0);
    else values4<1>(p, v + c0, n, ldv, Dp, acc + c0);
  }
}

// Row r's scores in block [kb0, kb0 + n) → probabilities (0 where the key is not visible
// from `pos`); updates m, l and rescales the row's accumulator. False: nothing visible.
// The visible keys are one run [j_lo, j_hi): the loops take its bounds (no mask per key),
// and only they read the scores.
inline bool softmax_row(float* s, int64_t kb0, int64_t n, int64_t pos, int64_t window,
                        float* m, float* l, float* acc, int64_t Dp) {
  const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int64_t j_lo = lo - kb0 > 0 ? lo - kb0 : 0;
  const int64_t j_hi = pos - kb0 + 1 < n ? pos - kb0 + 1 : n;
  if (j_lo >= j_hi) {
    for (int64_t j = 0; j < n; ++j) s[j] = 0.f;
    return false;
  }
  float mx = *m;
#pragma omp simd reduction(max : mx)
  for (int64_t j = j_lo; j < j_hi; ++j) mx = s[j] > mx ? s[j] : mx;
  const float c = __builtin_isinf(*m) ? 0.f : exp_neg(*m - mx);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = j_lo; j < j_hi; ++j) {
    const float e = exp_neg(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  for (int64_t j = 0; j < j_lo; ++j) s[j] = 0.f;     // values4 reads the block's n columns
  for (int64_t j = j_hi; j < n; ++j) s[j] = 0.f;
  *l = *l * c + sum;
  *m = mx;
#pragma omp simd
  for (int64_t d = 0; d < Dp; ++d) acc[d] *= c;
  return true;
}

void prefill_tasks(const kvrelay::PrefillProblem& p, int64_t begin, int64_t end,
                   float* scratch) {
  const int64_t G = p.H / p.KVH, D = p.D, Dp = (D + 15) / 16 * 16;
  const int64_t R = G * kvrelay::kPrefillTile;
  float* qf = scratch;              // [R][Dp]
  float* acc = qf + R * Dp;         // [R][Dp]
  float* m = acc + R * Dp;          // [R]
  float* l = m + R;                 // [R]
  float* s = l + R;                 // [R][KB]
  const int64_t ldv = Dp;           // rows of p.vf
  for (int64_t it = begin; it < end; ++it) {
    const int64_t code = p.items[it];
    const int64_t seq = code >> 32, kh = (code >> 16) & 0xFFFF, tile = code & 0xFFFF;
    const int64_t base = p.cu[seq], len = p.cu[seq + 1] - base;
    const int64_t q0 = tile * kvrelay::kPrefillTile;
    const int64_t nq = len - q0 < kvrelay::kPrefillTile ? len - q0 : kvrelay::kPrefillTile;
    const int64_t rows = G * nq, rows4 = (rows + 3) / 4 * 4;
    // row r = g · nq + i: query head kh · G + g at position q0 + i
    for (int64_t r = 0; r < rows4; ++r) {
      float* qr = qf + r * Dp;
      const int64_t g = r / nq, i = r % nq;
      if (r < rows)
        row_to_f32(p.format, p.q, (base + q0 + i) * p.q_stride + (kh * G + g) * D, D, p.scale,
                   qr);
      for (int64_t d = r < rows ? D : 0; d < Dp; ++d) qr[d] = 0.f;
      for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] = 0.f;
      m[r] = -__builtin_inff();
      l[r] = 0.f;
    }
    const int64_t k_hi = q0 + nq;
    const int64_t k_lo = p.window > 0 && q0 - p.window + 1 > 0 ? q0 - p.window + 1 : 0;
    for (int64_t kb0 = k_lo; kb0 < k_hi; kb0 += KB) {
      const int64_t n = k_hi - kb0 < KB ? k_hi - kb0 : KB;
      const float* kt = p.kt + kh * D * p.ld_kt + base + kb0;  // keys past n: masked below
      const float* vb = p.vf + (kh * p.tokens + base + kb0) * Dp;
      for (int64_t r0 = 0; r0 < rows4; r0 += 4)
        scores4(qf + r0 * Dp, Dp, D, kt, p.ld_kt, n, s + r0 * KB);
      for (int64_t r = 0; r < rows4; ++r) {
        if (r >= rows) {                                  // padding rows: no weight
          for (int64_t j = 0; j < n; ++j) s[r * KB + j] = 0.f;
          continue;
        }
        softmax_row(s + r * KB, kb0, n, q0 + r % nq, p.window, m + r, l + r, acc + r * Dp, Dp);
      }
      for (int64_t r0 = 0; r0 < rows4; r0 += 4)
        values4_all(s + r0 * KB, vb, n, ldv, Dp, acc + r0 * Dp);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t g = r / nq, i = r % nq;
      const float sink = p.sinks[kh * G + g];
      const float mx = m[r] > sink ? m[r] : sink;
      const float c = exp_neg(m[r] - mx);
      const float f = c / (l[r] * c + exp_neg(sink - mx));
      row_from_f32(p.format, acc + r * Dp, f, D, p.out, ((base + q0 + i) * p.H + kh * G + g) * D);
    }
  }
}
