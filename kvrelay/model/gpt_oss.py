"""gpt-oss as an inference model over a flattened batch of variable-length sequences.

    token ids [T] ─ embed ─▶ h [T, H]
      for each layer:  h += o_proj(attn(rope(qkv(norm(h)))))    sinks, window on sliding layers
                       h += moe(norm(h))                          top-k router, grouped experts
    norm ─ lm_head ─▶ logits [T', V]                              only rows the caller asks for

Each residual add is done by the norm that reads its result (`RMSNorm.add_forward`: one
native pass for decode-sized steps), so a layer returns its MoE output and the residual
stream separately and the next layer (or the final norm) adds them.

A layer has one step, `DecoderLayer.forward`, the same math for every step. The model
decides once per step whether it is decode-only with the fused native ops
(`GptOssModel.fused_step`: the plan's `fused_decode`, every token a decode, eager, one
replica) and hands the layers that choice (`FusedDecode`, or None); the two submodules
that have a fused op pick it from there: RoPE, the KV write and the paged attention as one
native call (`PagedAttention.rope_attend`), the router (linear, `route_topk`) and the
experts as another (`Experts.route_forward`). Their results are bitwise the separate ops'
(tests/model/test_paged_decode.py, tests/model/test_fused_decode_layer.py). Where the plan
also says `decode_stack`, such a step runs that same per-layer path for every layer from
C++ (`DecodeStack`), at batch sizes where each layer's ops are all native. Tests and
profilers choose through the plan: `model.use_plan(dataclasses.replace(model.plan,
decode_stack=False))`.

Everything per step arrives in `AttentionMetadata` (query/context lengths, block
tables and slot mappings per KV-cache group). Each layer owns a KV cache tensor
`[2, num_blocks, kv_heads_local, block_size, head_dim]`, allocated by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvrelay.model import execution_plan
from kvrelay.model.config import FULL, GptOssConfig
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers.attention import AttentionMetadata, FusedDecode, PagedAttention
from kvrelay.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvrelay.model.layers.linear import (
    STACK_DENSE,
    STACK_ORDERED,
    QKVParallelLinear,
    RowParallelLinear,
    stack_form,
)
from kvrelay.model.layers.moe import ExpertPaths, Experts, MoE, Router
from kvrelay.model.layers.norm import RMSNorm
from kvrelay.model.layers.ordered import OrderedProduct
from kvrelay.model.layers.rotary import RotaryEmbedding
from kvrelay.model.parallel import ParallelContext
from kvrelay.model.weights import WeightSource


def kv_cache_groups(config: GptOssConfig, hybrid: bool) -> tuple[int, ...]:
    """KV-cache group of each layer: with the hybrid manager full-attention layers are
    group 0 and sliding-window layers group 1; without it every layer is group 0."""
    if not hybrid or config.num_sliding_layers in (0, config.num_hidden_layers):
        return (0,) * config.num_hidden_layers
    return tuple(0 if t == FULL else 1 for t in config.layer_types)


class Attention(nn.Module):
    """The attention block's modules and their loading; its math is `DecoderLayer.forward`'s
    (qkv, `PagedAttention.rope_attend`, o_proj)."""

    def __init__(self, config: GptOssConfig, layer: int, group: int, ctx: ParallelContext,
                 dtype: torch.dtype, rotary: RotaryEmbedding, plan: ExecutionPlan) -> None:
        super().__init__()
        c = config
        self.qkv = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                     c.num_key_value_heads, ctx, dtype, plan)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, ctx,
                                        dtype, plan=plan)
        self.attn = PagedAttention(self.qkv.num_heads, self.qkv.num_kv_heads, c.head_dim,
                                   c.window_of(layer), group, ctx, plan)
        self.rotary = rotary
        self.ctx = ctx

    def load(self, src: WeightSource, prefix: str) -> None:
        self.qkv.load(src, prefix)
        self.o_proj.load(src, f"{prefix}.o_proj")
        h0 = self.ctx.tp_rank * self.qkv.num_heads
        self.attn.sinks.copy_(src.get(f"{prefix}.sinks", 0, h0, h0 + self.qkv.num_heads))


@dataclass(frozen=True, slots=True)
class LayerModules:
    """The modules `DecoderLayer.forward` calls, named, fetched once per plan (an nn.Module
    attribute lookup costs ~0.5 µs; a layer step makes a dozen). `DecoderLayer.use_plan`
    fetches them again: replace a layer's submodules before handing the model its plan."""

    ln1: RMSNorm
    qkv: QKVParallelLinear
    rotary: RotaryEmbedding
    attn: PagedAttention
    o_proj: RowParallelLinear
    ln2: RMSNorm
    experts: Experts
    router: Router
    ctx: ParallelContext


