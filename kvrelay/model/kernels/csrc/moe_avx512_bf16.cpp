// AVX512-BF16 build of the MoE and paged decode kernels (Cooper Lake, Sapphire Rapids,
// Zen 4 and later); chosen at run time (moe_op.cpp). It is the "avx512" build plus one
// route for MXFP4 weights: where a block of token rows is exactly bf16 (a bf16 model's
// hidden states entering gate_up), the 4-bit codes are decoded to bf16 with byte shuffles
// and multiplied by `vdpbf16ps`, 32 weights per instruction, instead of being widened to
// fp32 lanes (moe_avx512_v.h: a widening, two lookups and two fp32 FMAs per 16 weights).
//
// Exactness: an e2m1 value times a bf16 x is exact in fp32 (2 x 8 significant bits), the
// group's power-of-two scale is applied to each group's fp32 partial sum, so only the fp32
// summation order differs from the fp32 route. vdpbf16ps treats denormal inputs and
// results as zero, so the route is taken only when every x is 0 or at least 2^-100 in
// magnitude: products and their sums are then multiples of 2^-108, never denormal. Any
// other x (a float32 model's activations, the fp32 swiglu output entering down) takes the
// fp32 route of moe_impl.h, as in the "avx512" build.
#include "moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <string.h>
#include "isa.h"
KVRELAY_TARGET(KVRELAY_ISA_AVX512_BF16)
#if !defined(__clang__)
#pragma GCC target("prefer-vector-width=256")
#endif

namespace {

#include "moe_avx512_v.h"

// Four MXFP4 groups (64 code bytes, 128 weights) side by side: 128-bit lane L of every
// vector below belongs to group L. The codes' low and high nibbles index two 16-byte tables
// (vpshufb, per lane) holding the low and the high byte of each e2m1 value in bf16; the
// bytes are interleaved into bf16 words:
//   w[0]: the low nibbles of code bytes 0-7 of each group (columns 0, 2, ..., 14)
//   w[1]: low nibbles of bytes 8-15 (columns 16, ..., 30)
//   w[2], w[3]: the high nibbles of the same bytes (columns 1, ..., 15 and 17, ..., 31)
// In the stored column order of moe.h (even columns first) w[k] holds stored positions
// 8k .. 8k + 7 of each group, in order.
constexpr int64_t kBlockGroups = 4;
// A block of R rows is one contiguous range of codes (and of scales, 1/16 the bytes), read
// as R streams side by side; the prefetches walk the range once, in order, kFp4SeqAhead
// bytes ahead of the block's start (slot b·R + i: 64 bytes each, R·ceil(groups/4) slots
// cover the R·groups·16 bytes), so memory sees one sequential stream (moe.h). Measured
// (20b rows, gate_up, one thread, DRAM): each row prefetching 8 KiB past itself 25-28
// GB/s, this 30-32 (2 threads: 40 -> 56 in a copy of the loop).
constexpr int64_t kBlockWords = kBlockGroups * 32;

struct Fp4Bf16 {
  __m512i low_bytes, high_bytes, nibble;

  Fp4Bf16()
      : low_bytes(_mm512_broadcast_i32x4(_mm_setr_epi8(
            0, 0, char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0),      // 0 .. 6
            0, 0, char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0)))),    // -0 .. -6
        high_bytes(_mm512_broadcast_i32x4(_mm_setr_epi8(
            0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF), char(0xBF),
            char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0)))),
        nibble(_mm512_set1_epi8(0x0F)) {}

  inline void decode(__m512i codes, __m512i (&w)[4]) const {
    const __m512i lo = _mm512_and_si512(codes, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
    const __m512i lo_l = _mm512_shuffle_epi8(low_bytes, lo);
    const __m512i lo_h = _mm512_shuffle_epi8(high_bytes, lo);
    const __m512i hi_l = _mm512_shuffle_epi8(low_bytes, hi);
    const __m512i hi_h = _mm512_shuffle_epi8(high_bytes, hi);
    w[0] = _mm512_unpacklo_epi8(lo_l, lo_h);
    w[1] = _mm512_unpackhi_epi8(lo_l, lo_h);
    w[2] = _mm512_unpacklo_epi8(hi_l, hi_h);
    w[3] = _mm512_unpackhi_epi8(hi_l, hi_h);
  }
};

// The scales of 16 groups (4 blocks; `count` < 16: the row's last ones, the rest read as
// s = 0) as fp32 2^(s - 127), one group per dword: the E8M0 byte shifted to the exponent
// field; s = 0 (2^-127, a denormal) is 0x00400000, the largest value below every other
// scale's bits, hence the max. A block's vector is then one permute (block_scales) instead
// of a broadcast, a shuffle and two ALU ops per block and row.
inline __m512 chunk_scales(const uint8_t* s, int64_t count) {
  const __m128i bytes = count >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(s))
                                    : _mm_maskz_loadu_epi8((__mmask16(1) << count) - 1, s);
  return _mm512_castsi512_ps(_mm512_max_epu32(
      _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23), _mm512_set1_epi32(0x00400000)));
}

