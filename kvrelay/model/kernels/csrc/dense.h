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

struct DenseKernels {
  const char* name;
  DenseFn fma;       // x in fp32, W in fp32 or bf16 (widened in registers)
  DenseFn bf16_dot;  // x and W in bf16, pairs multiplied natively; null where the ISA lacks it
};

bool dense_generic(DenseKernels* out);
bool dense_avx2(DenseKernels* out);       // false where not compiled (non-x86)
bool dense_avx512(DenseKernels* out);
bool dense_avx512_bf16(DenseKernels* out);  // sets bf16_dot only

}  // namespace kvrelay
