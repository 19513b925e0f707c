// torch op `kvrelay_kernels::moe_tiles`: a bf16 model's MoE experts (bf16 or MXFP4
// weights) for many token rows per expert — offline decode batches and prefill — through
// vdpbf16ps tiles (moe_tile.h). The same computation as `moe_experts` with bf16 operands:
// x and the weights are bf16 already (MXFP4 values are exact in bf16), the f32 swiglu
// output enters the down projection as three bf16 parts that sum to it exactly, so every
// product is exact and only the fp32 summation order differs; each token's k weighted
// rows are summed in fp32 and rounded once. Only on CPUs with AVX512-BF16 (`moe_tile_isas()` is empty elsewhere).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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
#include <vector>

#include "isa_dispatch.h"
#include "moe_args.h"
#include "moe_tile.h"
#include "parallel.h"

namespace kvrelay {
namespace {

// One variant, no fallback: the op exists for the bf16 pair products.
const Variants<TileKernels>& variants() {
  static const Variants<TileKernels> all = [] {
    Variants<TileKernels> v("moe_tiles");
    v.add(Isa::kAvx512Bf16, &tile_avx512_bf16);
    return v;
  }();
  return all;
}

const TileKernels* tile_kernels() {
  return variants().empty() ? nullptr : &variants().pick("");
}

std::vector<std::string> moe_tile_isas() { return variants().names(); }

// bf16 [E, rows, cols], or MXFP4 codes [E, rows, cols/32, 16] + scales [E, rows, cols/32].
TileWeights weights(const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                    const c10::optional<at::Tensor>& bias, const char* what) {
  const Projection p = projection(w, scales, bias, what);
  TORCH_CHECK(p.format != kF32, what, ": dense weights must be bfloat16 [E, rows, cols]");
  TileWeights t{};
  if (p.format == kMXFP4) {
    t.codes = static_cast<const uint8_t*>(p.data);
    t.scales = p.scales;
  } else {
    t.bf16 = static_cast<const uint16_t*>(p.data);
  }
  t.bias = p.bias;
  t.rows = p.rows;
  t.cols = p.cols;
  return t;
}

constexpr int64_t kTokenChunk = 256;   // token rows per work item (a multiple of 32)
constexpr int64_t kMaxItemRows = 64;   // weight rows per work item (moe_tile_avx512_bf16.cpp)

// Work items of one sweep: (expert, token chunk, row block), the costliest first; row
// blocks (multiples of 16) shrink until every thread has several items.
std::vector<TileItem> items(const std::vector<int64_t>& padded, int64_t rows, int64_t threads) {
  int64_t chunks = 0;
  for (size_t e = 0; e + 1 < padded.size(); ++e)
    chunks += (padded[e + 1] - padded[e] + kTokenChunk - 1) / kTokenChunk;
  int64_t size = kMaxItemRows;
  while (size > 16 && chunks * ((rows + size - 1) / size) < 4 * threads) size /= 2;
  std::vector<TileItem> out;
  for (size_t e = 0; e + 1 < padded.size(); ++e) {
    const int64_t n = padded[e + 1] - padded[e];
    for (int64_t t = 0; t < n; t += kTokenChunk)
      for (int64_t r = 0; r < rows; r += size)
        out.push_back(TileItem{int32_t(e), int32_t(r), int32_t(std::min(r + size, rows)),
                               int32_t(t), int32_t(std::min(t + kTokenChunk, n))});
  }
  const auto cost = [](const TileItem& i) { return int64_t(i.row1 - i.row0) * (i.tok1 - i.tok0); };
  std::stable_sort(out.begin(), out.end(),
                   [&](const TileItem& a, const TileItem& b) { return cost(a) > cost(b); });
  return out;
}

void sweep(TileItemsFn fn, const TileProblem& p, const std::vector<int64_t>& padded,
           int64_t rows, int64_t cols) {
  const int64_t macs = padded.back() * rows * cols;
  const int64_t threads = threads_for(macs, int64_t(1) << 30);
  const std::vector<TileItem> work = items(padded, rows, threads);
  parallel_items(int64_t(work.size()), std::min<int64_t>(threads, int64_t(work.size())), 1,
                 [&](int64_t begin, int64_t end) { fn(p, work.data() + begin, end - begin); });
}

// Working memory of one call: the calling thread's kept buffer up to kKeepFloats (grown
// as needed: a prefill step's 7 MB were fresh pages, faulted in at every call), a fresh
// tensor beyond (big models' long prefills, whose compute dwarfs the faults).
constexpr int64_t kKeepFloats = int64_t(4) << 20;   // 16 MB

at::Tensor scratch(int64_t floats, const at::TensorOptions& like) {
  const auto f32 = like.dtype(at::kFloat);
  if (floats > kKeepFloats) return at::empty({floats}, f32);
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.numel() < floats) kept = at::empty({floats}, f32);
  return kept;
}

at::Tensor moe_tiles(const at::Tensor& x, const at::Tensor& route_weights,
                     const at::Tensor& expert_ids, int64_t first_expert,
                     const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_scales,
                     const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                     const c10::optional<at::Tensor>& down_scales,
                     const c10::optional<at::Tensor>& down_bias, double alpha, double limit) {
  const TileKernels* kernels = tile_kernels();
  TORCH_CHECK(kernels != nullptr, "moe_tiles: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "moe_tiles: x must be contiguous bfloat16 [T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 &&
                  expert_ids.size(0) == T && expert_ids.is_contiguous(),
              "moe_tiles: expert_ids must be contiguous int64 [T, k]");
  TORCH_CHECK(route_weights.scalar_type() == at::kFloat &&
                  route_weights.sizes() == expert_ids.sizes() && route_weights.is_contiguous(),
              "moe_tiles: route_weights must be contiguous float32 [T, k]");
  const int64_t k = expert_ids.size(1);
  TileProblem p{};
  p.gate_up = weights(gate_up, gate_up_scales, gate_up_bias, "moe_tiles gate_up");
  p.down = weights(down, down_scales, down_bias, "moe_tiles down");
  const int64_t E = gate_up.size(0), I = p.down.cols;
  TORCH_CHECK(p.gate_up.cols == H && p.gate_up.rows == 2 * I && down.size(0) == E &&
                  p.down.rows == H,
              "moe_tiles: gate_up must be [E, 2I, H] and down [E, H, I] for x [T, H]");
  TORCH_CHECK(H % 2 == 0 && I % 2 == 0, "moe_tiles: H and I must be even");

  // counting sort of the T·k choices by local expert (stable: choice order kept)
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(E + 1, 0), padded(E + 1, 0);
  for (int64_t c = 0; c < T * k; ++c) {
    const int64_t e = ids[c] - first_expert;
    if (e >= 0 && e < E) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    padded[e + 1] = padded[e] + (offsets[e + 1] + 15) / 16 * 16;
    offsets[e + 1] += offsets[e];
  }
  const int64_t n = offsets[E];
  if (n == 0) return at::zeros({T, H}, x.options());
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

  // x rows pair-packed per expert (32-bit pairs transposed), pad rows zero
  const int64_t P = padded[E];
  const int64_t x_floats = (P * H / 2 + 15) / 16 * 16, act_floats = (3 * P * I / 2 + 15) / 16 * 16;
  const at::Tensor work = scratch(x_floats + act_floats + n * H, x.options());
  float* const base = work.data_ptr<float>();
  auto* xp = reinterpret_cast<uint32_t*>(base);
  const auto* xsrc = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const float* rw = route_weights.data_ptr<float>();
  std::vector<float> weight(n);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t Mp = padded[e + 1] - padded[e], count = offsets[e + 1] - offsets[e];
    uint32_t* block = xp + padded[e] * H / 2;
    // 16 rows at a time: each pair column of the block is one 64-byte line written whole
    const uint32_t* src[16];
    for (int64_t m0 = 0; m0 < count; m0 += 16) {
      const int64_t rows = std::min<int64_t>(16, count - m0);
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t c = choice[offsets[e] + m0 + m];
        src[m] = xsrc + (c / k) * H / 2;
        weight[offsets[e] + m0 + m] = rw[c];
      }
      for (int64_t j = 0; j < H / 2; ++j)
        for (int64_t m = 0; m < rows; ++m) block[j * Mp + m0 + m] = src[m][j];
    }
    for (int64_t j = 0; j < H / 2 && count < Mp; ++j)
      std::memset(block + j * Mp + count, 0, sizeof(uint32_t) * (Mp - count));
  }
  p.offsets = offsets.data();
  p.padded = padded.data();
  p.x = reinterpret_cast<const uint16_t*>(xp);
  p.act = reinterpret_cast<uint16_t*>(base + x_floats);
  p.act_plane = P * I;
  p.y = base + x_floats + act_floats;
  p.route_weight = weight.data();
  p.scale_table = e8m0_table<127>();
  p.alpha = float(alpha);
  p.limit = float(limit);

