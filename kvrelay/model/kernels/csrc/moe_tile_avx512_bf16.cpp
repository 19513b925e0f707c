// AVX512-BF16 build of the multi-row MoE expert tiles (moe_tile.h): per weight row, a
// broadcast bf16 pair (w[n][2j], w[n][2j+1]) against 16 token rows' pairs in one
// vdpbf16ps — exact bf16 products summed in fp32, only the summation order differs from a
// float32 dot product (and denormal inputs read as zero, as the instruction does).
// Register tile: R weight rows × MV vectors of 16 token rows (R · MV = 16 accumulators).
#include "moe_tile.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512_BF16)

namespace {

#include "simd_avx512.h"   // f32_to_bf16, bf16_to_f32, exp_neg

// The e2m1 values of an MXFP4 code nibble (moe_impl.h's table, undoubled).
constexpr float kFp4[16] = {0.0f, 0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Weight rows [r0, r1) of expert e as bf16 [r1 - r0, cols] in `out`: each value is
// e2m1 · 2^(s - 127), exact in fp32 and (for the exponents checkpoints hold) in bf16 —
// the values `mxfp4.dequantize(..., bfloat16)` gives.
void decode_rows(const kvrelay::TileWeights& w, const float* scale_table, int64_t e,
                 int64_t r0, int64_t r1, uint16_t* out) {
  const int64_t groups = w.cols / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* codes = w.codes + (e * w.rows + r) * groups * 16;
    const uint8_t* scales = w.scales + (e * w.rows + r) * groups;
    uint16_t* o = out + (r - r0) * w.cols;
    const __m512 values = _mm512_loadu_ps(kFp4);
    for (int64_t g = 0; g < groups; ++g) {
      // the group's 16 scaled values as bf16 (lanes 0-15), looked up per nibble: byte b
      // of the group becomes the 32-bit lane (b & 15) | (b >> 4) << 16, i.e. the 16-bit
      // indices of columns 2b and 2b + 1
      const __m256bh scaled = _mm512_cvtneps_pbh(
          _mm512_mul_ps(values, _mm512_set1_ps(scale_table[scales[g]])));
      const __m512i table = _mm512_castsi256_si512((__m256i)scaled);
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16)));
      const __m512i index = _mm512_or_si512(
          _mm512_and_si512(bytes, _mm512_set1_epi32(15)),
          _mm512_and_si512(_mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0xF0000)));
      _mm512_storeu_si512(o + g * 32, _mm512_permutexvar_epi16(index, table));
    }
  }
}

// out[r][t] = Σ_k w[r][k] · x[m0 + t][k] for R weight rows (row stride ldw) and 16·MV
// token rows of a pair-packed block (Mp rows, K columns) given as `planes` bf16 parts
// `plane` elements apart (x = their sum), summed into the same accumulators.
template <int R, int MV>
inline void dots(const uint16_t* x, int planes, int64_t plane, int64_t Mp, int64_t K,
                 int64_t m0, const uint16_t* w, int64_t ldw, float (*out)[64]) {
  __m512 acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int q = 0; q < planes; ++q) {
    const uint16_t* xp = x + q * plane + m0 * 2;
    for (int64_t j = 0; j < K / 2; ++j) {
      __m512bh a[MV];
      for (int v = 0; v < MV; ++v)
        a[v] = (__m512bh)_mm512_loadu_si512(xp + (j * Mp + 16 * v) * 2);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        __builtin_memcpy(&pair, w + r * ldw + 2 * j, 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a[v], b);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
}

// Rows [0, rows) of `w` against token rows [m0, m0 + 16·MV): R rows at a time, the
// remainder `step` rows at a time (gate_up keeps (gate, up) pairs together: step 2).
template <int MV, int R, class Epilogue>
inline void row_blocks(const uint16_t* x, int planes, int64_t plane, int64_t Mp, int64_t K,
                       int64_t m0, const uint16_t* w, int64_t rows, int step,
                       const Epilogue& epilogue) {
  alignas(64) float out[16][64];
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    dots<R, MV>(x, planes, plane, Mp, K, m0, w + r * K, K, out);
    epilogue(r, R, out);
  }
  for (; r < rows; r += step) {
    if (step == 2) dots<2, MV>(x, planes, plane, Mp, K, m0, w + r * K, K, out);
    else dots<1, MV>(x, planes, plane, Mp, K, m0, w + r * K, K, out);
    epilogue(r, step, out);
  }
}

// Token rows [tok0, tok1) (both multiples of 16) in blocks of 32 (two vectors: 8 weight
// rows a tile) and a last block of 16 (one vector: 16 weight rows).
template <class Epilogue>
inline void tokens(const uint16_t* x, int planes, int64_t plane, int64_t Mp, int64_t K,
                   int64_t tok0, int64_t tok1, const uint16_t* w, int64_t rows, int step,
                   const Epilogue& epilogue) {
  int64_t m = tok0;
  for (; m + 32 <= tok1; m += 32)
    row_blocks<2, 8>(x, planes, plane, Mp, K, m, w, rows, step,
                     [&](int64_t r, int n, float (*out)[64]) { epilogue(m, 32, r, n, out); });
  if (m < tok1)
    row_blocks<1, 16>(x, planes, plane, Mp, K, m, w, rows, step,
                      [&](int64_t r, int n, float (*out)[64]) { epilogue(m, 16, r, n, out); });
}