// Block j (0-3) of a chunk: group 4j + L's scale in every dword of 128-bit lane L.
inline __m512 block_scales(__m512 chunk, int64_t j) {
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(int(4 * j))), chunk);
}

// x rows as the kernels read them: per block of 4 groups, w[k]'s order (above), a row
// padded with zeros to whole blocks. False where a value is not exactly bf16 or is a
// nonzero below 2^-100 (see the top of the file): the block then takes the fp32 route.
constexpr uint32_t kSmallestX = uint32_t(27) << 23;   // 2^-100

inline bool pack_bf16(const float* x, int64_t ldx, int64_t nt, int64_t NT, int64_t groups,
                      uint16_t* out, int64_t ldo) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const __m512i below = _mm512_set1_epi32(int(kSmallestX - 1));
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  const int64_t whole = (groups / kBlockGroups) * kBlockWords;
  for (int64_t t = 0; t < NT; ++t) {
    uint16_t* row = out + t * ldo;
    if (t >= nt) {
      memset(row, 0, sizeof(uint16_t) * ldo);
      continue;
    }
    memset(row + whole, 0, sizeof(uint16_t) * (ldo - whole));
    for (int64_t g = 0; g < groups; ++g) {
      uint16_t* block = row + (g / kBlockGroups) * kBlockWords + (g % kBlockGroups) * 8;
      const __m512 v0 = _mm512_loadu_ps(x + t * ldx + g * 32);
      const __m512 v1 = _mm512_loadu_ps(x + t * ldx + g * 32 + 16);
      const __m512i u0 = _mm512_castps_si512(v0), u1 = _mm512_castps_si512(v1);
      // an fp32 swiglu output fails here, in its first group
      const __m512i a0 = _mm512_sub_epi32(_mm512_and_si512(u0, magnitude), one);
      const __m512i a1 = _mm512_sub_epi32(_mm512_and_si512(u1, magnitude), one);
      if (_mm512_test_epi32_mask(_mm512_or_si512(u0, u1), low16) |
          _mm512_cmplt_epu32_mask(a0, below) | _mm512_cmplt_epu32_mask(a1, below))
        return false;
      const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(v0), h1 = (__m256i)_mm512_cvtneps_pbh(v1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block), _mm256_castsi256_si128(h0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 32), _mm256_extracti128_si256(h0, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 64), _mm256_castsi256_si128(h1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 96), _mm256_extracti128_si256(h1, 1));
    }
  }
  return true;
}

// One block of 4 groups (`left` < 4: the row's last, partial one; the missing groups
// decode to 0 · 0) of rows [0, R) against NT packed token rows: per row and token one fp32
// partial sum per group (a lane of d), scaled and added to the accumulator.
template <int NT, int R, bool kTail>
inline void bf16_block(const Fp4Bf16& dec, const uint8_t* codes, const uint8_t* scales,
                       int64_t groups, int64_t b, int64_t left, const uint16_t* xb,
                       int64_t ldx, const __m512 (&chunk)[R], __m512 (&acc)[R][NT]) {
  const int64_t g = b * kBlockGroups;
  __builtin_prefetch(scales + kvrelay::kFp4SeqAhead / 16 + b * R * 4);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const uint8_t* row = codes + (i * groups + g) * 16;
    __m512i packed;
    __builtin_prefetch(codes + kvrelay::kFp4SeqAhead + (b * R + i) * 64);
    if (!kTail) {
      packed = _mm512_loadu_si512(row);
    } else {
      packed = _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * left)) - 1, row);
    }
    __m512i w[4];
    dec.decode(packed, w);
    const __m512 scale = block_scales(chunk[i], b % 4);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const uint16_t* xp = xb + t * ldx + b * kBlockWords;
      // one chain: R·NT of them interleave (measured 2-6 % faster than two and an add)
      __m512 d = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k)
        d = _mm512_dpbf16_ps(d, (__m512bh)w[k], (__m512bh)_mm512_loadu_si512(xp + 32 * k));
      acc[i][t] = _mm512_fmadd_ps(d, scale, acc[i][t]);
    }
  }
}

