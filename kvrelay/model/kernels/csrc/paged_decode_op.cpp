// torch ops `kvrelay_kernels::paged_decode` and `kvrelay_kernels::write_kv`: decode
// attention over the paged KV cache read in place (paged_decode.h), run in the best ISA
// build this CPU supports over (sequence, KV head) work items, and the copy of new K/V
// rows into their slots.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "moe.h"
#include "parallel.h"

namespace kvrelay {
namespace {

int32_t kv_format(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kKvF32;
    case at::kBFloat16: return kKvBF16;
    case at::kHalf: return kKvF16;
    default: TORCH_CHECK(false, "paged_decode: the KV cache must be float32, bfloat16 or float16");
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& sinks, double scale, int64_t window,
                        const std::string& isa) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q [S,h,hd], kv_cache [2,NB,kvh,B,hd]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const at::Tensor sk = sinks.to(at::kFloat).contiguous();
  DecodeProblem p{};
  p.S = q.size(0), p.H = q.size(1), p.D = q.size(2);
  p.NB = kv_cache.size(1), p.KVH = kv_cache.size(2), p.B = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == p.D && p.H % p.KVH == 0, "head shapes do not match");
  TORCH_CHECK(table.dim() == 2 && table.size(0) >= p.S && lens.size(0) >= p.S &&
                  sk.numel() == p.H,
              "paged_decode: block_table [S, max_blocks], seq_lens [S], sinks [h]");
  at::Tensor out = at::empty({p.S, p.H, p.D}, qf.options());
  p.format = kv_format(kv_cache.scalar_type());
  p.q = qf.data_ptr<float>();
  p.kv = kv_cache.data_ptr();
  p.table = table.data_ptr<int64_t>();
  p.lens = lens.data_ptr<int64_t>();
  p.sinks = sk.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.maxb = table.size(1);
  p.window = window;
  p.scale = static_cast<float>(scale);
  const IsaKernels& kernels = isa_kernels(isa.c_str());   // "": the best for this CPU
  const DecodeFn fn = decode_fn_for(kernels.name, kernels.decode);
  // work: every visible position costs 2·D multiply-adds per query head
  int64_t positions = 0;
  for (int64_t s = 0; s < p.S; ++s)
    positions += p.window > 0 ? std::min(p.lens[s], p.window) : p.lens[s];
  const int64_t tasks = p.S * p.KVH;
  const int64_t threads = threads_for(positions * 2 * p.D * p.H, tasks);
  const int64_t chunk = std::max<int64_t>(1, tasks / (8 * threads));
  parallel_items(tasks, threads, chunk, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(decode_scratch_floats(p));
    fn(p, begin, end, scratch.data());
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// new keys/values [T, kvh, hd] into their slots (block * B + offset; -1: not written)
void write_kv(const at::Tensor& kv_cache, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache [2,NB,kvh,B,hd]");
  TORCH_CHECK(k_in.scalar_type() == kv_cache.scalar_type() &&
                  v_in.scalar_type() == k_in.scalar_type(),
              "k, v and kv_cache dtypes differ");
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor sl = slots.to(at::kLong).contiguous();
  const int64_t T = k.size(0), NB = kv_cache.size(1), KVH = kv_cache.size(2);
  const int64_t B = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == KVH && k.size(2) == D && v.sizes() == k.sizes() &&
                  sl.size(0) == T,
              "k/v/slot shapes");
  const int64_t esize = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* s = sl.data_ptr<int64_t>();
  const int64_t v_off = NB * KVH * B * D;
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < NB * B, "slot out of range");
    const int64_t blk = s[t] / B, off = s[t] % B;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blk * KVH + h) * B + off) * D;
      std::memcpy(cache + dst * esize, kp + (t * KVH + h) * D * esize, D * esize);
      std::memcpy(cache + (dst + v_off) * esize, vp + (t * KVH + h) * D * esize, D * esize);
    }
  }
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor sinks, float scale, int window, str isa=\"\") -> Tensor");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("paged_decode", &kvrelay::paged_decode);
  m.impl("write_kv", &kvrelay::write_kv);
}
