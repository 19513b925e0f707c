"""gpt-oss as an inference model over a flattened batch of variable-length sequences.

    token ids [T] ─ embed ─▶ h [T, H]
      for each layer:  h += o_proj(attn(rope(qkv(norm(h)))))    sinks, window on sliding layers
                       h += moe(norm(h))                          top-k router, grouped experts
    norm ─ lm_head ─▶ logits [T', V]                              only rows the caller asks for

Each residual add is done by the norm that reads its result (`RMSNorm.add_forward`: one
native pass for decode-sized steps), so a layer returns its MoE output and the residual
stream separately and the next layer (or the final norm) adds them.

Decode-only steps (every token a decode, native kernels built) take `DecoderLayer.decode`
when `DecoderLayer.fused_decode` is on: the same computation with fewer calls per layer —
RoPE, the KV write and the paged attention in one native call
(`PagedAttention.rotary_decode`), the router (linear, `route_topk`) and the experts in
another (`Experts.route_decode`), and no module-call or dispatch wrappers between them.
Its results are bitwise those of the separate ops (tests/model/test_paged_decode.py,
tests/model/test_fused_decode_layer.py); the model decides once per step.

Everything per step arrives in `AttentionMetadata` (query/context lengths, block
tables and slot mappings per KV-cache group). Each layer owns a KV cache tensor
`[2, num_blocks, kv_heads_local, block_size, head_dim]`, allocated by the caller.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from kvrelay.model.config import FULL, GptOssConfig
from kvrelay.model.layers import paged_decode
from kvrelay.model.layers.attention import AttentionMetadata, PagedAttention
from kvrelay.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvrelay.model.layers.linear import QKVParallelLinear, RowParallelLinear, linear
from kvrelay.model.layers.linear import _dense as runs_on_dense_kernel
from kvrelay.model.layers.moe import MoE
from kvrelay.model.layers.norm import RMSNorm
from kvrelay.model.layers.rotary import RotaryEmbedding
from kvrelay.model.parallel import Collectives, ParallelContext
from kvrelay.model.weights import WeightSource


def kv_cache_groups(config: GptOssConfig, hybrid: bool) -> tuple[int, ...]:
    """KV-cache group of each layer: with the hybrid manager full-attention layers are
    group 0 and sliding-window layers group 1; without it every layer is group 0."""
    if not hybrid or config.num_sliding_layers in (0, config.num_hidden_layers):
        return (0,) * config.num_hidden_layers
    return tuple(0 if t == FULL else 1 for t in config.layer_types)


class Attention(nn.Module):
    def __init__(self, config: GptOssConfig, layer: int, group: int, ctx: ParallelContext,
                 dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.qkv = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                     c.num_key_value_heads, ctx, dtype)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, ctx,
                                        dtype)
        self.attn = PagedAttention(self.qkv.num_heads, self.qkv.num_kv_heads, c.head_dim,
                                   c.window_of(layer), group, ctx)
        self.rotary = rotary
        self.ctx = ctx

    def load(self, src: WeightSource, prefix: str) -> None:
        self.qkv.load(src, prefix)
        self.o_proj.load(src, f"{prefix}.o_proj")
        h0 = self.ctx.tp_rank * self.qkv.num_heads
        self.attn.sinks.copy_(src.get(f"{prefix}.sinks", 0, h0, h0 + self.qkv.num_heads))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qk, v = self.qkv.qk_v(x)                               # [T, h + kvh, hd], [T, kvh, hd]
        q, k = self.rotary.rotate(positions, qk).split(       # one rotary call for q and k
            [self.qkv.num_heads, self.qkv.num_kv_heads], dim=1)
        out = self.attn(q, k, v, kv_cache, meta)               # [T, h, hd]
        return self.o_proj(out.flatten(1))                     # [T, H]


@functools.cache
def _route_op() -> Any:
    """`kvrelay_kernels::route_topk` (csrc/fused_decode_op.cpp), resolved once."""
    return torch.ops.kvrelay_kernels.route_topk.default


class DecoderLayer(nn.Module):
    fused_decode = True     # decode-only steps through `decode` (see the module docstring)

    def __init__(self, config: GptOssConfig, layer: int, group: int, ctx: ParallelContext,
                 dtype: torch.dtype, rotary: RotaryEmbedding, mxfp4: bool) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer, group, ctx, dtype, rotary)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts,
                       c.num_experts_per_tok, ctx, dtype, c.swiglu_alpha, c.swiglu_limit, mxfp4)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.input_layernorm.weight.copy_(src.get(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm.weight.copy_(src.get(f"{prefix}.post_attention_layernorm.weight"))
        self.self_attn.load(src, f"{prefix}.self_attn")
        self.mlp.load(src, f"{prefix}.mlp")

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it): the residual add of each block is done
        by the norm that follows it (one fused pass), the last one by the model's norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add_forward(residual, h)
        residual, x = self.post_attention_layernorm.add_forward(
            residual, self.self_attn(x, positions, kv_cache, meta))
        return self.mlp(x), residual

    def decode(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a decode-only step (`GptOssModel.fused_step` said yes): the same
        ops, RoPE + KV write + attention as one native call, the router (linear, top-k,
        softmax) and the experts as another (`Experts.route_decode`), modules called
        without their wrappers."""
        ln1, qkv, attn, o_proj, ln2, experts, _ctx, router = self._decode_modules
        if residual is None:
            residual, x = h, ln1.forward(h)
        else:
            residual, x = ln1.add_forward(residual, h)
        qk, v = qkv.qk_v(x)                                    # [T, h + kvh, hd], [T, kvh, hd]
        out = attn.rotary_decode(qk, v, positions, cos, sin, kv_cache, meta)     # [T, h·hd]
        residual, x = ln2.add_forward(residual, o_proj.forward(out))
        return experts.route_decode(x, router, self.route), residual    # all-reduced

    @property
    def _decode_modules(self) -> tuple[Any, ...]:
        """The modules `decode` calls, looked up once (an nn.Module attribute lookup costs
        ~0.5 µs; a layer step makes a dozen). Setting any attribute of the layer drops
        them (`__setattr__`); replace deeper submodules through the layer, not in place."""
        mods = self.__dict__.get("_decode_mods")
        if mods is None:
            attn, mlp = self.self_attn, self.mlp
            mods = (self.input_layernorm, attn.qkv, attn.attn, attn.o_proj,
                    self.post_attention_layernorm, mlp.experts, mlp.ctx, mlp.router)
            self.__dict__["_decode_mods"] = mods
        return mods

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop("_decode_mods", None)
        super().__setattr__(name, value)

    def route(self, x: torch.Tensor, router: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`router.forward` (moe.Router) with the top-k and softmax in one native call:
        (weights [T, k] f32, expert ids [T, k] int64), the values the experts read from the
        eager router."""
        return _route_op()(linear(x, router.weight, router.bias), router.top_k)


# Instance attributes that replace a method `DecoderLayer.decode` calls (a profiler's
# wrappers, a test's spy): the stack would bypass them, so such layers keep `decode` (as
# they do when `DecoderLayer.decode` itself is replaced).
_DECODE_METHODS = ("forward", "add_forward", "qk_v", "rotary_decode", "route_decode", "decode")
_LAYER_DECODE = DecoderLayer.decode


class DecodeStack:
    """`DecoderLayer.decode` of every layer as one native call
    (`kvrelay_kernels.DecodeStack`, csrc/decode_stack_op.cpp: the same ops in the same
    order, called from C++, so bitwise the same results), the weights registered once.
    Used for a batch size where every layer's decode would run natively: one rank, the
    norms, qkv and o_proj on the native kernels, the router and experts in one call
    (`Experts.route_decode`), and no method replaced on an instance (`_DECODE_METHODS`).
    Made again when a layer's modules or an experts' decode plan change (`current`)."""

    enabled = True      # off: DecoderLayer.decode layer by layer (comparisons, profiling)

    def __init__(self, model: GptOssModel) -> None:
        self.model = model
        layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
        self.mods = [layer._decode_modules for layer in layers]
        self.layers = layers
        self.plans = [mods[5]._plan() for mods in self.mods]
        self.usable: dict[int, bool] = {}
        self.native: Any = None
        if len(layers) == len(model.layers) and self._static_ok():
            self.native = torch.classes.kvrelay_kernels.DecodeStack()
            for mods, plan in zip(self.mods, self.plans):
                self._add(mods, plan)

    def current(self) -> bool:
        return all(layer.__dict__.get("_decode_mods") is mods and
                   mods[5].__dict__.get("_decode_plan") is plan and plan.current()
                   for layer, mods, plan in zip(self.layers, self.mods, self.plans))

    def get(self, h: torch.Tensor) -> Any:
        if (self.native is None or not DecodeStack.enabled
                or DecoderLayer.decode is not _LAYER_DECODE):      # replaced: a spy, a profiler
            return None
        usable = self.usable.get(h.shape[0])
        if usable is None:
            usable = self.usable[h.shape[0]] = self._usable(h)
        return self.native if usable else None

    def _static_ok(self) -> bool:
        if not hasattr(torch.classes.kvrelay_kernels, "DecodeStack"):
            return False
        for mods, plan in zip(self.mods, self.plans):
            o_proj, ctx = mods[3], mods[6]
            if (ctx.tp_size != 1 or plan.reduce is not None or plan.route_op is None
                    or type(o_proj.ctx.comm).all_reduce is not Collectives.all_reduce):
                return False
            if any(name in m.__dict__ for m in mods[:6] for name in _DECODE_METHODS):
                return False
        return True

    def _usable(self, h: torch.Tensor) -> bool:
        """Whether every layer's `decode` of a batch like h takes the native ops only."""
        for ln1, qkv, _attn, o_proj, ln2, experts, _ctx, router in self.mods:
            out = h.new_empty(h.shape[0], o_proj.weight.shape[1])
            if (ln1._ops(h) is None or ln2._ops(h) is None
                    or not runs_on_dense_kernel(h, qkv.weight)
                    or not runs_on_dense_kernel(out, o_proj.weight)
                    or not experts._fuses_router(h, router)):
                return False
        return True

    def _add(self, mods: tuple[Any, ...], plan: Any) -> None:
        ln1, qkv, attn, o_proj, ln2, _experts, _ctx, router = mods
        first, gate_up, gate_up_scales, gate_up_bias, down, down_scales, down_bias, alpha, \
            limit, _isa = plan.args
        self.native.add_layer(
            ln1.weight, ln1.eps, ln2.weight, ln2.eps, qkv.weight, qkv.bias, qkv.num_heads,
            qkv.num_kv_heads, qkv.head_dim, attn.group, attn.sinks, attn.scale,
            attn.window or 0, o_proj.weight, o_proj.bias, router.weight, router.bias,
            router.top_k, first, gate_up, gate_up_scales, gate_up_bias, down, down_scales,
            down_bias, alpha, limit)


class GptOssModel(nn.Module):
    """The whole network for one rank. `tp_size=1, ep_size=1` is the plain model."""

    def __init__(self, config: GptOssConfig, ctx: ParallelContext | None = None,
                 dtype: torch.dtype = torch.bfloat16, mxfp4: bool = False,
                 hybrid_kv_cache: bool = True, max_positions: int | None = None) -> None:
        super().__init__()
        self.config, self.dtype, self.mxfp4 = config, dtype, mxfp4
        self.ctx = ctx = ctx or ParallelContext()
        self.layer_groups = kv_cache_groups(config, hybrid_kv_cache)
        self.max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, self.max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx,
                                                   dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.layer_groups[i], ctx, dtype, self.rotary, mxfp4)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype)

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
        if self.fused_step(h, kv_caches, meta):
            cos, sin = self.rotary.tables()
            stack = self._decode_stack(h)
            if stack is not None:
                h, residual = stack.run(h, positions, cos, sin, kv_caches, meta.slot_mappings,
                                        meta.block_tables, meta.seq_lens)
            else:
                for layer, kv_cache in zip(self.layers, kv_caches):
                    assert isinstance(layer, DecoderLayer)
                    h, residual = layer.decode(h, residual, positions, kv_cache, meta, cos, sin)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                h, residual = layer(h, residual, positions, kv_cache, meta)
        if residual is None:
            return self.norm(h)
        return self.norm.add_forward(residual, h)[1]

    def fused_step(self, h: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata) -> bool:
        """Whether this step's layers take `DecoderLayer.decode`: a
        decode-only step, eager, on the native kernels, one rank (no expert parallelism
        across replicas), every layer's cache contiguous in the activations' dtype (the
        caches are allocated alike: the first layer's decides)."""
        if (not DecoderLayer.fused_decode or meta.num_decodes != h.shape[0]
                or self.ctx.expert_group is not None or not self.layers
                or torch.compiler.is_compiling() or not paged_decode.available(h.device)):
            return False
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        if self.rotary.tables()[0].dtype != torch.float32:   # e.g. after a model.bfloat16()
            return False
        return first.self_attn.attn.fuses_decode(h, kv_caches[0], meta)

    def _decode_stack(self, h: torch.Tensor) -> Any:
        """The layers of this decode-only step as one native call (`DecodeStack`), or None
        where some layer would not run `DecoderLayer.decode` on native ops alone."""
        stack = self.__dict__.get("_stack")
        if stack is None or not stack.current():
            stack = self.__dict__["_stack"] = DecodeStack(self)
        return stack.get(h)

    def forget_kernel_plans(self) -> None:
        """Drop what was planned from the native kernels' availability — the decode stack,
        the experts' decode plans — after it changed (a background build finished,
        `engine/native_switch.py`): the next step plans again."""
        self.__dict__.pop("_stack", None)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.mlp.experts.forget_decode_plan()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T', H] → float32 logits [T', V]."""
        return self.lm_head(hidden).float()

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
