// torch op `kvrelay_kernels::moe_experts`: this rank's experts for a batch of tokens in
// one call. Routing choices are counting-sorted by expert here; the expert matmuls run
// as two parallel sweeps over (expert, row tile, token chunk) work items — gate_up +
// swiglu, then down × routing weight — in the best ISA build this CPU supports; the k
// weighted rows of each token are summed last. x may be float32 or bfloat16 (widened as it
// is gathered, rounded once at the end: what x.float() before and .to(bf16) after give,
// without the two extra ops and tensors per call); the computation is float32 throughout.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "isa_dispatch.h"
#include "moe.h"
#include "moe_args.h"
#include "parallel.h"

namespace kvrelay {
namespace {

// The MoE and paged decode builds (moe.h: one IsaKernels per variant), best first.
const Variants<IsaKernels>& isas() {
  static const Variants<IsaKernels> all = [] {
    Variants<IsaKernels> v("kvrelay kernels");
    v.add(Isa::kAvx512Bf16, &avx512_bf16_kernels)
        .add(Isa::kAvx512, &avx512_kernels)
        .add(Isa::kAvx2, &avx2_kernels)
        .add(Isa::kGeneric, &generic_kernels);
    return v;
  }();
  return all;
}

const IsaKernels& pick(const std::string& name) { return isas().pick(name); }

}  // namespace

const IsaKernels& isa_kernels(const char* name) { return pick(name ? name : ""); }

namespace {

std::vector<std::string> isa_names() { return isas().names(); }

// Work items: (row tile, token chunk) of each active expert, the costliest first. Tiles
// shrink until every thread has several items to take when few experts are active
// (decode); an expert's tokens are cut into kTokenChunk-row chunks so that one busy
// expert (prefill) still spreads over the threads.
//
// Weights at decode sizes (at most kStreamMaxTokens tokens per expert: each
// weight row read once, memory-bound) are cut into kStreamItemsPerThread items per thread
// instead, shared out over the active experts by rows: each item is one sequential stream
// of weight rows that its row passes prefetch ahead to the item's end (moe_impl.h
// Prefetch). Measured (benchmarks/moe_kernels.py --kernel, embedded experts, bf16, Zen 5,
// best of 8-30 rounds under load 4-10): 32-row tiles restart the stream every 36 KB and
// stayed at 29-34 GB/s on one or two threads; streams reach 44-55 GB/s on two at 1 token
// (55 where both vCPUs were free; 1 / 2 / 4 / 8 items per thread: 45 / 44 / 44 / 42 at load
// 10) and 46-55 at 4 tokens (26-28 before), 33-35 on one. MXFP4 weights too (their row
// blocks prefetch ahead on their own): 32-row tiles of a 20b layer restart each thread's
// stream every 47 KB; streams took 2 threads from 33 to 39-43 GB/s at 1 and 4 tokens
// (benchmarks/moe_fp4_kernel.py, AVX-512 Zen 4, session 8; one thread unchanged, ~26).
constexpr int64_t kStreamItemsPerThread = 2;
constexpr int64_t kStreamMaxTokens = 4;

std::vector<Tile> tiles(const std::vector<int64_t>& offsets, const Projection& w,
                        int64_t threads) {
  const int64_t rows = w.rows;
  int64_t chunks = 0, active = 0, most = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    chunks += (n + kTokenChunk - 1) / kTokenChunk;
    active += n > 0;
    most = std::max(most, n);
  }
  const int64_t want = 4 * threads;
  int64_t size = kMaxTileRows / 2;
  if (most <= kStreamMaxTokens) {
    const int64_t items = kStreamItemsPerThread * threads;
    const int64_t per_expert = std::max<int64_t>(1, (items + active - 1) / active);
    size = ((rows + per_expert - 1) / per_expert + 1) / 2 * 2;   // even: gate/up pairs
  }
  while (threads > 1 && size > 2 && size <= kMaxTileRows / 2 &&
         chunks * ((rows + size - 1) / size) < want)
    size /= 2;
  std::vector<Tile> out;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    for (int64_t t = 0; t < n; t += kTokenChunk)
      for (int64_t r = 0; r < rows; r += size)
        out.push_back(Tile{int32_t(e), int32_t(r), int32_t(std::min(r + size, rows)),
                           int32_t(t), int32_t(std::min<int64_t>(t + kTokenChunk, n))});
  }
  const auto cost = [](const Tile& t) { return int64_t(t.row1 - t.row0) * (t.tok1 - t.tok0); };
  std::stable_sort(out.begin(), out.end(),
                   [&](const Tile& a, const Tile& b) { return cost(a) > cost(b); });
  return out;
}

