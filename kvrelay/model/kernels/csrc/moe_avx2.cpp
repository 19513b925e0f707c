// AVX2 + FMA build of the MoE and paged decode kernels; chosen at run time (moe_op.cpp),
// so the rest of the extension stays runnable on CPUs without AVX2.
//
// MXFP4 weights take this build's own route (V::mxfp4_bf16, below the include of
// moe_impl.h): two groups of codes at a time are looked up as the bf16 words of their
// doubled e2m1 values (two byte tables, vpshufb), widened to fp32 by a shift or a mask,
// and multiplied with the token rows, packed once per expert in the lane order this
// leaves; each pair's partial sums are scaled as they are added up. The byte shuffles
// and shifts are what bound it on Zen 3 (two pipes, one shared with the FMAs): 13 per
// two groups against moe_impl.h's 18 (fp4x2: lookups, byte shifts, sign extensions) and
// its 8 multiplies by the scales. Measured (20b rows, one thread, Zen 3, core cycles per
// group and weight row, L2-resident): 9.6 -> 5.5 at 1 token row; 14 -> 8.1 at 2; 20 -> 17.5
// at 4. A 20b layer's 4 experts from DRAM at 1 token: 5.4 -> 8.4 GB/s on one thread.
#include "moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX2)

namespace {

#include "simd_avx2.h"

struct V {
  static constexpr int W = 8, NB = 4, kChains = 8, kChainsFp4 = 4;
  // MXFP4 weight rows per x load (moe_impl.h). Two rows need ~17 of the 16 ymm registers
  // at 2-4 token rows (a spill or two), yet measured (gpt-oss-20b layer, 4 experts, forced
  // AVX2 on Zen 4, one thread, CPU ms) 2/4/8 tokens per expert 8.0/14.7/27.5 with one row
  // against 7.7/11.0/21.4 with two: FMA-bound, the x loads and loop overhead halve.
  static constexpr int kRowBlock = 2;
  static constexpr bool kScaledDecode = false;
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load_bf16(const uint16_t* p) { return load_bf16x8(p); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(T a) { return hsum8(a); }
  static void fp4x2(const uint8_t* codes, T* out) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(packed, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));   // even columns
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));   // odd columns
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
  static void fp4x2_scaled(const uint8_t* codes, float scale, T* out) {
    fp4x2(codes, out);
    const T s = set1(scale);
    for (int c = 0; c < 4; ++c) out[c] = mul(out[c], s);
  }
  // the MXFP4 route of this build (see the top of the file), defined below; moe_impl.h's
  // MXFP4 code (fp4x2, kRowBlock above) serves only layers wider than it packs
  static bool mxfp4_bf16(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                         const float* x, int64_t nt, float* out, int64_t ldo);
  static void inputs_changed();
};

#include "moe_impl.h"

// Two MXFP4 groups side by side (32 code bytes, 64 weights): 128-bit lane 0 of every
// vector below belongs to group g, lane 1 to group g + 1. The low and the high nibbles
// index two 16-byte tables (vpshufb, per lane) holding the low and the high byte of the
// bf16 word of each doubled e2m1 value; interleaved, the bytes are bf16 words (code bytes
// 0-7, then 8-15). Each dword holds two words, and a word is an fp32 value once in the
// dword's upper half: shifted there (even words) or masked (odd words). Per lane, with
// e_j / o_j the low / high nibble of code byte j (stored columns j and 16 + j, moe.h):
//   w[0] = e0 e2 e4 e6     w[1] = e1 e3 e5 e7     w[2] = e8 e10 e12 e14   w[3] = e9 ... e15
//   w[4 .. 7]: the same of o
// (pack_fp4_x puts x in this order.) The values are unscaled: a pair's partial sums are
// scaled (per lane: the group's 2^(s - 128)) as they are added to the accumulators.
struct Fp4Decode {
  __m256i low_bytes, high_bytes, nibble, upper;

  Fp4Decode()
      : low_bytes(_mm256_broadcastsi128_si256(_mm_setr_epi8(
            0, char(0x80), 0, 0x40, char(0x80), char(0xC0), 0, 0x40,            // 0 .. 12
            0, char(0x80), 0, 0x40, char(0x80), char(0xC0), 0, 0x40))),         // -0 .. -12
        high_bytes(_mm256_broadcastsi128_si256(_mm_setr_epi8(
            0, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, char(0x80), char(0xBF), char(0xC0),
            char(0xC0), char(0xC0), char(0xC0), char(0xC1), char(0xC1)))),
        nibble(_mm256_set1_epi8(0x0F)),
        upper(_mm256_set1_epi32(int(0xFFFF0000u))) {}