class DecoderLayer(nn.Module):
    """One attention + MoE layer with one step (`forward`) for every kind of step. A
    decode-only step differs only in how two groups of ops are dispatched (RoPE + KV write
    + attention, router + experts), not in the math, so the model makes that choice once
    per step and hands it in (`FusedDecode`), and the submodule that owns each group picks
    its native call from it: the layer's math is written once, and a new fused op changes
    one submodule, not a second copy of the layer."""

    def __init__(self, config: GptOssConfig, layer: int, group: int, ctx: ParallelContext,
                 dtype: torch.dtype, rotary: RotaryEmbedding, mxfp4: bool,
                 plan: ExecutionPlan) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plan)
        self.self_attn = Attention(c, layer, group, ctx, dtype, rotary, plan)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plan)
        self.mlp = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts,
                       c.num_experts_per_tok, ctx, dtype, c.swiglu_alpha, c.swiglu_limit, mxfp4,
                       plan)
        self.mods = self._fetch()

    def _fetch(self) -> LayerModules:
        attn, mlp = self.self_attn, self.mlp
        return LayerModules(self.input_layernorm, attn.qkv, attn.rotary, attn.attn,
                            attn.o_proj, self.post_attention_layernorm, mlp.experts,
                            mlp.router, mlp.ctx)

    def use_plan(self, plan: ExecutionPlan) -> None:
        """Every submodule follows `plan` from the next step on."""
        m = self.mods = self._fetch()
        for module in (m.ln1, m.qkv, m.attn, m.o_proj, m.ln2, m.router):
            module.plan = plan
        m.experts.use_plan(plan)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.input_layernorm.weight.copy_(src.get(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm.weight.copy_(src.get(f"{prefix}.post_attention_layernorm.weight"))
        self.self_attn.load(src, f"{prefix}.self_attn")
        self.mlp.load(src, f"{prefix}.mlp")

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, fused: FusedDecode | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it) of one step: the residual add of each
        block is done by the norm that follows it (one fused pass), the last one by the
        model's norm. `fused`: the model's choice for a decode-only step, which the
        attention and the experts read to take their fused native calls (the same math,
        bitwise). The modules are called through `mods` and `.forward`: no nn.Module lookup
        or call wrapper on a path that runs every layer of every step."""
        m = self.mods
        if residual is None:
            residual, x = h, m.ln1.forward(h)                                   # [T, H]
        else:
            residual, x = m.ln1.add_forward(residual, h)                        # [T, H]
        qk, v = m.qkv.qk_v(x)                                  # [T, h + kvh, hd], [T, kvh, hd]
        out = m.attn.rope_attend(qk, v, positions, m.rotary, kv_cache, meta, fused)  # [T, h·hd]
        residual, x = m.ln2.add_forward(residual, m.o_proj.forward(out))         # [T, H]
        return m.experts.route_forward(x, m.router, fused), residual            # [T, H]


class DecodeStack:
    """The layers' one path for a fused decode-only step (`DecoderLayer.forward` given a
    `FusedDecode`), every layer run from C++ in one native call
    (`kvrelay_kernels.DecodeStack`, csrc/decode_stack_op.cpp: the same ops with the same
    arguments in the same order, so bitwise the same results; tests/model/
    test_fused_decode_layer.py compares whole steps). Not a second path but the first one's
    executor: what goes is the Python between the ops (~6 op dispatches and the module calls
    of each layer; one sequence on tests' tiny bf16 model, 2 layers, AVX2, one thread:
    ~155 µs a step against ~270 µs layer by layer). The weights are registered once. The
    model makes one where its plan says `decode_stack` and every layer can join (one rank,
    the kernels built: `make`), and runs it for a batch size where every layer's fused step
    would take the native ops only (`usable`), each projection in the form the Python path
    computes it for that batch on that many threads (`linear.stack_form`: the dense kernel,
    the ordered kernel where checked equal to torch's fp32 GEMM, or that GEMM; told to the
    C++ per batch size and thread count). Made again when an experts' paths (their kernel
    arguments) are made again, or a projection's registered packed copy is no longer its
    weight's (`current`)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self.mods = [layer.mods for layer in layers]
        self.paths = [m.experts.paths() for m in self.mods]
        self.usable: dict[tuple[int, int], bool] = {}     # per (rows, threads)
        # (layer, product) -> (its ordered product, the packed copy registered for it)
        self.registered: dict[tuple[int, int], tuple[OrderedProduct, torch.Tensor]] = {}
        self.native = torch.classes.kvrelay_kernels.DecodeStack()
        for mods, paths in zip(self.mods, self.paths):
            self._add(mods, paths)

    @classmethod
    def make(cls, model: GptOssModel) -> DecodeStack | None:
        """The stack of `model`'s layers, or None where some layer cannot join."""
        layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
        if (not model.plan.decode_stack or len(layers) != len(model.layers)
                or not hasattr(torch.classes.kvrelay_kernels, "DecodeStack")):
            return None
        for layer in layers:
            paths = layer.mods.experts.paths()
            if layer.mods.ctx.tp_size != 1 or paths.reduce is not None or paths.route_op is None:
                return None
        return cls(layers)

    def current(self) -> bool:
        """Whether the experts' kernel arguments and the registered packed weights are
        those of the layers as they are now."""
        return (all(m.experts.paths() is paths for m, paths in zip(self.mods, self.paths))
                and all(o.holds(packed) for o, packed in self.registered.values()))

    def get(self, h: torch.Tensor) -> Any:
        """The native stack for a batch like h, or None (layer by layer)."""
        key = (h.shape[0], torch.get_num_threads())
        usable = self.usable.get(key)
        if usable is None:
            usable = self.usable[key] = self._usable(h)
        return self.native if usable else None

    def _usable(self, h: torch.Tensor) -> bool:
        """Whether every layer's fused step of a batch like h takes the native ops only; if
        so the C++ is told how to compute each layer's products for such a batch on this
        many threads (`set_forms`)."""
        forms: list[int] = []
        for i, m in enumerate(self.mods):
            layer = self._forms(i, m, h)
            if layer is None:
                return False
            forms += layer
        self.native.set_forms(h.shape[0], torch.get_num_threads(), forms)
        return True

    def _forms(self, i: int, m: LayerModules, h: torch.Tensor) -> list[int] | None:
        """How layer i computes its qkv, o_proj and router for a batch like h
        (`stack_form`: what its fused step computes, bit for bit), or None where some op of
        that step would not be native. Registers the packed weights an ordered form reads."""
        out = h.new_empty(h.shape[0], m.o_proj.weight.shape[1])        # o_proj's input
        qkv, o_proj = m.qkv.stack_form(h), m.o_proj.stack_form(out)
        router = stack_form(h, m.router.weight, m.router.plan)
        if (m.ln1._ops(h) is None or m.ln2._ops(h) is None or qkv is None or o_proj is None
                or router is None or not self._experts_native(m, h, router)):
            return None
        projections: tuple[QKVParallelLinear | RowParallelLinear, ...] = (m.qkv, m.o_proj)
        for which, (proj, form) in enumerate(zip(projections, (qkv, o_proj))):
            if form == STACK_ORDERED and (i, which) not in self.registered:
                operands = proj.ordered_operands()
                assert operands is not None and proj.ordered is not None   # it was checked
                self.native.set_ordered(i, which, *operands)
                self.registered[(i, which)] = (proj.ordered, operands[0])
        return [qkv, o_proj, router]

    @staticmethod
    def _experts_native(m: LayerModules, h: torch.Tensor, router_form: int) -> bool:
        """Whether `route_forward` of a fused step of a batch like h runs the experts'
        kernel: as one call with a router on the dense kernel (`fuses_router`), after a
        router of another form (`Router.route_native`, then the kernel path)."""
        if router_form == STACK_DENSE:
            return m.experts.fuses_router(h, m.router)
        paths = m.experts.paths()
        return (bool(paths.op_args) and paths.x_native
                and ExpertPaths.choose(m.experts, h, h.shape[0] * m.router.top_k,
                                       compiling=False) == "kernel")

    def _add(self, m: LayerModules, paths: ExpertPaths) -> None:
        first, gate_up, gate_up_scales, gate_up_bias, down, down_scales, down_bias, alpha, \
            limit, _isa = paths.op_args
        self.native.add_layer(
            m.ln1.weight, m.ln1.eps, m.ln2.weight, m.ln2.eps, m.qkv.weight, m.qkv.bias,
            m.qkv.num_heads, m.qkv.num_kv_heads, m.qkv.head_dim, m.attn.group, m.attn.sinks,
            m.attn.scale, m.attn.window or 0, m.o_proj.weight, m.o_proj.bias, m.router.weight,
            m.router.bias, m.router.top_k, first, gate_up, gate_up_scales, gate_up_bias, down,
            down_scales, down_bias, alpha, limit)