// Decode streams each active expert's weights once: a second thread pays for itself (one
// fork/join, a few us) from this many weight bytes, whatever the multiply-adds. Measured
// (benchmarks/moe_kernels.py --kernel, embedded model's experts, bf16, 1 token: gate_up
// 3.5 MB, down 1.8 MB): by multiply-adds alone both sweeps ran on one thread, ~26 GB/s.
constexpr int64_t kMinWeightBytesPerThread = int64_t(256) << 10;

// Bytes of one expert's `rows` x `cols` weights in format `p`.
int64_t expert_bytes(const Projection& p) {
  if (p.format == kMXFP4) return p.rows * (p.cols / 2 + p.cols / 32);
  return p.rows * p.cols * (p.format == kF32 ? 4 : 2);
}

// One sweep (gate_up or down) over every active expert: `rows` x `cols` weights per
// expert, n token rows in all.
void run(TileFn fn, const MoeProblem& problem, const Projection& w,
         const std::vector<int64_t>& offsets) {
  const int64_t rows = w.rows, cols = w.cols, n = offsets.back();
  int64_t active = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) active += offsets[e + 1] > offsets[e];
  const int64_t by_bytes = std::min<int64_t>(
      {int64_t(at::get_num_threads()), rows * n,
       active * expert_bytes(w) / kMinWeightBytesPerThread});
  const int64_t threads = std::max(threads_for(n * rows * cols, rows * n), by_bytes);
  const std::vector<Tile> work = tiles(offsets, w, threads);
  parallel_items(int64_t(work.size()), threads, 1, [&](int64_t begin, int64_t end) {
    fn(problem, work.data() + begin, end - begin);
  });
}

int64_t aligned16(int64_t floats) { return (floats + 15) / 16 * 16; }

// Float32 working memory for one call (the caller holds the tensor while it runs).
// Decode-sized calls reuse the calling thread's buffer (allocations are ~1 us of a call
// whose kernel time can be a few us); larger ones allocate, so a prefill's working set is
// not kept.
constexpr int64_t kScratchKeepFloats = int64_t(1) << 18;   // 1 MB

at::Tensor scratch(int64_t floats, const at::TensorOptions& like) {
  const auto f32 = like.dtype(at::kFloat);
  if (floats > kScratchKeepFloats) return at::empty({floats}, f32);
  thread_local at::Tensor kept;
  if (!kept.defined()) kept = at::empty({kScratchKeepFloats}, f32);
  return kept;
}

