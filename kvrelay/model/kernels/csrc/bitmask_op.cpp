// torch op `kvrelay_kernels::grammar_rows`: one pass over the grammar rows of a sampling
// step, straight from llguidance's bitmask words (kvrelay/structured/masks.py holds the
// PyTorch reference and documents the contract). Per row, by its mode:
//   0 (sampled)     few allowed words (<= sparse_words): its allowed ids, for the sampler to
//                   draw among; else its disallowed logits set to -inf in place
//   1 (plain greedy) the masked argmax, read from the logits and the bits (no masked copy)
//   2 (mask only)   disallowed logits to -inf in place (rows with logits processors)
// A row that allows nothing is left free (-3). Rows run in parallel over torch's threads;
// the row kernels are compiled per ISA (#pragma GCC target) and picked at run time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"
#include "isa_dispatch.h"
#include "parallel.h"

namespace kvrelay {
namespace bitmask_generic {
#include "bitmask_impl.h"
}  // namespace bitmask_generic

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
KVRELAY_TARGET(KVRELAY_ISA_AVX2)
namespace bitmask_avx2 {
#include "bitmask_impl.h"
}  // namespace bitmask_avx2
#pragma GCC pop_options
#pragma GCC push_options
KVRELAY_TARGET(KVRELAY_ISA_AVX512)
namespace bitmask_avx512 {
#include "bitmask_impl.h"
}  // namespace bitmask_avx512
#pragma GCC pop_options
#endif

namespace {

using ArgmaxFn = int64_t (*)(const float*, const uint32_t*, int64_t, int64_t);
using MaskFn = void (*)(float*, const uint32_t*, int64_t, int64_t);
using RowTopkFn = void (*)(const float*, int64_t, int64_t, float*, int64_t*);

struct BitmaskKernels {
  const char* name;
  ArgmaxFn argmax;
  MaskFn mask;
  RowTopkFn row_topk;
};

const Variants<BitmaskKernels>& variants() {  // best first
  static const Variants<BitmaskKernels> all = [] {
    Variants<BitmaskKernels> v("grammar_rows");
#if defined(__x86_64__) || defined(__i386__)
    v.add(Isa::kAvx512, [](BitmaskKernels* k) {
      *k = {"avx512", bitmask_avx512::masked_argmax, bitmask_avx512::mask_row,
            bitmask_avx512::row_topk};
      return true;
    });
    v.add(Isa::kAvx2, [](BitmaskKernels* k) {
      *k = {"avx2", bitmask_avx2::masked_argmax, bitmask_avx2::mask_row, bitmask_avx2::row_topk};
      return true;
    });
#endif
    v.add(Isa::kGeneric, [](BitmaskKernels* k) {
      *k = {"generic", bitmask_generic::masked_argmax, bitmask_generic::mask_row,
            bitmask_generic::row_topk};
      return true;
    });
    return v;
  }();
  return all;
}

const BitmaskKernels& pick(const std::string& isa) { return variants().pick(isa); }

constexpr int64_t kIds = -1, kMasked = -2, kNone = -3;

std::tuple<at::Tensor, at::Tensor, at::Tensor> grammar_rows(
    const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
    const at::Tensor& modes, int64_t sparse_words, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "grammar_rows: logits must be contiguous float32 [N, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0),
              "grammar_rows: bitmask must be contiguous int32 [N, words]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && modes.scalar_type() == at::kLong &&
                  rows.dim() == 1 && modes.sizes() == rows.sizes(),
              "grammar_rows: rows and modes must be int64 [k]");
  const BitmaskKernels& fn = pick(isa);
  const at::Tensor r = rows.contiguous(), md = modes.contiguous();
  const int64_t k = r.numel(), V = logits.size(1), W = bitmask.size(1);
  const int64_t words = std::min<int64_t>(W, (V + 31) / 32);   // words that cover logits
  const int64_t* row = r.data_ptr<int64_t>();
  const int64_t* mode = md.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < logits.size(0) && mode[j] >= 0 && mode[j] <= 2,
                "grammar_rows: row or mode out of range");
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::Tensor tokens = at::empty({k}, r.options());
  at::Tensor offsets = at::empty({k + 1}, r.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  // pass 1 (word scans only): each row's kind, and the id count of the sparse ones
  std::vector<int64_t> count(k, 0);
  parallel_items(k, threads_for(k * W * 16, k), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint32_t* b = bits + row[j] * W;
      int64_t nonzero = 0, ids = 0;
      for (int64_t w = 0; w < W; ++w) nonzero += b[w] != 0;
      if (nonzero == 0) {
        tok[j] = kNone;
      } else if (mode[j] == 0 && nonzero <= sparse_words) {
        tok[j] = kIds;
        for (int64_t w = 0; w < words; ++w) {
          const int64_t n = V - 32 * w;
          const uint32_t live = n >= 32 ? b[w] : (b[w] & ((1u << n) - 1u));
          ids += __builtin_popcount(live);
        }
        count[j] = ids;
      } else {
        tok[j] = mode[j] == 1 ? 0 : kMasked;
      }
    }
  });
  off[0] = 0;
  for (int64_t j = 0; j < k; ++j) off[j + 1] = off[j] + count[j];
  at::Tensor ids = at::empty({off[k]}, r.options());
  int64_t* out = ids.data_ptr<int64_t>();
  // pass 2: the ids, argmaxes and masks (a full-row pass for the dense ones)
  parallel_items(k, threads_for(k * V, k), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint32_t* b = bits + row[j] * W;
      float* xr = x + row[j] * V;
      if (tok[j] == kIds) {
        int64_t* o = out + off[j];
        for (int64_t w = 0; w < words; ++w) {
          uint32_t live = b[w];
          while (live != 0) {
            const int64_t t = 32 * w + __builtin_ctz(live);
            live &= live - 1;
            if (t < V) *o++ = t;
          }
        }
      } else if (tok[j] == kMasked) {
        fn.mask(xr, b, words, V);
      } else if (tok[j] >= 0) {
        const int64_t t = fn.argmax(xr, b, words, V);
        tok[j] = t < 0 ? kNone : t;
      }
    }
  });
  return {tokens, offsets, ids};
}