  sweep(kernels->gate_up, p, padded, 2 * I, H);
  sweep(kernels->down, p, padded, H, I);

  // each token: the sum of its local choices, in choice order, from 0 in float32, rounded
  // to bf16 once (c10::BFloat16 rounds to nearest even, as Tensor.to does)
  at::Tensor out = at::empty({T, H}, x.options());
  c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
  const float* y = p.y;
  const int64_t sum_threads = threads_for(T * k * H, T);
  parallel_items(T, sum_threads, (T + 4 * sum_threads - 1) / (4 * sum_threads),
                 [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = position[t * k + j];
        if (r < 0) continue;
        for (int64_t h = 0; h < H; ++h) row[h] += y[r * H + h];
      }
      for (int64_t h = 0; h < H; ++h) ob[t * H + h] = c10::BFloat16(row[h]);
    }
  });
  return out;
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("moe_tiles(Tensor x, Tensor route_weights, Tensor expert_ids, int first_expert, "
        "Tensor gate_up, Tensor? gate_up_scales, Tensor? gate_up_bias, Tensor down, "
        "Tensor? down_scales, Tensor? down_bias, float alpha, float limit) -> Tensor");
  m.def("moe_tile_isas() -> str[]", &kvrelay::moe_tile_isas);
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) { m.impl("moe_tiles", &kvrelay::moe_tiles); }
