// Argument checks shared by the torch-facing MoE ops (moe_op.cpp: `moe_experts`, the row
// kernels; moe_tile_op.cpp: `moe_tiles`, the bf16 tiles): expert weights in the layouts of
// moe.h, their optional biases, and the E8M0 scale tables. Torch headers: include only
// from the op files, never from an ISA build.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>

#include "moe.h"

namespace kvrelay {

// 2^(s - kBias) for every E8M0 byte s (kBias 127: the MXFP4 group scale; 128: halved, for
// kernels that decode e2m1 values doubled). s = 255 (NaN in E8M0) never occurs in
// checkpoints.
template <int kBias>
inline const float* e8m0_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int s = 0; s < 256; ++s) t[s] = std::ldexp(1.0f, s - kBias);
    return t;
  }();
  return table.data();
}

// A contiguous float32 [E, rows] tensor (a bias), or null where there is none.
inline const float* optional_f32(const c10::optional<at::Tensor>& t, int64_t E, int64_t rows,
                                 const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                  t->size(0) == E && t->size(1) == rows,
              what, ": expected a contiguous float32 [", E, ", ", rows, "] tensor");
  return t->data_ptr<float>();
}

// Weights [E, rows, cols] in f32/bf16, or MXFP4 codes [E, rows, cols/32, 16] + scales
// [E, rows, cols/32], with an optional f32 bias [E, rows].
inline Projection projection(const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                             const c10::optional<at::Tensor>& bias, const char* what) {
  Projection p{};
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), what,
              ": weights must be contiguous CPU tensors");
  if (w.scalar_type() == at::kByte) {
    TORCH_CHECK(w.dim() == 4 && w.size(3) == 16 && scales.has_value(), what,
                ": MXFP4 codes must be [E, rows, groups, 16] with scales");
    TORCH_CHECK(scales->scalar_type() == at::kByte && scales->is_contiguous() &&
                    scales->sizes() == w.sizes().slice(0, 3),
                what, ": MXFP4 scales must be contiguous uint8 [E, rows, groups]");
    p.format = kMXFP4;
    p.scales = scales->data_ptr<uint8_t>();
    p.cols = w.size(2) * 32;
  } else {
    TORCH_CHECK(w.dim() == 3 && !scales.has_value(), what,
                ": dense weights must be [E, rows, cols]");
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, what,
                ": dense weights must be float32 or bfloat16");
    p.format = w.scalar_type() == at::kFloat ? kF32 : kBF16;
    p.cols = w.size(2);
  }
  p.data = w.data_ptr();
  p.rows = w.size(1);
  p.bias = optional_f32(bias, w.size(0), p.rows, what);
  return p;
}

}  // namespace kvrelay
