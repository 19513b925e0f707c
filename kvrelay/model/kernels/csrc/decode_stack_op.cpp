// torch class `kvrelay_kernels.DecodeStack`: every decoder layer of a decode-only step in
// one native call (gpt_oss.py `GptOssModel.forward`, where `DecodeStack.usable` says so).
//
// Per layer it calls, through the dispatcher, the ops that `DecoderLayer.forward` (given a `FusedDecode`) calls from
// Python, with the same arguments and in the same order:
//
//   (residual, x) = add_rms_norm(residual, h)          rms_norm(h) for the first layer
//   qkv = linear(x, Wqkv, bqkv)                        q and k heads, v: views of qkv
//   out = rotary_decode_attention(qk, v, ...)          RoPE, KV write, paged decode
//   (residual, x) = add_rms_norm(residual, linear(out, Wo, bo))
//   h = moe_route_experts(x, router, experts)          router (dense) + top-k + experts
//     or route_topk(linear(x, Wr, br)) then moe_experts
//
// so its results are bitwise that path's. Each `linear` is computed in the form that
// `layers/linear.py` computes it for the batch (`set_forms`, per batch size and thread count;
// every product on the dense kernel where none was set): the dense kernel (`dense_linear`),
// the ordered kernel where it was checked to give torch's fp32 GEMM's bits
// (`dense_ordered_linear` on a packed copy, `set_ordered`; layers/ordered.py), or torch's fp32
// GEMM itself (the weights upcast per call, as `linear` does from its row threshold).
// What goes is the Python between the ops: ~6 op dispatches, the views and the module calls
// of each layer, whose cost grows in a real step (the weights streamed through the caches
// evict the interpreter's working set).
// The layers' weights are registered once (`add_layer`); a step passes only what changes
// per step. Single rank only (no all-reduce between the ops).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kvrelay {
namespace {

using OptTensor = c10::optional<at::Tensor>;
using TensorPair = std::tuple<at::Tensor, at::Tensor>;

// How a product runs (`set_forms`; layers/linear.py STACK_*).
enum Form : int64_t { kDense = 0, kOrdered = 1, kFp32 = 2 };
// The products of a layer, in `set_forms` / `set_ordered` order.
enum Which : int64_t { kQkv = 0, kOut = 1, kRouter = 2, kProducts = 3 };

int64_t version(const at::Tensor& t) { return t.is_inference() ? 0 : t._version(); }

// One weight (and bias), and its ordered kernel's operands where registered.
struct Product {
  at::Tensor w;
  OptTensor b;
  at::Tensor packed;       // undefined: no ordered form
  OptTensor packed_bias;
  int64_t kc = 0;
  int64_t w_version = -1, b_version = -1;   // when packed

  // Whether the packed copy was made from the weight and bias as they are now.
  bool packed_current() const {
    return packed.defined() && version(w) == w_version &&
           (!b.has_value() || version(*b) == b_version);
  }
};

struct Layer {
  at::Tensor ln1, ln2;  // RMSNorm weights (f32)
  double eps1, eps2;
  Product qkv;
  int64_t heads, kv_heads, head_dim, group, window;
  at::Tensor sinks;
  double scale;
  Product o;
  Product router;
  int64_t top_k, first_expert;
  at::Tensor gate_up;
  OptTensor gate_up_scales, gate_up_bias;
  at::Tensor down;
  OptTensor down_scales, down_bias;
  double alpha, limit;
};

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op("kvrelay_kernels::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                       double)>();
  c10::TypedOperatorHandle<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double)>
      add_rms_norm = op("kvrelay_kernels::add_rms_norm")
                         .typed<TensorPair(const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      const std::string&)>
      linear = op("kvrelay_kernels::dense_linear")
                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                     const std::string&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool,
                                      const OptTensor&, int64_t, const std::string&)>
      ordered = op("kvrelay_kernels::dense_ordered_linear")
                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool,
                                      const OptTensor&, int64_t, const std::string&)>();
  c10::TypedOperatorHandle<TensorPair(const at::Tensor&, int64_t)> route_topk =
      op("kvrelay_kernels::route_topk").typed<TensorPair(const at::Tensor&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, double, int64_t, const std::string&)>
      attention =
          op("kvrelay_kernels::rotary_decode_attention")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t, const std::string&)>();
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, int64_t,
      const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
      const OptTensor&, const OptTensor&, double, double, const std::string&)>
      route_experts =
          op("kvrelay_kernels::moe_route_experts")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                int64_t, const at::Tensor&, const OptTensor&, const OptTensor&,
                                const at::Tensor&, const OptTensor&, const OptTensor&, double,
                                double, const std::string&)>();
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
      const OptTensor&, const OptTensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
      double, double, const std::string&)>
      experts =
          op("kvrelay_kernels::moe_experts")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                const at::Tensor&, const OptTensor&, const OptTensor&,
                                const at::Tensor&, const OptTensor&, const OptTensor&, double,
                                double, const std::string&)>();
};

