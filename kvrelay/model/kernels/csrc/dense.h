// Plain-C++ contract between the torch-facing dense ops (dense_op.cpp) and their per-ISA
// builds (dense_generic.cpp, dense_avx2.cpp, dense_avx512.cpp, dense_avx512_bf16.cpp).
// No torch or STL here, for the same reason as moe.h: the ISA files are compiled with
// `#pragma GCC target(...)`.
//
// The skinny matmul of decode steps: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), M small
// (one row per sequence), W read once per call, fp32 accumulation. Work is split over
// output columns n (weight rows); every (m, n) is one dot product whose summation order
// depends only on K, so results do not depend on the thread count or the split.
#pragma once
#include <stdint.h>

namespace kvrelay {

enum DenseFormat : int32_t { kDenseF32 = 0, kDenseBF16 = 1 };

struct DenseProblem {
  const float* x;         // [M, K] fp32 (the FMA kernels)
  const uint16_t* x_bf16; // [M, K] bf16 (the AVX512-BF16 kernel; null otherwise)
  const void* w;          // [N, K] in w_format, contiguous
  int32_t w_format;
  const float* bias;      // [N] or null
  void* y;                // [M, N] in y_format, contiguous
  int32_t y_format;
  int64_t M, N, K;
};

// Fills y[:, n0:n1] (n0 a multiple of 8).
using DenseFn = void (*)(const DenseProblem&, int64_t n0, int64_t n1);

// The ordered product (`dense_ordered_linear`, layers/ordered.py): y[M, N] = x[M, K] · Wᵀ (+ b)
// in fp32 where k runs in blocks of kc, each block one chain of fused multiply-adds in k order
// from 0, chain(m, n, k0, k1) = fma(x[m, k1-1], w[n, k1-1], ... fma(x[m, k0], w[n, k0], 0)),
// and the blocks are added in order: y = ((b + chain_0) + chain_1) + ..., or without a bias
// (chain_0 + chain_1) + ... — what a blocked GEMM computes. The weights come packed by
// kOrderedLanes output rows, k-major: w[block][k][lane] = W[block · 16 + lane, k] (rows past
// N zero), so one k step of a block is one contiguous load; the bias padded alike.
constexpr int64_t kOrderedLanes = 16;

struct OrderedProblem {
  const float* x;         // [M, K] fp32
  const void* w;          // [ceil(N / 16), K, 16] in w_format
  int32_t w_format;
  float* y;               // [M, N] fp32, contiguous
  int64_t M, N, K;
  int32_t round_bf16;     // each y rounded to bf16 (nearest even) and widened back
  const float* bias;      // [ceil(N / 16) · 16] fp32, or null
  int64_t kc;             // k block (K: one chain)
};

// Fills y[:, b0 · 16 : min(N, b1 · 16)] (weight blocks [b0, b1)).
using OrderedFn = void (*)(const OrderedProblem&, int64_t b0, int64_t b1);

// The greedy form (`dense_ordered_argmax`): no y; for each row, over the outputs of blocks
// [b0, b1) (rounded where round_bf16), what argmax_rows needs to answer for the whole row:
// the largest non-NaN value and its first index (-1: every value -inf), and the first NaN's
// index (-1: none). The caller's scratch: best, scratch [M, 16] floats, at [M, 16].
struct OrderedArgmax {
  float* value;     // [M]
  int64_t* index;   // [M]
  int64_t* nan;     // [M]
  float* scratch;   // a block's outputs, row by row
  float* best;      // per row and lane: the best value so far
  int32_t* at;      // its block (-1: none yet)
};
using OrderedArgmaxFn = void (*)(const OrderedProblem&, int64_t b0, int64_t b1,
                                 const OrderedArgmax&);

struct DenseKernels {
  const char* name;
  DenseFn fma;       // x in fp32, W in fp32 or bf16 (widened in registers)
  DenseFn bf16_dot;  // x and W in bf16, pairs multiplied natively; null where the ISA lacks it
  OrderedFn ordered; // the ordered product (x fp32, packed W fp32 or bf16)
  OrderedArgmaxFn ordered_argmax;  // its greedy form
};

// The kernels dense_op.cpp's ops run for `isa` ("": the best this CPU runs), for other ops
// that must compute exactly as they do (screen_op.cpp); an error where the CPU lacks it.
const DenseKernels& dense_kernels(const char* isa);

bool dense_generic(DenseKernels* out);
bool dense_avx2(DenseKernels* out);       // false where not compiled (non-x86)
bool dense_avx512(DenseKernels* out);
bool dense_avx512_bf16(DenseKernels* out);  // sets bf16_dot only

}  // namespace kvrelay