  // w[0 .. 3] of the low nibbles (half 0) or w[4 .. 7] of the high ones (half 1) of codes
  template <int kHalf>
  inline void decode(__m256i codes, __m256* w) const {
    const __m256i idx = _mm256_and_si256(kHalf ? _mm256_srli_epi16(codes, 4) : codes, nibble);
    const __m256i l = _mm256_shuffle_epi8(low_bytes, idx);
    const __m256i h = _mm256_shuffle_epi8(high_bytes, idx);
    const __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(a, upper));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    w[3] = _mm256_castsi256_ps(_mm256_and_si256(b, upper));
  }
};

// 2^(s - 128) for each E8M0 byte s, as fp32 bits (s < 2: denormals), loaded by the
// broadcasts of pair_scales
struct HalfScales {
  uint32_t bits[256];
  constexpr HalfScales() : bits{} {
    for (uint32_t s = 0; s < 256; ++s) bits[s] = s >= 2 ? (s - 1) << 23 : 0x00200000u << s;
  }
};
constexpr HalfScales kHalfScales;

// Lane 0: group g's scale, lane 1: group g + 1's (`s1`: g's again past the row's end).
inline __m256 pair_scales(uint32_t s0, uint32_t s1) {
  return _mm256_castsi256_ps(_mm256_blend_epi32(_mm256_set1_epi32(int(kHalfScales.bits[s0])),
                                                _mm256_set1_epi32(int(kHalfScales.bits[s1])),
                                                0xF0));
}

// Pair p (groups 2p, 2p + 1; `last`: only 2p, the row's odd last group) of one weight row
// against NT packed token rows (ldx floats apart): per token the products summed in C
// chains over the 8 vectors (C = 2 at one token row: 4 deep, the latency of one chain of 8
// is not covered there), their sum times the pair's scales added to acc[t].
template <int NT>
inline void fp4_pair(const Fp4Decode& dec, const uint8_t* codes, const uint8_t* scales,
                     int64_t p, bool last, const float* x, int64_t ldx, __m256 (&acc)[NT]) {
  constexpr int C = NT == 1 ? 2 : 1;
  const uint8_t* c = codes + p * 32;
  const __m256i bytes =
      last ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))
           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256 scale = pair_scales(scales[2 * p], scales[2 * p + !last]);
  const float* xp = x + p * 64;
  __m256 part[C][NT], w[4];
  dec.decode<0>(bytes, w);
  for (int t = 0; t < NT; ++t) {
    const float* xt = xp + t * ldx;
    part[0][t] = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
    if (C == 2) part[C - 1][t] = _mm256_mul_ps(w[1], _mm256_loadu_ps(xt + 8));
    else part[0][t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), part[0][t]);
    for (int k = 2; k < 4; ++k)
      part[k % C][t] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xt + 8 * k), part[k % C][t]);
  }
  dec.decode<1>(bytes, w);
  for (int t = 0; t < NT; ++t) {
    const float* xt = xp + t * ldx + 32;
    for (int k = 0; k < 4; ++k)
      part[k % C][t] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xt + 8 * k), part[k % C][t]);
    const __m256 sum = C == 2 ? _mm256_add_ps(part[0][t], part[C - 1][t]) : part[0][t];
    acc[t] = _mm256_fmadd_ps(sum, scale, acc[t]);
  }
}

// One weight row (`groups` groups of codes and scales) against NT packed token rows;
// writes out[t]. No software prefetches: the rows of a work item are read one after the
// other, a single sequential stream of codes (and one of scales) that the hardware
// prefetchers follow (measured, 20b layer from DRAM, Zen 3: prefetching 4-48 KiB ahead
// as moe_impl.h's blocks do was no faster on one thread and slower on two).
template <int NT>
inline void fp4_row_avx2(const Fp4Decode& dec, const uint8_t* codes, const uint8_t* scales,
                         int64_t groups, const float* x, int64_t ldx, float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t pairs = groups / 2;
  for (int64_t p = 0; p < pairs; ++p) fp4_pair<NT>(dec, codes, scales, p, false, x, ldx, acc);
  if (groups % 2) fp4_pair<NT>(dec, codes, scales, pairs, true, x, ldx, acc);
  for (int t = 0; t < NT; ++t) out[t] = hsum8(acc[t]);
}