const Ops& ops() {
  static const Ops all;
  return all;
}

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;
  // (rows, threads) -> each layer's forms, kProducts per layer (`set_forms`)
  std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> forms;

  void add_layer(at::Tensor ln1, double eps1, at::Tensor ln2, double eps2, at::Tensor qkv_w,
                 OptTensor qkv_b, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t group, at::Tensor sinks, double scale, int64_t window, at::Tensor o_w,
                 OptTensor o_b, at::Tensor router_w, OptTensor router_b, int64_t top_k,
                 int64_t first_expert, at::Tensor gate_up, OptTensor gate_up_scales,
                 OptTensor gate_up_bias, at::Tensor down, OptTensor down_scales,
                 OptTensor down_bias, double alpha, double limit) {
    TORCH_CHECK(qkv_w.dim() == 2 && qkv_w.size(0) == (heads + 2 * kv_heads) * head_dim,
                "DecodeStack: qkv weight must be [(heads + 2 kv_heads) * head_dim, hidden]");
    layers.push_back(Layer{ln1, ln2, eps1, eps2, Product{qkv_w, qkv_b}, heads, kv_heads,
                           head_dim, group, window, sinks, scale, Product{o_w, o_b},
                           Product{router_w, router_b}, top_k, first_expert, gate_up,
                           gate_up_scales, gate_up_bias, down, down_scales, down_bias, alpha,
                           limit});
  }

  // The ordered kernel's operands for product `which` of layer `layer` (layers/ordered.py's
  // packed copy of its weight, bias and k block), made from the weight and bias as they are
  // now: a later change to either in place turns the ordered form back into the fp32 GEMM.
  void set_ordered(int64_t layer, int64_t which, at::Tensor packed, OptTensor packed_bias,
                   int64_t kc) {
    TORCH_CHECK(layer >= 0 && layer < size() && which >= 0 && which < kProducts,
                "DecodeStack.set_ordered: no product ", which, " in layer ", layer);
    Product& p = product(layers[layer], which);
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == p.w.size(1),
                "DecodeStack.set_ordered: packed must be [blocks, K, 16] of the weight's K");
    p.packed = packed;
    p.packed_bias = packed_bias;
    p.kc = kc;
    p.w_version = version(p.w);
    p.b_version = p.b.has_value() ? version(*p.b) : -1;
  }

  // How each product runs for a batch of `rows` on `threads` threads: Form codes,
  // kProducts per layer (qkv, o_proj, router).
  void set_forms(int64_t rows, int64_t threads, std::vector<int64_t> layer_forms) {
    TORCH_CHECK(layer_forms.size() == layers.size() * kProducts,
                "DecodeStack.set_forms: ", kProducts, " forms per layer");
    for (size_t i = 0; i < layer_forms.size(); ++i) {
      const int64_t f = layer_forms[i];
      TORCH_CHECK(f == kDense || f == kFp32 ||
                      (f == kOrdered && product(layers[i / kProducts], i % kProducts)
                                            .packed.defined()),
                  "DecodeStack.set_forms: form ", f, " for product ", i % kProducts,
                  " of layer ", i / kProducts);
    }
    forms[{rows, threads}] = std::move(layer_forms);
  }

  int64_t size() const { return int64_t(layers.size()); }

  // h [T, H] (the embeddings) -> (the last layer's MoE output, the residual stream)
  TensorPair run(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                 std::vector<at::Tensor> kv_caches, std::vector<at::Tensor> slots,
                 std::vector<at::Tensor> tables, at::Tensor seq_lens) const {
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack: one KV cache per layer");
    const Ops& o = ops();
    static const std::string best;  // "": each op's best ISA, as the Python path asks
    const int64_t T = h.size(0);
    const auto set = forms.find({T, int64_t(at::get_num_threads())});
    const int64_t* form = set == forms.end() ? nullptr : set->second.data();
    at::Tensor residual, x;
    for (size_t i = 0; i < layers.size(); ++i, form = form ? form + kProducts : nullptr) {
      const Layer& l = layers[i];
      const auto form_of = [form](Which which) { return form ? form[which] : int64_t(kDense); };
      if (i == 0) {
        residual = h;
        x = o.rms_norm.call(h, l.ln1, l.eps1);
      } else {
        std::tie(residual, x) = o.add_rms_norm.call(residual, h, l.ln1, l.eps1);
      }
      const at::Tensor qkv = project(o, l.qkv, form_of(kQkv), x);
      const int64_t qk_cols = (l.heads + l.kv_heads) * l.head_dim;
      const at::Tensor qk = qkv.narrow(1, 0, qk_cols).view({T, l.heads + l.kv_heads, l.head_dim});
      const at::Tensor v =
          qkv.narrow(1, qk_cols, l.kv_heads * l.head_dim).view({T, l.kv_heads, l.head_dim});
      TORCH_CHECK(l.group >= 0 && size_t(l.group) < slots.size() && size_t(l.group) < tables.size(),
                  "DecodeStack: no slots / block table for KV-cache group ", l.group);
      const at::Tensor out =
          o.attention.call(qk, v, positions, cos, sin, kv_caches[i], slots[l.group],
                           tables[l.group], seq_lens, l.sinks, l.scale, l.window, best);
      std::tie(residual, x) =
          o.add_rms_norm.call(residual, project(o, l.o, form_of(kOut), out), l.ln2, l.eps2);
      h = experts(o, l, form_of(kRouter), x);
    }
    return {h, residual};
  }

 private:
  static Product& product(Layer& l, int64_t which) {
    return which == kQkv ? l.qkv : which == kOut ? l.o : l.router;
  }

  // `linear(x, p.w, p.b)` in the given form (layers/linear.py computes it so for this batch).
  static at::Tensor project(const Ops& o, const Product& p, int64_t form,
                            const at::Tensor& x) {
    static const std::string best;
    if (form == kDense) return o.linear.call(x, p.w, p.b, best);
    if (form == kOrdered && p.packed_current())   // x's dtype out, rounded once
      return o.ordered.call(x, p.packed, p.w.size(0), false, p.packed_bias, p.kc, best);
    // torch's fp32 GEMM, as `linear` computes it from its row threshold: the operands upcast
    // (a no-op for float32), the result rounded to x's dtype
    const OptTensor b = p.b.has_value() ? OptTensor(p.b->to(at::kFloat)) : c10::nullopt;
    return at::linear(x.to(at::kFloat), p.w.to(at::kFloat), b).to(x.scalar_type());
  }

  // The MoE block: the router on the dense kernel fused with the experts where it runs there
  // (`Experts.route_forward`'s fused call), else the router's linear, its top-k and the experts.
  static at::Tensor experts(const Ops& o, const Layer& l, int64_t router_form,
                            const at::Tensor& x) {
    static const std::string best;
    if (router_form == kDense)
      return o.route_experts.call(x, l.router.w, l.router.b, l.top_k, l.first_expert,
                                  l.gate_up, l.gate_up_scales, l.gate_up_bias, l.down,
                                  l.down_scales, l.down_bias, l.alpha, l.limit, best);
    const auto [weights, ids] = o.route_topk.call(project(o, l.router, router_form, x), l.top_k);
    return o.experts.call(x, weights, ids, l.first_expert, l.gate_up, l.gate_up_scales,
                          l.gate_up_bias, l.down, l.down_scales, l.down_bias, l.alpha, l.limit,
                          best);
  }
};

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.class_<kvrelay::DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &kvrelay::DecodeStack::add_layer)
      .def("set_ordered", &kvrelay::DecodeStack::set_ordered)
      .def("set_forms", &kvrelay::DecodeStack::set_forms)
      .def("size", &kvrelay::DecodeStack::size)
      .def("run", &kvrelay::DecodeStack::run);
}
