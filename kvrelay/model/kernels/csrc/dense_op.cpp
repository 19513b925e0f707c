// torch ops of the decode-sized dense layers, in the best ISA build this CPU supports:
//
//   kvrelay_kernels::dense_linear(x [M, K], weight [N, K], bias [N]?) -> y [M, N]
//       F.linear for a few rows (decode): the weights are streamed once, each thread
//       taking blocks of output columns; fp32 accumulation; y in x's dtype.
//   kvrelay_kernels::rms_norm(x [M, H], weight [H] f32, eps) -> y [M, H]
//   kvrelay_kernels::add_rms_norm(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))
//       the residual add and the next norm in one pass over the row.
//   kvrelay_kernels::dense_ordered_linear(x [M, K], packed, N, round_bf16, bias?, kc)
//       -> y [M, N] in x's dtype (f32 or bf16)
//   kvrelay_kernels::dense_ordered_argmax(x, packed, N, round_bf16) -> int64 [M]
//       F.linear in fp32 with one fixed summation order per output (dense.h), for
//       layers/ordered.py (x widened to fp32); the second returns each row's argmax
//       instead of the row.
//   kvrelay_kernels::dense_linear_argmax(x [1, K], weight [N, K]) -> int64 [1]
//       argmax_rows(dense_linear(x, weight).float()) without writing the row (greedy decode).
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
#include <limits>
#include <memory>
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
#include "dense_argmax.h"   // the first-maximum argmax fold

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

// How dense_linear spreads N output columns over the threads: `items` blocks of kRowBlock
// columns, `chunk` items per claim, `threads` threads (see the constants above).
struct DenseSplit {
  int64_t items, threads, chunk;
};

DenseSplit dense_split(int64_t M, int64_t N, int64_t K, int64_t element_size) {
  const int64_t items = (N + kRowBlock - 1) / kRowBlock;
  const int64_t bytes = N * K * element_size;
  const bool streamed = M <= kStreamMaxRows && bytes >= kStreamSplitMinBytes;
  const int64_t threads = std::min<int64_t>(
      {int64_t(at::get_num_threads()), items,
       std::max<int64_t>({int64_t(1), bytes / kMinWeightBytesPerThread,
                          M * N * K / kMinMacsPerThread, streamed ? int64_t(2) : int64_t(1)})});
  const int64_t row_bytes = std::max<int64_t>(1, kRowBlock * K * element_size);
  int64_t chunk = std::max<int64_t>(1, kChunkBytes / row_bytes);
  if (threads > 1 && bytes < threads * kChunkBytes * kStreamItemsPerThread)
    chunk = std::max<int64_t>(1, (items + kStreamItemsPerThread * threads - 1) /
                                     (kStreamItemsPerThread * threads));
  return {items, threads, chunk};
}

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
  const DenseSplit s = dense_split(M, N, K, weight.element_size());
  parallel_items(s.items, s.threads, s.chunk, [&](int64_t begin, int64_t end) {
    fn(p, begin * kRowBlock, std::min(N, end * kRowBlock));
  });
  return y;
}

// A row's argmax as argmax_rows answers it (the first maximal index, the first NaN, -1 where
// every value is -inf) over y[0, n) of one work item, its indices offset by `first`: the fold
// of dense_argmax.h over 16 lanes.
struct RowBest {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1, nan = -1;
};

// y's values as float32 (bf16 widened), for the fold
template <class T>
struct Widened {
  const T* p;
  KVRELAY_ALWAYS_INLINE float operator()(int64_t i) const {
    if constexpr (sizeof(T) == 2) return bf16_to_f32(p[i]);
    else return p[i];
  }
};

template <class T>
RowBest fold_argmax(const T* y, int64_t n, int64_t first) {
  constexpr int kLanes = 16;
  float best[kLanes];
  int32_t at[kLanes];
  argmax_lanes_reset<kLanes>(best, at);
  bool nan = false;
  const int64_t full = n / kLanes;
  for (int64_t j = 0; j < full; ++j)
    nan |= argmax_lanes_step<kLanes>(best, at, static_cast<int32_t>(j),
                                     Widened<T>{y + kLanes * j});
  nan |= argmax_lanes_tail<kLanes>(best, at, static_cast<int32_t>(full), n - kLanes * full,
                                   Widened<T>{y + kLanes * full});   // the partial last block
  RowBest r;
  if (nan) r.nan = first + argmax_first_nan(n, Widened<T>{y});
  int64_t t = -1;
  argmax_lanes_best<kLanes>(best, at, &r.value, &t);
  if (t >= 0) r.index = first + t;
  return r;
}