// This item's weight rows as bf16: in place, or decoded from MXFP4 into `buf`.
const uint16_t* item_rows(const kvrelay::TileWeights& w, const float* scale_table,
                          const kvrelay::TileItem& it, uint16_t* buf) {
  if (w.bf16) return w.bf16 + (int64_t(it.expert) * w.rows + it.row0) * w.cols;
  decode_rows(w, scale_table, it.expert, it.row0, it.row1, buf);
  return buf;
}

constexpr int64_t kMaxItemRows = 64;

thread_local uint16_t* t_rows = nullptr;        // MXFP4 rows decoded for one item
thread_local int64_t t_rows_size = 0;

uint16_t* row_buffer(int64_t elems) {
  if (elems > t_rows_size) {
    delete[] t_rows;
    t_rows = new uint16_t[elems];
    t_rows_size = elems;
  }
  return t_rows;
}

void gate_up_items(const kvrelay::TileProblem& p, const kvrelay::TileItem* items,
                   int64_t count) {
  const int64_t H = p.gate_up.cols, I = p.down.cols;
  uint16_t* buf = p.gate_up.bf16 ? nullptr : row_buffer(kMaxItemRows * H);
  for (int64_t i = 0; i < count; ++i) {
    const kvrelay::TileItem it = items[i];
    const int64_t e = it.expert, Mp = p.padded[e + 1] - p.padded[e];
    const uint16_t* x = p.x + p.padded[e] * H;
    uint16_t* act = p.act + p.padded[e] * I;
    const float* bias = p.gate_up.bias ? p.gate_up.bias + e * p.gate_up.rows : nullptr;
    const uint16_t* w = item_rows(p.gate_up, p.scale_table, it, buf);
    const float limit = p.limit, alpha = p.alpha;
    const int64_t plane = p.act_plane;
    tokens(x, 1, 0, Mp, H, it.tok0, it.tok1, w, it.row1 - it.row0, 2,
           [&](int64_t m0, int nt, int64_t r, int n, float (*out)[64]) {
      for (int q = 0; q < n; q += 2) {
        const int64_t row = it.row0 + r + q;         // even: the gate row, row + 1 its up
        const float bg = bias ? bias[row] : 0.0f, bu = bias ? bias[row + 1] : 0.0f;
        const int64_t k = row / 2;                   // the activation column
        uint16_t* dst = act + ((k / 2) * Mp + m0) * 2 + (k & 1);
#pragma omp simd
        for (int t = 0; t < nt; ++t) {
          float gate = out[q][t] + bg, up = out[q + 1][t] + bu;
          gate = gate > limit ? limit : gate;
          up = up > limit ? limit : (up < -limit ? -limit : up);
          const float z = gate * alpha;
          const float ez = exp_neg(z > 0.0f ? -z : z);          // e^-|z|
          const float sig = z > 0.0f ? 1.0f / (1.0f + ez) : ez / (1.0f + ez);
          // three bf16 parts summing to the f32 value exactly: each remainder is exact
          // in f32 and has at most 8 significant bits left for the next part
          const float a = (up + 1.0f) * gate * sig;
          const uint16_t hi = f32_to_bf16(a);
          const float r1 = a - bf16_to_f32(hi);
          const uint16_t mid = f32_to_bf16(r1);
          dst[t * 2] = hi;
          dst[plane + t * 2] = mid;
          dst[2 * plane + t * 2] = f32_to_bf16(r1 - bf16_to_f32(mid));
        }
      }
    });
  }
}

void down_items(const kvrelay::TileProblem& p, const kvrelay::TileItem* items, int64_t count) {
  const int64_t H = p.down.rows, I = p.down.cols;
  uint16_t* buf = p.down.bf16 ? nullptr : row_buffer(kMaxItemRows * I);
  for (int64_t i = 0; i < count; ++i) {
    const kvrelay::TileItem it = items[i];
    const int64_t e = it.expert, Mp = p.padded[e + 1] - p.padded[e];
    const int64_t first = p.offsets[e], rows_e = p.offsets[e + 1] - first;
    const uint16_t* act = p.act + p.padded[e] * I;
    const float* bias = p.down.bias ? p.down.bias + e * H : nullptr;
    const uint16_t* w = item_rows(p.down, p.scale_table, it, buf);
    tokens(act, 3, p.act_plane, Mp, I, it.tok0, it.tok1, w, it.row1 - it.row0, 1,
           [&](int64_t m0, int nt, int64_t r, int n, float (*out)[64]) {
      const int64_t tn = rows_e - m0 < nt ? rows_e - m0 : nt;    // real token rows
      for (int64_t t = 0; t < tn; ++t) {
        float* y = p.y + (first + m0 + t) * H + it.row0 + r;
        const float weight = p.route_weight[first + m0 + t];
        for (int q = 0; q < n; ++q) {
          const float b = bias ? bias[it.row0 + r + q] : 0.0f;
          y[q] = (out[q][t] + b) * weight;
        }
      }
    });
  }
}

}  // namespace

namespace kvrelay {
bool tile_avx512_bf16(TileKernels* out) {
  *out = TileKernels{"avx512_bf16", gate_up_items, down_items};
  return true;
}
}  // namespace kvrelay

#else

namespace kvrelay {
bool tile_avx512_bf16(TileKernels*) { return false; }
}  // namespace kvrelay

#endif
