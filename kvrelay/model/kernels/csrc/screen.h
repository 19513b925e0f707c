// Plain-C++ contract between the screened greedy LM head's torch ops (screen_op.cpp) and their
// per-ISA builds (screen_generic.cpp, screen_avx2.cpp, screen_avx512.cpp). No torch or STL
// here, for the same reason as dense.h.
//
// The screen (layers/screened.py): an int8 copy of the LM head and, per input row m and vocab
// row r, an approximate logit A[m, r] with a margin G[m, r] such that the exact path's logit
// L[m, r] (before its rounding to the output dtype) lies in [A - G, A + G]. Every row whose
// upper end can still reach the best lower end is a candidate; only candidates are computed
// exactly (screen_op.cpp). The bound, with e = w - s·q the weight's quantisation residual and
// f = x - t·p the input's, u = 2^-24:
//
//   A = I · (s · t),  I = Σ_k q[r, k] · p[m, k] exactly (int32; |I| < 2^31 by the choice of t)
//   |L - Σ w x| <= γ · ‖w‖‖x‖ + √K · 2^-126 · ‖w‖ + 2 (K + 16) · 2^-126   (any order, FMA or not,
//                                           flushed subnormals; γ = (K + 16) u / (1 - (K + 16) u))
//   Σ w x - s t I = Σ w f + Σ e x - Σ e f,  so |Σ w x - s t I| <= ‖w‖‖f‖ + ‖e‖ (‖x‖ + ‖f‖)
//   |A - s t I| <= 4 u |A| (three roundings)
//
//   G = (W · c1 + E · c2 + c4 + 16 u |A|) · (1 + 2^-15),  W >= ‖w_r‖, E >= ‖e_r‖ (stored rounded
//   up), c1 = ‖f‖ + γ‖x‖ + √K 2^-126, c2 = ‖x‖ + ‖f‖, c4 = 2 (K + 16) 2^-126 + 2^-100 (per input
//   row, rounded up; ScreenProblem holds them times 1 + 2^-15, rounded up): the factor and the
//   16 u |A| (4 u for A's own rounding) absorb the float rounding of G and of A ± G.
#pragma once
#include <stdint.h>

namespace kvrelay {

constexpr int64_t kScreenLanes = 16;     // vocab rows per block of the int8 copy
constexpr int64_t kScreenMaxRows = 16;   // input rows per call
// 16 u (1 + 2^-15), u = 2^-24: |A|'s coefficient in G (exact in fp32)
constexpr float kScreenRelative = 1.0f / 1048576.0f + 1.0f / 34359738368.0f;

// One call's screen over vocab blocks. The int8 copy is k-pair-major within a block:
// q[b][kp][lane][2] = Q[16 b + lane, 2 kp + {0, 1}] (rows past N and the odd K's pad zero), so
// one step of a block is 32 contiguous bytes; facts[b][3][16] bf16: the scale s (exact, the
// one the codes use), W and E rounded up.
struct ScreenProblem {
  const int8_t* q;
  const uint16_t* facts;
  const int32_t* x;        // [M][Kp / 2]: the input's int16 codes, (p[2kp], p[2kp+1]) as a pair
  const float* t;          // [M] the inputs' scales
  const float* c1;         // [M] the margin's coefficients (above), times 1 + 2^-15
  const float* c2;
  const float* c4;
  int64_t M, N, pairs;     // pairs = Kp / 2
  int32_t round_bf16;      // the exact path rounds its outputs to bf16 (candidates compare so)
  float* lo_out;           // [M, N] every row's A - G and A + G (tests), or null
  float* hi_out;
};

// One thread's running state, per input row: the best lower end so far, the threshold it
// implies (screen_threshold), and the rows whose upper end reached the threshold at their
// time (in index order within this thread's ranges; the threshold only rises, so a row left
// out then is out at the end).
struct ScreenState {
  float* lo_max;       // [M]
  float* threshold;    // [M]
  int32_t* count;      // [M]
  int32_t* overflow;   // [M] 1: more than `cap` rows stayed candidates
  int64_t* index;      // [M][cap]
  float* hi;           // [M][cap]
  int32_t cap;
};

// The least value whose rounding (bf16, nearest even, where round_bf16; else none) is at least
// the rounding of `lo`: a row can tie or beat the row of best lower end `lo` only if its upper
// end reaches it (rounding is monotone). Exact in fp32: the midpoint of two adjacent bf16.
inline float screen_threshold(float lo, int32_t round_bf16) {
  if (!round_bf16 || !(lo > -__builtin_inff()) || !(lo < __builtin_inff())) return lo;
  uint32_t u;
  __builtin_memcpy(&u, &lo, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;   // lo rounded
  float b;
  __builtin_memcpy(&b, &r, 4);
  // the bf16 just below b: one step toward -inf (below a zero: minus the least subnormal)
  const uint32_t down = b > 0.0f ? r - 0x10000u : b < 0.0f ? r + 0x10000u : 0x80010000u;
  float below;
  __builtin_memcpy(&below, &down, 4);
  return (below + b) * 0.5f;
}

using ScreenFn = void (*)(const ScreenProblem&, int64_t b0, int64_t b1, ScreenState&);

struct ScreenKernels {
  const char* name;
  ScreenFn screen;
};

bool screen_generic(ScreenKernels* out);
bool screen_avx2(ScreenKernels* out);       // false where not compiled (non-x86)
bool screen_avx512(ScreenKernels* out);

}  // namespace kvrelay