// argmax_rows(dense_linear(x, weight, None).float()) for one row x (int64 [1]), without the
// row: each work item computes its columns exactly as dense_linear does (a column's sum
// depends only on K) into a scratch of its own and folds them while they are in cache.
at::Tensor dense_linear_argmax(const at::Tensor& x_in, const at::Tensor& weight,
                               const std::string& isa) {
  check_float(x_in, "dense_linear_argmax x");
  check_float(weight, "dense_linear_argmax weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == 1 && weight.dim() == 2 &&
                  weight.size(1) == x_in.size(1) && weight.is_contiguous() &&
                  weight.size(0) >= 1,
              "dense_linear_argmax: expected x [1, K] and a contiguous weight [N >= 1, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(1), N = weight.size(0);
  const DenseKernels& kernels = pick_dense(isa);
  DenseProblem p{};
  p.M = 1;
  p.K = K;
  p.w_format = is_half(weight) ? kDenseBF16 : kDenseF32;
  std::vector<float> x_buf;
  const bool bf16_dot = kernels.bf16_dot && is_half(weight) && is_half(x);
  if (bf16_dot) {
    p.x_bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  } else {
    p.x = as_f32(x, x_buf);
  }
  p.y_format = is_half(x) ? kDenseBF16 : kDenseF32;
  const DenseFn fn = bf16_dot ? kernels.bf16_dot : kernels.fma;
  const DenseSplit s = dense_split(1, N, K, weight.element_size());
  const int64_t claims = (s.items + s.chunk - 1) / s.chunk;
  std::vector<RowBest> found(claims);   // one thread: one claim of everything, the rest empty
  const char* w = static_cast<const char*>(weight.data_ptr());
  const int64_t row_bytes = K * int64_t(weight.element_size());
  parallel_items(s.items, s.threads, s.chunk, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kRowBlock, n1 = std::min(N, end * kRowBlock);
    std::unique_ptr<float[]> out(new float[n1 - n0]);  // y in its format (bf16: half used)
    DenseProblem q = p;
    q.w = w + n0 * row_bytes;
    q.N = n1 - n0;
    q.y = out.get();
    fn(q, 0, n1 - n0);
    found[begin / s.chunk] =
        p.y_format == kDenseBF16
            ? fold_argmax(reinterpret_cast<const uint16_t*>(out.get()), n1 - n0, n0)
            : fold_argmax(out.get(), n1 - n0, n0);
  });
  RowBest r;
  for (const RowBest& f : found) {                   // in index order: ties keep the first
    if (f.nan >= 0 && r.nan < 0) r.nan = f.nan;
    if (f.index >= 0 && (r.index < 0 || f.value > r.value)) r.value = f.value, r.index = f.index;
  }
  at::Tensor token = at::empty({1}, x.options().dtype(at::kLong));
  token.data_ptr<int64_t>()[0] = r.nan >= 0 ? r.nan : r.index < 0 ? 0 : r.index;
  return token;
}

// The ordered product's ops (dense.h `OrderedProblem`): the weight packed by 16 rows k-major
// ([ceil(N/16), K, 16], fp32 or bf16; layers/ordered.py packs it). Whole blocks per work item
// of ~64 KiB of weights, so results do not depend on the thread count, and a late partner
// thread leaves little for the other.
struct OrderedCall {
  OrderedProblem p;
  int64_t blocks, chunk, threads;
  std::vector<float> x_buf;   // a bf16 x widened
};

OrderedCall ordered_call(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         bool round_bf16, const c10::optional<at::Tensor>& bias, int64_t kc,
                         const char* op) {
  check_float(x, op);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K]");
  check_float(packed, op);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kOrderedLanes && packed.is_contiguous(),
              op, ": packed must be a contiguous [blocks, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, op, ": x has ", K, " features, the packed weight ",
              packed.size(1));
  TORCH_CHECK(N >= 0 && (N + kOrderedLanes - 1) / kOrderedLanes == blocks, op, ": ", blocks,
              " blocks of 16 rows do not hold N = ", N);
  const int64_t block_bytes = std::max<int64_t>(1, K * kOrderedLanes * packed.element_size());
  const int64_t chunk = std::max<int64_t>(1, (int64_t(64) << 10) / block_bytes);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == blocks * kOrderedLanes,
                op, ": bias must be a contiguous float32 [blocks · 16]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(kc >= 0, op, ": kc must be >= 0 (0: K)");
  OrderedCall c{OrderedProblem{nullptr, packed.data_ptr(),
                               is_half(packed) ? kDenseBF16 : kDenseF32, nullptr, M, N, K,
                               round_bf16 ? 1 : 0, b,
                               kc == 0 || kc > K ? std::max<int64_t>(K, 1) : kc},
                blocks, chunk, threads_for(M * N * K, (blocks + chunk - 1) / chunk), {}};
  c.p.x = as_f32(x, c.x_buf);
  return c;
}