// One row of H values (a multiple of 32) as float32 in an MXFP4 projection's input order
// (moe.h: each group of 32 with its even columns first), group by group: the same stores
// as dst[fp4_column(j)] = src[j], in a form the compiler vectorises: per column, the index
// arithmetic cost 6x a plain copy (128 rows of 32 bf16: ~6 us against ~1, -O3, Zen 3), a
// cost the bf16 experts do not pay. Measured (benchmarks/moe_kernels.py's "peers" shape,
// 64 tokens top-2, AVX2, one thread, best CPU us per call): 88-95 before, 86-88 after.
template <class T>
void store_fp4_order(const T* src, float* dst, int64_t H) {
  for (int64_t g = 0; g < H; g += 32)
    for (int64_t i = 0; i < 16; ++i) {
      dst[g + i] = float(src[g + 2 * i]);            // even columns
      dst[g + 16 + i] = float(src[g + 2 * i + 1]);   // odd columns
    }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& route_weights,
                       const at::Tensor& expert_ids, int64_t first_expert,
                       const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_scales,
                       const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                       const c10::optional<at::Tensor>& down_scales,
                       const c10::optional<at::Tensor>& down_bias, double alpha, double limit,
                       const std::string& isa) {
  const IsaKernels& kernels = pick(isa);
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16_x) && x.dim() == 2 && x.is_contiguous(),
              "moe_experts: x must be contiguous float32 or bfloat16 [T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 &&
                  expert_ids.size(0) == T && expert_ids.is_contiguous(),
              "moe_experts: expert_ids must be contiguous int64 [T, k]");
  TORCH_CHECK(route_weights.scalar_type() == at::kFloat &&
                  route_weights.sizes() == expert_ids.sizes() && route_weights.is_contiguous(),
              "moe_experts: route_weights must be contiguous float32 [T, k]");
  const int64_t k = expert_ids.size(1);
  MoeProblem p{};
  p.gate_up = projection(gate_up, gate_up_scales, gate_up_bias, "moe_experts gate_up");
  p.down = projection(down, down_scales, down_bias, "moe_experts down");
  const int64_t E = gate_up.size(0), I = p.down.cols;
  TORCH_CHECK(p.gate_up.cols == H && p.gate_up.rows == 2 * I && down.size(0) == E &&
                  p.down.rows == H,
              "moe_experts: gate_up must be [E, 2I, H] and down [E, H, I] for x [T, H]");

  // counting sort of the T·k choices by local expert (stable: choice order kept)
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t c = 0; c < T * k; ++c) {
    const int64_t e = ids[c] - first_expert;
    if (e >= 0 && e < E) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  const int64_t n = offsets[E];
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  std::vector<int64_t> position(T * k, -1);   // choice → sorted row
  std::vector<int64_t> choice(n);             // sorted row → choice
  for (int64_t c = 0; c < T * k; ++c) {
    const int64_t e = ids[c] - first_expert;
    if (e >= 0 && e < E) {
      position[c] = next[e]++;
      choice[position[c]] = c;
    }
  }
  if (n == 0) return at::zeros({T, H}, x.options());

  // gathered rows, activations and expert outputs, 64-byte aligned, in one buffer
  const int64_t xs_size = aligned16((n + kPadRows) * H), act_size = aligned16((n + kPadRows) * I);
  const at::Tensor work = scratch(xs_size + act_size + aligned16(n * H), x.options());
  float* const xsp = work.data_ptr<float>();
  float* const actp = xsp + xs_size;
  float* const ysp = actp + act_size;
  std::vector<float> weight(n);
  const float* xp = bf16_x ? nullptr : x.data_ptr<float>();
  const c10::BFloat16* xb = bf16_x ? x.data_ptr<c10::BFloat16>() : nullptr;
  const float* rw = route_weights.data_ptr<float>();
  std::memset(xsp + n * H, 0, sizeof(float) * kPadRows * H);
  std::memset(actp + n * I, 0, sizeof(float) * kPadRows * I);
  const bool fp4_order = p.gate_up.format == kMXFP4;   // see moe.h
  for (int64_t r = 0; r < n; ++r) {
    float* dst = xsp + r * H;
    if (bf16_x) {
      const c10::BFloat16* src = xb + (choice[r] / k) * H;
      if (fp4_order) {
        store_fp4_order(src, dst, H);
      } else {
        for (int64_t j = 0; j < H; ++j) dst[j] = float(src[j]);
      }
    } else {
      const float* src = xp + (choice[r] / k) * H;
      if (fp4_order) {
        store_fp4_order(src, dst, H);
      } else {
        std::memcpy(dst, src, sizeof(float) * H);
      }
    }
    weight[r] = rw[choice[r]];
  }
  p.offsets = offsets.data();
  p.x = xsp;
  p.act = actp;
  p.y = ysp;
  p.route_weight = weight.data();
  p.half_scales = e8m0_table<128>();
  p.alpha = float(alpha);
  p.limit = float(limit);

  run(kernels.gate_up, p, p.gate_up, offsets);
  run(kernels.down, p, p.down, offsets);

  // each token: the sum of its local choices, in choice order, from 0 in float32, then
  // rounded to x's dtype (c10::BFloat16 rounds to nearest even, as Tensor.to does)
  at::Tensor out = at::empty({T, H}, x.options());
  float* of = bf16_x ? nullptr : out.data_ptr<float>();
  c10::BFloat16* ob = bf16_x ? out.data_ptr<c10::BFloat16>() : nullptr;
  const float* y = ysp;
  const int64_t sum_threads = threads_for(T * k * H, T);
  parallel_items(T, sum_threads, (T + 4 * sum_threads - 1) / (4 * sum_threads),
                 [&](int64_t begin, int64_t end) {
    std::vector<float> row(bf16_x ? H : 0);
    for (int64_t t = begin; t < end; ++t) {
      float* o = bf16_x ? row.data() : of + t * H;
      std::fill(o, o + H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = position[t * k + j];
        if (r < 0) continue;
        for (int64_t h = 0; h < H; ++h) o[h] += y[r * H + h];
      }
      if (bf16_x)
        for (int64_t h = 0; h < H; ++h) ob[t * H + h] = c10::BFloat16(o[h]);
    }
  });
  return out;
}

