// torch op `kvrelay_kernels::rotary_decode_attention`: the attention of one layer for a
// decode-only step in one call, what the eager path does in about a dozen operator calls:
//
//   qk [T, h + kvh, D] (q and k heads of the qkv projection, rows may be strided),
//   v [T, kvh, D], positions [T], cos/sin [max_pos, D/2] f32 (RotaryEmbedding's tables)
//     1. rotate-half RoPE of the q and k heads at each token's position,
//     2. the rotated k and v rows into their slots of kv_cache [2, NB, kvh, B, D],
//     3. paged decode attention of the rotated q over the cache in place (the ISA build of
//        paged_decode_simd.h / paged_decode_generic.cpp, sinks and window as there),
//   → out [T, h · D] in qk's dtype (the o_proj input).
//
// Every rounding of the eager path is kept, so the result is bitwise that path's: RoPE in
// the activation dtype rounds cos/sin and each product, difference and sum to it (torch's
// reduced-precision elementwise ops compute each op in f32 and round), the decode kernel
// reads the rounded q in f32, and the f32 result is rounded to the dtype once.
//
// `kvrelay_kernels::route_topk(logits [T, E], k)` -> (weights [T, k] f32, ids [T, k] int64):
// the router's top-k and the softmax over the chosen logits in one call (`logits.topk(k)`
// then `softmax` in the logits' dtype, widened to f32 as the MoE kernel reads it). Ties go
// to the lower expert id (torch.topk leaves their order unspecified); the softmax is
// torch's own kernel (k = 1: exactly 1), so the weights are the eager router's bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <string>
#include <vector>

#include "moe.h"
#include "parallel.h"

namespace kvrelay {
namespace {

template <class X>
inline float rnd(float x) {   // x rounded to the activation dtype, as f32
  return static_cast<float>(X(x));
}

// Rotates the q and k heads of every token; q (rounded to X) into qf [T, h, D] f32, k and
// v (in X) into their cache slots (slot < 0: not written).
template <class X>
void rotate_and_write(const at::Tensor& qk, const at::Tensor& v, const int64_t* pos,
                      const float* cos, const float* sin, int64_t max_pos, X* cache,
                      const int64_t* slots, int64_t H, int64_t KVH, int64_t NB, int64_t B,
                      float* qf) {
  const int64_t T = qk.size(0), D = qk.size(2), half = D / 2;
  const X* qkp = static_cast<const X*>(qk.data_ptr());
  const X* vp = static_cast<const X*>(v.data_ptr());
  const int64_t qk_row = qk.stride(0), qk_head = qk.stride(1);
  const int64_t v_row = v.stride(0), v_head = v.stride(1);
  const int64_t v_plane = NB * KVH * B * D;
  std::vector<float> c(half), s(half);
  std::vector<X> k_rot(D);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_decode_attention: position ",
                pos[t], " outside the rotary table");
    for (int64_t i = 0; i < half; ++i) {
      c[i] = rnd<X>(cos[pos[t] * half + i]);
      s[i] = rnd<X>(sin[pos[t] * half + i]);
    }
    const int64_t slot = slots[t];
    TORCH_CHECK(slot < NB * B, "rotary_decode_attention: slot out of range");
    const int64_t blk = slot / B, off = slot % B;
    for (int64_t hd = 0; hd < H + KVH; ++hd) {
      const X* x = qkp + t * qk_row + hd * qk_head;
      if (hd < H) {
        float* out = qf + (t * H + hd) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
          out[i] = rnd<X>(rnd<X>(a * c[i]) - rnd<X>(b * s[i]));
          out[i + half] = rnd<X>(rnd<X>(b * c[i]) + rnd<X>(a * s[i]));
        }
        continue;
      }
      if (slot < 0) continue;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
        k_rot[i] = X(rnd<X>(a * c[i]) - rnd<X>(b * s[i]));
        k_rot[i + half] = X(rnd<X>(b * c[i]) + rnd<X>(a * s[i]));
      }
      const int64_t kh = hd - H;
      X* dst = cache + ((blk * KVH + kh) * B + off) * D;
      std::memcpy(dst, k_rot.data(), D * sizeof(X));
      std::memcpy(dst + v_plane, vp + t * v_row + kh * v_head, D * sizeof(X));
    }
  }
}