class GptOssModel(nn.Module):
    """The whole network for one rank. `tp_size=1, ep_size=1` is the plain model.
    Owner of its `ExecutionPlan` (this process's by default), which its layers read."""

    def __init__(self, config: GptOssConfig, ctx: ParallelContext | None = None,
                 dtype: torch.dtype = torch.bfloat16, mxfp4: bool = False,
                 hybrid_kv_cache: bool = True, max_positions: int | None = None,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.config, self.dtype, self.mxfp4 = config, dtype, mxfp4
        self.plan = plan = plan or execution_plan.current()
        self._stack: DecodeStack | None = None
        self._stack_made = False        # DecodeStack.make was asked under this plan
        self.ctx = ctx = ctx or ParallelContext()
        self.layer_groups = kv_cache_groups(config, hybrid_kv_cache)
        self.max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, self.max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx,
                                                   dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.layer_groups[i], ctx, dtype, self.rotary, mxfp4, plan)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, plan)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype, plan)

    @property
    def num_kv_heads_local(self) -> int:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer.self_attn.qkv.num_kv_heads

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          device: torch.device | str = "cpu") -> list[torch.Tensor]:
        shape = (2, num_blocks, self.num_kv_heads_local, block_size, self.config.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, H] (normed)."""
        h = self.embed_tokens(input_ids)                       # [T, H]
        residual: torch.Tensor | None = None
        fused = self.fused_step(h, kv_caches, meta)
        if fused is not None and (stack := self._decode_stack(h)) is not None:
            # the layers' fused path, run from C++
            h, residual = stack.run(h, positions, fused.cos, fused.sin, kv_caches,
                                    meta.slot_mappings, meta.block_tables, meta.seq_lens)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):      # `.forward`: no hooks
                h, residual = layer.forward(h, residual, positions, kv_cache, meta, fused)
        if residual is None:
            return self.norm(h)
        return self.norm.add_forward(residual, h)[1]

    def use_plan(self, plan: ExecutionPlan) -> None:
        """Follow `plan` from the next step on (a test's or profiler's choice of paths; the
        native kernels becoming available, `engine/native_switch.py`)."""
        self.plan = plan
        self.norm.plan = self.lm_head.plan = plan
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.use_plan(plan)
        self._stack, self._stack_made = None, False

    def fused_step(self, h: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata) -> FusedDecode | None:
        """This step's choice for its layers: a `FusedDecode` where they take their fused
        native ops (the plan's fused decode, a decode-only step, eager, one replica's
        experts, every layer's cache contiguous in the activations' dtype: the caches are
        allocated alike, the first layer's decides), None for the general ops. Made once
        per step, here only."""
        if (not self.plan.fused_decode or meta.num_decodes != h.shape[0]
                or self.ctx.expert_group is not None or not self.layers
                or torch.compiler.is_compiling() or h.device.type != "cpu"):
            return None
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        cos, sin = self.rotary.tables()
        if cos.dtype != torch.float32 or not first.mods.attn.fuses_decode(h, kv_caches[0], meta):
            return None                                   # (e.g. after a model.bfloat16())
        return FusedDecode(cos, sin)

    def _decode_stack(self, h: torch.Tensor) -> Any:
        """The layers of this fused decode-only step as one native call (`DecodeStack`),
        or None: the plan has no stack, or some layer's fused step would not run on native
        ops alone."""
        stack = self._stack
        if stack is None:
            if self._stack_made:            # some layer cannot join under this plan
                return None
            stack = self._stack = DecodeStack.make(self)
            self._stack_made = True
            if stack is None:
                return None
        elif not stack.current():
            stack = self._stack = DecodeStack(stack.layers)
        return stack.get(h)

    def compute_logits(self, hidden: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """[T', H] → float32 logits [T', V]. `greedy` (every row is sampled greedily and
        nothing else is read from it): int64 token ids [T'] instead where the LM head can
        give them without the logits (`ParallelLMHead.greedy`), the same ids the sampler
        would pick."""
        if greedy:
            tokens = self.lm_head.greedy(hidden)
            if tokens is not None:
                return tokens
        return self.lm_head.logits(hidden)

    def weight_bytes(self) -> int:
        """Bytes of weights resident for this rank (packed MXFP4 counted as packed)."""
        total = 0
        for module in self.modules():
            if hasattr(module, "nbytes") and module is not self:
                total += module.nbytes()  # type: ignore[operator]  # hasattr-checked above
        counted = {id(p) for m in self.modules() if hasattr(m, "nbytes") and m is not self
                   for p in m.parameters()}
        total += sum(p.numel() * p.element_size() for p in self.parameters()
                     if id(p) not in counted)
        return total