// The k best logits of rows `rows`, best first, ties by lower id: (values [n, k] float32,
// ids [n, k] int64). For the speculative check of greedy grammar rows (structured/masks.py).
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& logits, const at::Tensor& rows,
                                             int64_t k, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "topk_rows: logits must be contiguous float32 [N, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "topk_rows: rows int64 [n]");
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "topk_rows: need 1 <= k <= V");
  const BitmaskKernels& fn = pick(isa);
  const at::Tensor r = rows.contiguous();
  const int64_t n = r.numel(), V = logits.size(1);
  const int64_t* row = r.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < logits.size(0), "topk_rows: row out of range");
  const float* x = logits.data_ptr<float>();
  at::Tensor values = at::empty({n, k}, logits.options());
  at::Tensor ids = at::empty({n, k}, r.options());
  float* v = values.data_ptr<float>();
  int64_t* t = ids.data_ptr<int64_t>();
  parallel_items(n, threads_for(n * V, n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) fn.row_topk(x + row[j] * V, V, k, v + j * k, t + j * k);
  });
  return {values, ids};
}

std::vector<std::string> grammar_isas() { return variants().names(); }

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("grammar_rows(Tensor(a!) logits, Tensor bitmask, Tensor rows, Tensor modes, "
        "int sparse_words, str isa=\"\") -> (Tensor, Tensor, Tensor)");
  m.def("topk_rows(Tensor logits, Tensor rows, int k, str isa=\"\") -> (Tensor, Tensor)");
  m.def("grammar_isas() -> str[]", &kvrelay::grammar_isas);
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("grammar_rows", &kvrelay::grammar_rows);
  m.impl("topk_rows", &kvrelay::topk_rows);
}
