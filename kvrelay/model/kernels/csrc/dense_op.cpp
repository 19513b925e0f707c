// torch ops of the decode-sized dense layers, in the best ISA build this CPU supports:
//
//   kvrelay_kernels::dense_linear(x [M, K], weight [N, K], bias [N]?) -> y [M, N]
//       F.linear for a few rows (decode): the weights are streamed once, each thread
//       taking blocks of output columns; fp32 accumulation; y in x's dtype.
//   kvrelay_kernels::rms_norm(x [M, H], weight [H] f32, eps) -> y [M, H]
//   kvrelay_kernels::add_rms_norm(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))
//       the residual add and the next norm in one pass over the row.
//
// Both compute exactly what the PyTorch reference paths (layers/linear.py, layers/norm.py)
// compute, up to fp32 summation order: inputs are widened to fp32, results rounded to the
// activation dtype once (round to nearest even).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "dense.h"
#include "isa_dispatch.h"
#include "parallel.h"

namespace kvrelay {
namespace {

// "avx512_bf16": the "avx512" kernels with the bf16 pair products (dense_avx512_bf16.cpp)
bool dense_bf16_pairs(DenseKernels* out) { return dense_avx512(out) && dense_avx512_bf16(out); }

const Variants<DenseKernels>& dense_isas() {  // best first
  static const Variants<DenseKernels> all = [] {
    Variants<DenseKernels> v("kvrelay dense kernels");
    v.add(Isa::kAvx512Bf16, &dense_bf16_pairs)
        .add(Isa::kAvx512, &dense_avx512)
        .add(Isa::kAvx2, &dense_avx2)
        .add(Isa::kGeneric, &dense_generic);
    return v;
  }();
  return all;
}

const DenseKernels& pick_dense(const std::string& name) { return dense_isas().pick(name); }

std::vector<std::string> dense_isa_names() { return dense_isas().names(); }

#include "simd_generic.h"   // bf16_to_f32, f32_to_bf16

bool is_half(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              what, ": expected a float32 or bfloat16 CPU tensor");
}

// Row i of a float32 or bfloat16 tensor as fp32 (copied into `buf` for bf16).
const float* as_f32(const at::Tensor& t, std::vector<float>& buf) {
  if (!is_half(t)) return t.data_ptr<float>();
  const auto* src = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  buf.resize(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) buf[i] = bf16_to_f32(src[i]);
  return buf.data();
}

// A thread is worth waking only for this many weight bytes streamed (or the MACs of
// parallel.h): below it the fork/join costs more than the second core's bandwidth saves.
// A single core streams the weights at about the DRAM rate measured here (22-26 GB/s), so
// only a large matrix (the LM head) gains from a second one.
constexpr int64_t kMinWeightBytesPerThread = int64_t(4) << 20;
constexpr int64_t kRowBlock = 8;  // output columns per work item (kernel blocks start here)
// Weight bytes per chunk the threads take from the shared counter. Both threads wait at the
// op's end for the last chunk in flight, so a chunk bounds the idle tail: the old quarter of
// a thread's share was 3.7 MB for a 20b qkv (~100 us at one thread's rate) and 145 MB for
// the LM head (~4 ms), paid whenever the partner started late or was preempted mid-op.
// 1 MiB keeps the tail under ~30 us; each chunk restarts the row stream (its first
// prefetch distance is not ahead), well under 1% of the chunk's time.
constexpr int64_t kChunkBytes = int64_t(1) << 20;
// Stream split (decode, at most kStreamMaxRows input rows, memory-bound): from
// kStreamSplitMinBytes of weights the op takes two threads even below
// kMinWeightBytesPerThread, and a matrix under kStreamItemsPerThread 1 MiB chunks per thread
// is cut into kStreamItemsPerThread continuous pieces per thread instead (each a single
// stream of weight rows, prefetched to its end), so both threads start at once and a late
// partner leaves at most one piece to the other. The moe_op.cpp stream split (bf16 experts)
// took 30 -> 55 GB/s this way. Measured here (one vs two threads in alternation, p10 of
// many calls, partner vCPU free; load 7): embedded qkv 1.1 MB 37 -> 25 us, o_proj 0.66 MB
// 23 -> 19, 0.33 MB 12.4 -> 6.0, 0.15 MB 7.1 -> 5.0. On a loaded machine a partner thread
// waiting for a time slice costs ~1 ms a call, as it does in every other two-thread op.
constexpr int64_t kStreamMaxRows = 4;
constexpr int64_t kStreamItemsPerThread = 2;
constexpr int64_t kStreamSplitMinBytes = int64_t(256) << 10;

at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias_in, const std::string& isa) {
  check_float(x_in, "dense_linear x");
  check_float(weight, "dense_linear weight");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && weight.size(1) == x_in.size(1) &&
                  weight.is_contiguous(),
              "dense_linear: expected x [M, K] and a contiguous weight [N, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const DenseKernels& kernels = pick_dense(isa);
  DenseProblem p{};
  p.M = M;
  p.N = N;
  p.K = K;
  p.w = weight.data_ptr();
  p.w_format = is_half(weight) ? kDenseBF16 : kDenseF32;
  std::vector<float> x_buf, bias_buf;
  const bool bf16_dot = kernels.bf16_dot && is_half(weight) && is_half(x);
  if (bf16_dot) {
    p.x_bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  } else {
    p.x = as_f32(x, x_buf);
  }
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    check_float(bias, "dense_linear bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "dense_linear: bias must be [N]");
    p.bias = as_f32(bias, bias_buf);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  p.y = y.data_ptr();
  p.y_format = is_half(y) ? kDenseBF16 : kDenseF32;
  if (M == 0 || N == 0) return y;
  const DenseFn fn = bf16_dot ? kernels.bf16_dot : kernels.fma;

  const int64_t items = (N + kRowBlock - 1) / kRowBlock;
  const int64_t bytes = N * K * int64_t(weight.element_size());
  const bool streamed = M <= kStreamMaxRows && bytes >= kStreamSplitMinBytes;
  const int64_t threads = std::min<int64_t>(
      {int64_t(at::get_num_threads()), items,
       std::max<int64_t>({int64_t(1), bytes / kMinWeightBytesPerThread,
                          M * N * K / kMinMacsPerThread, streamed ? int64_t(2) : int64_t(1)})});
  const int64_t row_bytes = std::max<int64_t>(1, kRowBlock * K * int64_t(weight.element_size()));
  int64_t chunk = std::max<int64_t>(1, kChunkBytes / row_bytes);
  if (threads > 1 && bytes < threads * kChunkBytes * kStreamItemsPerThread)
    chunk = std::max<int64_t>(1, (items + kStreamItemsPerThread * threads - 1) /
                                     (kStreamItemsPerThread * threads));
  parallel_items(items, threads, chunk, [&](int64_t begin, int64_t end) {
    fn(p, begin * kRowBlock, std::min(N, end * kRowBlock));
  });
  return y;
}

// out row = weight · x̂, x̂ = x / sqrt(mean(x²) + eps); sum[i] = x row as fp32 (already added)
template <class Out>
void norm_row(const float* h, const float* weight, int64_t H, double eps, Out* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
  const float inv = 1.0f / std::sqrt(ss / float(H) + float(eps));
  for (int64_t i = 0; i < H; ++i) {
    const float v = weight[i] * (h[i] * inv);
    if constexpr (sizeof(Out) == 2) out[i] = f32_to_bf16(v);
    else out[i] = v;
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_float(x, "rms_norm x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [M, H]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: weight must be contiguous float32 [H]");
}

// The rows of x (+ delta, rounded to x's dtype into `sum`) normalised into `out`.
void norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
               double eps, at::Tensor* sum, at::Tensor& out) {
  const int64_t M = x.size(0), H = x.size(1);
  const float* w = weight.data_ptr<float>();
  std::vector<float> row(H);
  const bool half = is_half(x);
  for (int64_t m = 0; m < M; ++m) {
    if (half) {
      const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * H;
      if (delta) {
        const auto* ds =
            reinterpret_cast<const uint16_t*>(delta->data_ptr<at::BFloat16>()) + m * H;
        auto* ss = reinterpret_cast<uint16_t*>(sum->data_ptr<at::BFloat16>()) + m * H;
        for (int64_t i = 0; i < H; ++i) {
          ss[i] = f32_to_bf16(bf16_to_f32(xs[i]) + bf16_to_f32(ds[i]));
          row[i] = bf16_to_f32(ss[i]);
        }
      } else {
        for (int64_t i = 0; i < H; ++i) row[i] = bf16_to_f32(xs[i]);
      }
      norm_row(row.data(), w, H, eps,
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + m * H);
    } else {
      const float* xs = x.data_ptr<float>() + m * H;
      if (delta) {
        const float* ds = delta->data_ptr<float>() + m * H;
        float* ss = sum->data_ptr<float>() + m * H;
        for (int64_t i = 0; i < H; ++i) ss[i] = xs[i] + ds[i];
        xs = ss;
      }
      norm_row(xs, w, H, eps, out.data_ptr<float>() + m * H);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  norm_rows(x, nullptr, weight, eps, nullptr, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta_in,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const at::Tensor delta = delta_in.contiguous();
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta must match x in shape and dtype");
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  norm_rows(x, &delta, weight, eps, &sum, out);
  return {sum, out};
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("dense_isas() -> str[]", &kvrelay::dense_isa_names);
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias, str isa=\"\") -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("dense_linear", &kvrelay::dense_linear);
  m.impl("rms_norm", &kvrelay::rms_norm);
  m.impl("add_rms_norm", &kvrelay::add_rms_norm);
}
