// torch op `kvrelay_kernels::prefill_attention`: causal attention of prompts from position 0
// over their own keys and values, sinks and sliding windows included (prefill.h), run in
// the best ISA build this CPU supports over (prompt, KV head, query tile) work items.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "isa_dispatch.h"
#include "parallel.h"
#include "prefill.h"

namespace kvrelay {
namespace {

const Variants<PrefillFn>& variants() {  // best first
  static const Variants<PrefillFn> all = [] {
    Variants<PrefillFn> v("prefill_attention");
    v.add(Isa::kAvx512, &prefill_avx512).add(Isa::kAvx2, &prefill_avx2)
        .add(Isa::kGeneric, &prefill_generic);
    return v;
  }();
  return all;
}

// The MoE/decode ISA list (isas()) names "avx512_bf16" builds; prefill has none of its
// own, so that name runs the AVX-512 build (whose CPU check is the same rule's).
PrefillFn pick(const std::string& name) {
  return variants().pick(name == "avx512_bf16" && cpu_runs(Isa::kAvx512Bf16) ? "avx512" : name);
}

std::vector<std::string> prefill_isas() { return variants().names(); }

template <class T>
float to_f32(T x) { return static_cast<float>(x); }

// K transposed to [KVH][D][ld_kt] and V to [KVH][T][Dp], in f32 (PrefillProblem::kt, vf),
// 16 tokens at a time: each (head, dim) row of the block is one contiguous 64-byte store.
template <class T>
void keys_values_f32(const at::Tensor& k, const at::Tensor& v, int64_t ld_kt, int64_t Dp,
                     float* kt, float* vf) {
  const int64_t n = k.size(0), KVH = k.size(1), D = k.size(2);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t t1 = std::min(n, t0 + 16);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t d = 0; d < D; ++d) {
        float* row = kt + (h * D + d) * ld_kt;
        for (int64_t t = t0; t < t1; ++t) row[t] = to_f32(kp[t * ks + h * D + d]);
      }
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        float* row = vf + (h * n + t) * Dp;
        for (int64_t d = 0; d < D; ++d) row[d] = to_f32(vp[t * vs + h * D + d]);
        for (int64_t d = D; d < Dp; ++d) row[d] = 0.f;
      }
  }
  for (int64_t r = 0; r < KVH * D; ++r)       // the tail past T: read by a last block, masked
    std::fill(kt + r * ld_kt + n, kt + (r + 1) * ld_kt, 0.f);
}

// The caller thread's kept f32 buffer of at least `floats` (up to 8 MB; fresh beyond):
// a step's keys and values as f32 would otherwise be new pages faulted in at every layer.
at::Tensor kept_f32(int64_t floats, const at::TensorOptions& like) {
  const auto f32 = like.dtype(at::kFloat);
  if (floats > (int64_t(2) << 20)) return at::empty({floats}, f32);
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.numel() < floats) kept = at::empty({floats}, f32);
  return kept;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens, const at::Tensor& sinks,
                             double scale, int64_t window, const std::string& isa) {
  PrefillProblem p{};
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "prefill_attention: q [T,h,hd], k/v [T,kvh,hd]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              "prefill_attention: q and k/v shapes do not match");
  TORCH_CHECK(q.size(1) / k.size(1) * kPrefillTile < (int64_t(1) << 16) && k.size(1) < (1 << 16),
              "prefill_attention: too many heads");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "prefill_attention: q, k and v dtypes differ");
  TORCH_CHECK(q.size(2) <= 1024, "prefill_attention: head dim over 1024");
  p.format = dtype == at::kFloat ? kPrefillF32
             : dtype == at::kBFloat16 ? kPrefillBF16
             : dtype == at::kHalf ? kPrefillF16
             : -1;
  TORCH_CHECK(p.format >= 0, "prefill_attention: q/k/v must be float32, bfloat16 or float16");
  // a token's heads contiguous; tokens may be strided (k is a slice of the fused qk)
  const auto rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor qf = rows(q), kf = rows(k), vf = rows(v);
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const at::Tensor sk = sinks.to(at::kFloat).contiguous();
  const int64_t S = cu.numel() - 1;
  TORCH_CHECK(S >= 0 && sk.numel() == q.size(1), "prefill_attention: cu_seqlens [S+1], sinks [h]");
  const int64_t* c = cu.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || (c[0] == 0 && c[S] == q.size(0)), "cu_seqlens must span [0, T]");
  p.H = q.size(1), p.KVH = k.size(1), p.D = q.size(2);
  p.window = window;
  p.scale = static_cast<float>(scale);
  // items, longest tiles (the last of each prompt: the most keys) first
  std::vector<int64_t> items;
  std::vector<std::pair<int64_t, int64_t>> order;      // (keys, item)
  int64_t macs = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = c[s + 1] - c[s];
    TORCH_CHECK(len >= 0, "cu_seqlens must not decrease");
    for (int64_t t = 0; t * kPrefillTile < len; ++t) {
      const int64_t hi = std::min(len, (t + 1) * kPrefillTile);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, t * kPrefillTile - window + 1) : 0;
      macs += (hi - lo) * (hi - t * kPrefillTile) * 2 * p.D * p.H;
      for (int64_t h = 0; h < p.KVH; ++h)
        order.emplace_back(hi - lo, (s << 32) | (h << 16) | t);
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  items.reserve(order.size());
  for (const auto& o : order) items.push_back(o.second);
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  p.q = qf.data_ptr();
  p.k = kf.data_ptr();
  p.v = vf.data_ptr();
  p.q_stride = qf.stride(0), p.k_stride = kf.stride(0), p.v_stride = vf.stride(0);
  p.cu = c;
  p.items = items.data();
  p.sinks = sk.data_ptr<float>();
  p.out = out.data_ptr();
  // keys and values in f32 once (the kernel's blocks point into them)
  const int64_t T = q.size(0), Dp = (p.D + 15) / 16 * 16;
  p.ld_kt = prefill_ld_kt(T);
  p.tokens = T;
  const at::Tensor kv32 = kept_f32(p.KVH * p.D * p.ld_kt + T * p.KVH * Dp, q.options());
  float* const kt = kv32.data_ptr<float>();
  float* const vf32 = kt + p.KVH * p.D * p.ld_kt;
  if (dtype == at::kFloat) keys_values_f32<float>(kf, vf, p.ld_kt, Dp, kt, vf32);
  else if (dtype == at::kBFloat16) keys_values_f32<at::BFloat16>(kf, vf, p.ld_kt, Dp, kt, vf32);
  else keys_values_f32<at::Half>(kf, vf, p.ld_kt, Dp, kt, vf32);
  p.kt = kt;
  p.vf = vf32;
  const PrefillFn fn = pick(isa);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = threads_for(macs, n);
  parallel_items(n, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(prefill_scratch_floats(p));
    fn(p, begin, end, scratch.data());
  });
  return out;
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor sinks, "
        "float scale, int window, str isa=\"\") -> Tensor");
  m.def("prefill_isas() -> str[]", &kvrelay::prefill_isas);
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("prefill_attention", &kvrelay::prefill_attention);
}