// Rows [0, R) (codes/scales of the first) against NT packed token rows; writes
// out[i·ldo + t]. A row's operations and their order do not depend on R or on the thread
// that runs it.
template <int NT, int R>
inline void bf16_rows(const Fp4Bf16& dec, const uint8_t* codes, const uint8_t* scales,
                      int64_t groups, const uint16_t* xb, int64_t ldx, float* out,
                      int64_t ldo) {
  __m512 acc[R][NT];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const int64_t full = groups / kBlockGroups, left = groups % kBlockGroups;
  __m512 chunk[R];   // the scales of the 4 blocks from 4·(b / 4) on, per row
  for (int64_t b = 0; b < full; ++b) {
    if (b % 4 == 0)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        chunk[i] = chunk_scales(scales + i * groups + 4 * b, groups - 4 * b);
    bf16_block<NT, R, false>(dec, codes, scales, groups, b, 0, xb, ldx, chunk, acc);
  }
  if (left) {
    if (full % 4 == 0)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) chunk[i] = chunk_scales(scales + i * groups + 4 * full, left);
    bf16_block<NT, R, true>(dec, codes, scales, groups, full, left, xb, ldx, chunk, acc);
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) out[i * ldo + t] = _mm512_reduce_add_ps(acc[i][t]);
}

template <int NT>
inline void bf16_tile(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                      const uint16_t* xb, int64_t ldx, float* out, int64_t ldo) {
  constexpr int R = NT <= 4 ? 4 : 2;   // R·NT accumulators + 4 decoded vectors in registers
  const Fp4Bf16 dec;
  const int64_t groups = w.cols / 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data);
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    const int64_t index = e * w.rows + r;
    bf16_rows<NT, R>(dec, codes + index * groups * 16, w.scales + index * groups, groups, xb,
                     ldx, out + (r - r0) * ldo, ldo);
  }
  for (; r < r1; ++r) {
    const int64_t index = e * w.rows + r;
    bf16_rows<NT, 1>(dec, codes + index * groups * 16, w.scales + index * groups, groups, xb,
                     ldx, out + (r - r0) * ldo, ldo);
  }
}

// Each thread keeps the last token block it packed: the tiles of one expert's rows share
// it (a 20b layer's gate_up at 1 token: 180 tiles per expert, a pack each otherwise). A
// pack stays valid within one sweep over gate_up: `inputs_changed` (down_tiles, after
// every gate_up sweep) bumps the epoch, so no later call with the same buffer address
// reads it. NB rows of up to kMaxPackedCols columns (wider layers take the fp32 route).
constexpr int64_t kMaxPackedCols = 8192;
uint64_t packed_epoch = 0;

struct Packed {
  const void* weights = nullptr;   // gate_up's x or down's act: never one for the other
  const float* x = nullptr;
  int64_t nt = 0, cols = 0;
  uint64_t epoch = 0;
  bool exact = false;
};
thread_local Packed packed_key;
alignas(64) thread_local uint16_t packed_x[8 * kMaxPackedCols];

struct V : V512 {
  static bool mxfp4_bf16(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                         const float* x, int64_t nt, float* out, int64_t ldo);
  static void inputs_changed() { __atomic_fetch_add(&packed_epoch, 1, __ATOMIC_RELAXED); }
};
static_assert(V::NB <= 8, "packed_x holds 8 token rows");

#include "moe_impl.h"

bool V::mxfp4_bf16(const kvrelay::Projection& w, int64_t e, int64_t r0, int64_t r1,
                   const float* x, int64_t nt, float* out, int64_t ldo) {
  const int64_t groups = w.cols / 32;
  const int64_t ld = (groups + kBlockGroups - 1) / kBlockGroups * kBlockWords;
  if (ld > kMaxPackedCols) return false;
  const int64_t NT = nt <= 4 ? nt : 8;
  Packed& key = packed_key;
  const uint64_t epoch = __atomic_load_n(&packed_epoch, __ATOMIC_RELAXED);
  if (key.weights != w.data || key.x != x || key.nt != nt || key.cols != w.cols ||
      key.epoch != epoch) {
    key = Packed{w.data, x, nt, w.cols, epoch,
                 pack_bf16(x, w.cols, nt, NT, groups, packed_x, ld)};
  }
  if (!key.exact) return false;
  const uint16_t* xb = packed_x;
  if (NT == 1) bf16_tile<1>(w, e, r0, r1, xb, ld, out, ldo);
  else if (NT == 2) bf16_tile<2>(w, e, r0, r1, xb, ld, out, ldo);
  else if (NT == 3) bf16_tile<3>(w, e, r0, r1, xb, ld, out, ldo);
  else if (NT == 4) bf16_tile<4>(w, e, r0, r1, xb, ld, out, ldo);
  else bf16_tile<8>(w, e, r0, r1, xb, ld, out, ldo);
  return true;
}

#include "paged_decode_impl.h"

}  // namespace

bool kvrelay::avx512_bf16_kernels(IsaKernels* out) {
  *out = IsaKernels{"avx512_bf16", &gate_up_tiles, &down_tiles, &decode_tasks};
  return true;
}

#else
bool kvrelay::avx512_bf16_kernels(IsaKernels*) { return false; }
#endif