// Rows [r0, r1) of expert e against NT packed token rows; row r writes out[(r - r0)·ldo :].
// One row at a time (measured against two rows sharing the x loads: the same speed).
template <int NT>
inline void fp4_tile_avx2(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                          const float* x, int64_t ldx, float* out, int64_t ldo) {
  const Fp4Decode dec;
  const int64_t groups = w.cols / 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t index = e * w.rows + r;
    fp4_row_avx2<NT>(dec, codes + index * groups * 16, w.scales + index * groups, groups, x,
                     ldx, out + (r - r0) * ldo);
  }
}

// Floats per packed token row: whole pairs of groups.
inline int64_t packed_cols(int64_t cols) { return (cols / 32 + 1) / 2 * 64; }

// nt token rows of x (moe.h's stored order, cols floats apart) as fp4_pair reads them:
// per pair of groups the 8 vectors of Fp4Decode, lane 0 from the first group, lane 1 from
// the second (zero past the row's last group); rows nt .. NT - 1 zero.
inline void pack_fp4_x(const float* x, int64_t nt, int64_t NT, int64_t cols, float* out) {
  const int64_t groups = cols / 32, ld = packed_cols(cols);
  // within 8 stored columns: the even ones, then the odd ones
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t t = 0; t < NT; ++t) {
    float* row = out + t * ld;
    for (int64_t p = 0; p < ld / 64; ++p) {
      __m256 halves[2][4];   // [group of the pair][stored columns 8k ..]: even | odd
      for (int i = 0; i < 2; ++i)
        for (int k = 0; k < 4; ++k) {
          const int64_t g = 2 * p + i;
          halves[i][k] = t < nt && g < groups
                             ? _mm256_permutevar8x32_ps(
                                   _mm256_loadu_ps(x + t * cols + g * 32 + 8 * k), split)
                             : _mm256_setzero_ps();
        }
      for (int k = 0; k < 4; ++k) {   // w[2k] and w[2k + 1]: the even and the odd columns
        _mm256_storeu_ps(row + p * 64 + 16 * k,
                         _mm256_permute2f128_ps(halves[0][k], halves[1][k], 0x20));
        _mm256_storeu_ps(row + p * 64 + 16 * k + 8,
                         _mm256_permute2f128_ps(halves[0][k], halves[1][k], 0x31));
      }
    }
  }
}

// Each thread keeps the last token block it packed, as the avx512_bf16 build does (see
// there): the tiles of one expert's rows share it; `inputs_changed` (each down sweep) bumps
// the epoch, so no later call with the same buffer address reads it. NB rows of up to
// kMaxPackedCols columns (wider layers take moe_impl.h's route).
constexpr int64_t kMaxPackedCols = 8192;
uint64_t packed_epoch = 0;

struct Packed {
  const void* weights = nullptr;   // gate_up's x or down's act: never one for the other
  const float* x = nullptr;
  int64_t nt = 0, cols = 0;
  uint64_t epoch = 0;
};
thread_local Packed packed_key;
alignas(64) thread_local float packed_x[V::NB * kMaxPackedCols];

void V::inputs_changed() { __atomic_fetch_add(&packed_epoch, 1, __ATOMIC_RELAXED); }

bool V::mxfp4_bf16(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                   const float* x, int64_t nt, float* out, int64_t ldo) {
  if (packed_cols(w.cols) > kMaxPackedCols || nt > V::NB) return false;
  const int64_t NT = nt == 3 ? 4 : nt, ld = packed_cols(w.cols);
  Packed& key = packed_key;
  const uint64_t epoch = __atomic_load_n(&packed_epoch, __ATOMIC_RELAXED);
  if (key.weights != w.data || key.x != x || key.nt != nt || key.cols != w.cols ||
      key.epoch != epoch) {
    pack_fp4_x(x, nt, NT, w.cols, packed_x);
    key = Packed{w.data, x, nt, w.cols, epoch};
  }
  if (NT == 1) fp4_tile_avx2<1>(w, e, r0, r1, packed_x, ld, out, ldo);
  else if (NT == 2) fp4_tile_avx2<2>(w, e, r0, r1, packed_x, ld, out, ldo);
  else fp4_tile_avx2<4>(w, e, r0, r1, packed_x, ld, out, ldo);
  return true;
}

#include "paged_decode_impl.h"

}  // namespace

bool kvrelay::avx2_kernels(IsaKernels* out) {
  *out = IsaKernels{"avx2", &gate_up_tiles, &down_tiles, &decode_tasks};
  return true;
}

#else
bool kvrelay::avx2_kernels(IsaKernels*) { return false; }
#endif