template <class X>
void to_dtype(const float* src, int64_t n, X* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = X(src[i]);
}

const at::Tensor& long_contiguous(const at::Tensor& t, at::Tensor& holder) {
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return t;
  holder = t.to(at::kLong).contiguous();
  return holder;
}

at::Tensor rotary_decode_attention(const at::Tensor& qk, const at::Tensor& v,
                                   const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& kv_cache,
                                   const at::Tensor& slots, const at::Tensor& block_table,
                                   const at::Tensor& seq_lens, const at::Tensor& sinks,
                                   double scale, int64_t window, const std::string& isa) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5,
              "rotary_decode_attention: qk [T, h+kvh, D], v [T, kvh, D], "
              "kv_cache [2, NB, kvh, B, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const at::ScalarType dt = kv_cache.scalar_type();
  TORCH_CHECK(qk.scalar_type() == dt && v.scalar_type() == dt,
              "rotary_decode_attention: qk, v and kv_cache dtypes differ");
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1, "head rows must be contiguous");
  const int64_t T = qk.size(0), D = qk.size(2);
  const int64_t NB = kv_cache.size(1), KVH = kv_cache.size(2), B = kv_cache.size(3);
  const int64_t H = qk.size(1) - KVH;
  TORCH_CHECK(H > 0 && H % KVH == 0 && D % 2 == 0 && kv_cache.size(4) == D &&
                  v.size(0) == T && v.size(1) == KVH && v.size(2) == D,
              "rotary_decode_attention: head shapes do not match");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "rotary_decode_attention: cos/sin [max_pos, D/2] float32");
  at::Tensor pos_h, slot_h, table_h, lens_h;
  const at::Tensor& pos = long_contiguous(positions, pos_h);
  const at::Tensor& sl = long_contiguous(slots, slot_h);
  const at::Tensor& table = long_contiguous(block_table, table_h);
  const at::Tensor& lens = long_contiguous(seq_lens, lens_h);
  const at::Tensor sk = sinks.to(at::kFloat).contiguous();
  TORCH_CHECK(pos.numel() == T && sl.numel() == T && table.dim() == 2 &&
                  table.size(0) >= T && lens.numel() >= T && sk.numel() == H,
              "rotary_decode_attention: positions/slots [T], block_table [S>=T, max_blocks], "
              "seq_lens [S>=T], sinks [h]");

  // f32 scratch for the rotated q and the attention output, kept per thread across calls
  thread_local std::vector<float> buf;
  buf.resize(size_t(2 * T * H * D));
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* qp = buf.data();
  DecodeProblem p{};
  switch (dt) {
    case at::kBFloat16:
      rotate_and_write(qk, v, pp, cp, snp, cos.size(0),
                       static_cast<c10::BFloat16*>(kv_cache.data_ptr()), sp, H, KVH, NB, B, qp);
      p.format = kKvBF16;
      break;
    case at::kHalf:
      rotate_and_write(qk, v, pp, cp, snp, cos.size(0),
                       static_cast<c10::Half*>(kv_cache.data_ptr()), sp, H, KVH, NB, B, qp);
      p.format = kKvF16;
      break;
    case at::kFloat:
      rotate_and_write(qk, v, pp, cp, snp, cos.size(0),
                       static_cast<float*>(kv_cache.data_ptr()), sp, H, KVH, NB, B, qp);
      p.format = kKvF32;
      break;
    default:
      TORCH_CHECK(false, "rotary_decode_attention: float32, bfloat16 or float16 only");
  }

  at::Tensor out = at::empty({T, H * D}, qk.options());
  p.S = T, p.H = H, p.D = D, p.NB = NB, p.KVH = KVH, p.B = B;
  p.q = qp;
  p.kv = kv_cache.data_ptr();
  p.table = table.data_ptr<int64_t>();
  p.lens = lens.data_ptr<int64_t>();
  p.sinks = sk.data_ptr<float>();
  p.out = buf.data() + T * H * D;
  p.maxb = table.size(1);
  p.window = window;
  p.scale = static_cast<float>(scale);
  const IsaKernels& kernels = isa_kernels(isa.c_str());   // "": the best for this CPU
  const DecodeFn fn = decode_fn_for(kernels.name, kernels.decode);
  int64_t positions_seen = 0;   // work: each visible position costs 2·D MACs per query head
  for (int64_t s = 0; s < T; ++s)
    positions_seen += window > 0 ? std::min(p.lens[s], window) : p.lens[s];
  const int64_t tasks = T * KVH;
  const int64_t threads = threads_for(positions_seen * 2 * D * H, tasks);
  const int64_t chunk = std::max<int64_t>(1, tasks / (8 * threads));
  parallel_items(tasks, threads, chunk, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(decode_scratch_floats(p));
    fn(p, begin, end, scratch.data());
  });
  switch (dt) {   // rounded to the dtype once, as `.to(dtype)` of the f32 result does
    case at::kBFloat16:
      to_dtype(p.out, T * H * D, static_cast<c10::BFloat16*>(out.data_ptr()));
      break;
    case at::kHalf:
      to_dtype(p.out, T * H * D, static_cast<c10::Half*>(out.data_ptr()));
      break;
    default:
      to_dtype(p.out, T * H * D, out.data_ptr<float>());
  }
  return out;
}