// y = x · Wᵀ (+ bias), each output one FMA chain in k order per block of kc (0: K), the
// blocks added in order after the bias (dense.h), in x's dtype: float32 rounded to bf16 and
// widened back where round_bf16 (the LM head's logits), bf16 rounded once (a projection's
// output; round_bf16 is implied).
at::Tensor dense_ordered_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                                bool round_bf16, const c10::optional<at::Tensor>& bias,
                                int64_t kc, const std::string& isa) {
  const at::Tensor x = x_in.contiguous();
  const bool half = is_half(x);
  OrderedCall c = ordered_call(x, packed, N, round_bf16 || half, bias, kc,
                               "dense_ordered_linear");
  const DenseKernels& kernels = pick_dense(isa);
  at::Tensor y = at::empty({c.p.M, N}, x.options());
  if (c.p.M == 0 || N == 0) return y;
  std::vector<float> rounded(half ? c.p.M * N : 0);   // bf16 y: the rounded values first
  c.p.y = half ? rounded.data() : y.data_ptr<float>();
  parallel_items(c.blocks, c.threads, c.chunk, [&](int64_t begin, int64_t end) {
    kernels.ordered(c.p, begin, end);
  });
  if (half) {                    // already bf16 values: their upper halves, exactly
    auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < c.p.M * N; ++i) {
      uint32_t u;
      std::memcpy(&u, &rounded[i], 4);
      out[i] = uint16_t(u >> 16);
    }
  }
  return y;
}

// argmax_rows(dense_ordered_linear(...)) without the outputs: int64 [M], argmax_rows' answer
// for every row (the first maximal index, a row's first NaN, 0 for a row of -inf). Each
// work item folds its blocks; the items' results are combined in index order.
at::Tensor dense_ordered_argmax(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                                bool round_bf16, const std::string& isa) {
  const at::Tensor x = x_in.contiguous();
  OrderedCall c = ordered_call(x, packed, N, round_bf16, c10::nullopt, 0,
                               "dense_ordered_argmax");
  TORCH_CHECK(N >= 1, "dense_ordered_argmax: an empty row has no argmax");
  const DenseKernels& kernels = pick_dense(isa);
  const int64_t M = c.p.M, items = (c.blocks + c.chunk - 1) / c.chunk;
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
  // one thread folds every block as one item; the items no call filled stay empty (-1)
  std::vector<float> value(items * M);
  std::vector<int64_t> index(items * M, -1), nan(items * M, -1);
  parallel_items(c.blocks, c.threads, c.chunk, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * M * kOrderedLanes);
    std::vector<int32_t> at(M * kOrderedLanes);
    const int64_t item = begin / c.chunk;
    const OrderedArgmax a{value.data() + item * M, index.data() + item * M,
                          nan.data() + item * M, scratch.data(),
                          scratch.data() + M * kOrderedLanes, at.data()};
    kernels.ordered_argmax(c.p, begin, end, a);
  });
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    int64_t token = -1, first_nan = -1;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < items; ++i) {           // in index order: ties keep the first
      const int64_t at = i * M + m;
      if (nan[at] >= 0 && first_nan < 0) first_nan = nan[at];
      if (index[at] >= 0 && (token < 0 || value[at] > best)) best = value[at], token = index[at];
    }
    out[m] = first_nan >= 0 ? first_nan : token < 0 ? 0 : token;
  }
  return tokens;
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

const DenseKernels& dense_kernels(const char* isa) { return pick_dense(isa); }

}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("dense_isas() -> str[]", &kvrelay::dense_isa_names);
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias, str isa=\"\") -> Tensor");
  m.def("dense_ordered_linear(Tensor x, Tensor packed, int N, bool round_bf16, "
        "Tensor? bias=None, int kc=0, str isa=\"\") -> Tensor");
  m.def("dense_ordered_argmax(Tensor x, Tensor packed, int N, bool round_bf16, "
        "str isa=\"\") -> Tensor");
  m.def("dense_linear_argmax(Tensor x, Tensor weight, str isa=\"\") -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("dense_linear", &kvrelay::dense_linear);
  m.impl("dense_ordered_linear", &kvrelay::dense_ordered_linear);
  m.impl("dense_ordered_argmax", &kvrelay::dense_ordered_argmax);
  m.impl("dense_linear_argmax", &kvrelay::dense_linear_argmax);
  m.impl("rms_norm", &kvrelay::rms_norm);
  m.impl("add_rms_norm", &kvrelay::add_rms_norm);
}
