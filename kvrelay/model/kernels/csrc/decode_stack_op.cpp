// torch class `kvrelay_kernels.DecodeStack`: every decoder layer of a decode-only step in
// one native call (gpt_oss.py `GptOssModel.forward`, where `DecodeStack.usable` says so).
//
// Per layer it calls, through the dispatcher, the ops that `DecoderLayer.decode` calls from
// Python, with the same arguments and in the same order:
//
//   (residual, x) = add_rms_norm(residual, h)          rms_norm(h) for the first layer
//   qkv = dense_linear(x, Wqkv, bqkv)                  q and k heads, v: views of qkv
//   out = rotary_decode_attention(qk, v, ...)          RoPE, KV write, paged decode
//   (residual, x) = add_rms_norm(residual, dense_linear(out, Wo, bo))
//   h = moe_route_experts(x, router, experts)          router + top-k + experts
//
// so its results are bitwise that path's. What goes is the Python between the ops: ~6 op
// dispatches, the views and the module calls of each layer, whose cost grows in a real
// step (the weights streamed through the caches evict the interpreter's working set).
// The layers' weights are registered once (`add_layer`); a step passes only what changes
// per step. Single rank only (no all-reduce between the ops).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace kvrelay {
namespace {

using OptTensor = c10::optional<at::Tensor>;
using TensorPair = std::tuple<at::Tensor, at::Tensor>;

struct Layer {
  at::Tensor ln1, ln2;  // RMSNorm weights (f32)
  double eps1, eps2;
  at::Tensor qkv_w;
  OptTensor qkv_b;
  int64_t heads, kv_heads, head_dim, group, window;
  at::Tensor sinks;
  double scale;
  at::Tensor o_w;
  OptTensor o_b;
  at::Tensor router_w;
  OptTensor router_b;
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
      experts =
          op("kvrelay_kernels::moe_route_experts")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                int64_t, const at::Tensor&, const OptTensor&, const OptTensor&,
                                const at::Tensor&, const OptTensor&, const OptTensor&, double,
                                double, const std::string&)>();
};

const Ops& ops() {
  static const Ops all;
  return all;
}

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;

  void add_layer(at::Tensor ln1, double eps1, at::Tensor ln2, double eps2, at::Tensor qkv_w,
                 OptTensor qkv_b, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t group, at::Tensor sinks, double scale, int64_t window, at::Tensor o_w,
                 OptTensor o_b, at::Tensor router_w, OptTensor router_b, int64_t top_k,
                 int64_t first_expert, at::Tensor gate_up, OptTensor gate_up_scales,
                 OptTensor gate_up_bias, at::Tensor down, OptTensor down_scales,
                 OptTensor down_bias, double alpha, double limit) {
    TORCH_CHECK(qkv_w.dim() == 2 && qkv_w.size(0) == (heads + 2 * kv_heads) * head_dim,
                "DecodeStack: qkv weight must be [(heads + 2 kv_heads) * head_dim, hidden]");
    layers.push_back(Layer{ln1, ln2, eps1, eps2, qkv_w, qkv_b, heads, kv_heads, head_dim,
                           group, window, sinks, scale, o_w, o_b, router_w, router_b, top_k,
                           first_expert, gate_up, gate_up_scales, gate_up_bias, down,
                           down_scales, down_bias, alpha, limit});
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
    at::Tensor residual, x;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      if (i == 0) {
        residual = h;
        x = o.rms_norm.call(h, l.ln1, l.eps1);
      } else {
        std::tie(residual, x) = o.add_rms_norm.call(residual, h, l.ln1, l.eps1);
      }
      const at::Tensor qkv = o.linear.call(x, l.qkv_w, l.qkv_b, best);
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
          o.add_rms_norm.call(residual, o.linear.call(out, l.o_w, l.o_b, best), l.ln2, l.eps2);
      h = o.experts.call(x, l.router_w, l.router_b, l.top_k, l.first_expert, l.gate_up,
                         l.gate_up_scales, l.gate_up_bias, l.down, l.down_scales, l.down_bias,
                         l.alpha, l.limit, best);
    }
    return {h, residual};
  }
};

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.class_<kvrelay::DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &kvrelay::DecodeStack::add_layer)
      .def("size", &kvrelay::DecodeStack::size)
      .def("run", &kvrelay::DecodeStack::run);
}