// The router and the experts of a decode step in one call (DecoderLayer.forward given a FusedDecode): logits =
// dense_linear(x, router_weight, router_bias), (weights, ids) = route_topk(logits, k), then
// moe_experts. The two are called through the dispatcher, the very ops the separate path
// calls from Python, so the results are bitwise the same; what goes is two Python-side op
// dispatches (~2-3 us each) per layer.
at::Tensor moe_route_experts(const at::Tensor& x, const at::Tensor& router_weight,
                             const c10::optional<at::Tensor>& router_bias, int64_t top_k,
                             int64_t first_expert, const at::Tensor& gate_up,
                             const c10::optional<at::Tensor>& gate_up_scales,
                             const c10::optional<at::Tensor>& gate_up_bias,
                             const at::Tensor& down, const c10::optional<at::Tensor>& down_scales,
                             const c10::optional<at::Tensor>& down_bias, double alpha,
                             double limit, const std::string& isa) {
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvrelay_kernels::dense_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, const std::string&)>();
  static const auto route =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvrelay_kernels::route_topk", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t)>();
  static const std::string best;   // "": the best dense ISA, as `linear` asks
  const at::Tensor logits = linear.call(x, router_weight, router_bias, best);
  const auto [weights, ids] = route.call(logits, top_k);
  return moe_experts(x, weights, ids, first_expert, gate_up, gate_up_scales, gate_up_bias, down,
                     down_scales, down_bias, alpha, limit, isa);
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY(kvrelay_kernels, m) {
  m.def("moe_experts(Tensor x, Tensor route_weights, Tensor expert_ids, int first_expert, "
        "Tensor gate_up, Tensor? gate_up_scales, Tensor? gate_up_bias, Tensor down, "
        "Tensor? down_scales, Tensor? down_bias, float alpha, float limit, str isa) -> Tensor");
  m.def("moe_route_experts(Tensor x, Tensor router_weight, Tensor? router_bias, int top_k, "
        "int first_expert, Tensor gate_up, Tensor? gate_up_scales, Tensor? gate_up_bias, "
        "Tensor down, Tensor? down_scales, Tensor? down_bias, float alpha, float limit, "
        "str isa) -> Tensor");
  m.def("isas() -> str[]", &kvrelay::isa_names);
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("moe_experts", &kvrelay::moe_experts);
  m.impl("moe_route_experts", &kvrelay::moe_route_experts);
}
