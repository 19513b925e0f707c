// torch op `kvrelay_kernels::argmax_rows`: the greedy sampler's argmax of every logits row,
// float32 [N, V] (rows may be strided, tokens contiguous) -> int64 [N], with torch.argmax's
// answer on every input: the first maximal index, the first NaN where a row has one (torch
// orders NaN above everything), 0 for a row of -inf.
//
// torch.argmax over a 201k vocabulary runs at ~5 GB/s on one thread (9 ms for 64 rows
// here); this is one pass per row over 32 interleaved lanes (dense_argmax.h's fold, which
// the dense ops' greedy forms share), auto-vectorised, ~25 GB/s. One body, compiled per ISA
// with GCC's function target attributes and chosen at run time, as the other ops choose theirs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "isa.h"
#include "isa_dispatch.h"
#include "parallel.h"

namespace kvrelay {
namespace {

#include "dense_argmax.h"

constexpr int kLanes = 32;

// Inlined into each ISA's wrapper below, with the fold's steps (dense_argmax.h says why).
KVRELAY_ALWAYS_INLINE int64_t row_argmax(const float* x, int64_t V) {
  float best[kLanes];
  int32_t at[kLanes];
  argmax_lanes_reset<kLanes>(best, at);
  bool nan = false;
  const int64_t full = V / kLanes;
  for (int64_t j = 0; j < full; ++j)
    nan |= argmax_lanes_step<kLanes>(best, at, static_cast<int32_t>(j), ArgmaxF32{x + kLanes * j});
  nan |= argmax_lanes_tail<kLanes>(best, at, static_cast<int32_t>(full), V - kLanes * full,
                                   ArgmaxF32{x + kLanes * full});   // the partial last block
  if (nan) return argmax_first_nan(V, ArgmaxF32{x});
  float value = -__builtin_inff();
  int64_t token = -1;
  argmax_lanes_best<kLanes>(best, at, &value, &token);
  return token < 0 ? 0 : token;                          // every value -inf: the first
}

using ArgmaxFn = int64_t (*)(const float*, int64_t);

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
__attribute__((target(KVRELAY_ISA_AVX512)))
#else
__attribute__((target(KVRELAY_ISA_AVX512 ",prefer-vector-width=512")))
#endif
int64_t argmax_avx512(const float* x, int64_t V) { return row_argmax(x, V); }

__attribute__((target(KVRELAY_ISA_AVX2))) int64_t argmax_avx2(const float* x, int64_t V) {
  return row_argmax(x, V);
}
#endif

int64_t argmax_generic(const float* x, int64_t V) { return row_argmax(x, V); }

template <ArgmaxFn fn>
bool build(ArgmaxFn* out) {
  *out = fn;
  return true;
}

const Variants<ArgmaxFn>& isas() {                       // best first
  static const Variants<ArgmaxFn> all = [] {
    Variants<ArgmaxFn> v("argmax_rows");
#if defined(__x86_64__) || defined(__i386__)
    v.add(Isa::kAvx512, &build<argmax_avx512>).add(Isa::kAvx2, &build<argmax_avx2>);
#endif
    v.add(Isa::kGeneric, &build<argmax_generic>);
    return v;
  }();
  return all;
}

ArgmaxFn pick(const std::string& isa) { return isas().pick(isa); }

at::Tensor argmax_rows(const at::Tensor& logits, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.device().is_cpu() && (logits.size(1) <= 1 || logits.stride(1) == 1),
              "argmax_rows: logits must be CPU float32 [N, V] with contiguous rows");
  const int64_t n = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(V >= 1, "argmax_rows: an empty row has no argmax");
  TORCH_CHECK(V / kLanes < (int64_t(1) << 31), "argmax_rows: rows over 2^36 values");
  const ArgmaxFn fn = pick(isa);
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  parallel_items(n, threads_for(n * V, n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) tok[r] = fn(x + r * stride, V);
  });
  return out;
}

std::vector<std::string> argmax_isas() { return isas().names(); }

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("argmax_rows(Tensor logits, str isa=\"\") -> Tensor");
  m.def("argmax_isas() -> str[]", &kvrelay::argmax_isas);
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) { m.impl("argmax_rows", &kvrelay::argmax_rows); }