// the k largest logits of each row, largest first (ties: the lower expert id first)
template <class X>
void route_rows(const X* logits, int64_t T, int64_t E, int64_t k, X* top_out, int64_t* ids) {
  std::vector<float> top(k);
  for (int64_t t = 0; t < T; ++t) {
    const X* row = logits + t * E;
    int64_t* id = ids + t * k;
    int64_t n = 0;   // insertion into the sorted top k: larger first, equal keeps order
    for (int64_t e = 0; e < E; ++e) {
      const float x = static_cast<float>(row[e]);
      if (n == k && !(x > top[k - 1])) continue;
      int64_t i = n < k ? n++ : k - 1;
      for (; i > 0 && x > top[i - 1]; --i) {
        top[i] = top[i - 1];
        id[i] = id[i - 1];
      }
      top[i] = x;
      id[i] = e;
    }
    for (int64_t i = 0; i < k; ++i) top_out[t * k + i] = X(top[i]);
  }
}

std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& logits_in, int64_t k) {
  TORCH_CHECK(logits_in.dim() == 2 && k >= 1 && k <= logits_in.size(1),
              "route_topk: logits [T, E] and 1 <= k <= E");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor top = at::empty({T, k}, logits.options());
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  int64_t* ip = ids.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kBFloat16:
      route_rows(logits.data_ptr<c10::BFloat16>(), T, E, k, top.data_ptr<c10::BFloat16>(), ip);
      break;
    case at::kHalf:
      route_rows(logits.data_ptr<c10::Half>(), T, E, k, top.data_ptr<c10::Half>(), ip);
      break;
    case at::kFloat:
      route_rows(logits.data_ptr<float>(), T, E, k, top.data_ptr<float>(), ip);
      break;
    default:
      TORCH_CHECK(false, "route_topk: float32, bfloat16 or float16 logits");
  }
  // one choice: softmax is exactly 1; more: torch's own softmax kernel, so the weights are
  // bitwise the eager router's
  if (k == 1) return {at::ones({T, 1}, logits.options().dtype(at::kFloat)), ids};
  return {at::softmax(top, -1).to(at::kFloat), ids};
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("rotary_decode_attention(Tensor qk, Tensor v, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor(a!) kv_cache, Tensor slots, Tensor block_table, Tensor seq_lens, "
        "Tensor sinks, float scale, int window, str isa=\"\") -> Tensor");
  m.def("route_topk(Tensor logits, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("rotary_decode_attention", &kvrelay::rotary_decode_attention);
  m.impl("route_topk", &kvrelay::route_topk);
}
