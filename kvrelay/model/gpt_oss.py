"""gpt-oss as an inference model over a flattened batch of variable-length sequences.

    token ids [T] ─ embed ─▶ h [T, H]
      for each layer:  h += o_proj(attn(rope(qkv(norm(h)))))    sinks, window on sliding layers
                       h += moe(norm(h))                          top-k router, grouped experts
    norm ─ lm_head ─▶ logits [T', V]                              only rows the caller asks for

Each residual add is done by the norm that reads its result (`RMSNorm.add_forward`: one
native pass for decode-sized steps), so a layer returns its MoE output and the residual
stream separately and the next layer (or the final norm) adds them.

Decode-only steps (every token a decode, native kernels built) take `DecoderLayer.decode`
where the model's `ExecutionPlan` says `fused_decode`: the same computation with fewer calls
per layer —
RoPE, the KV write and the paged attention in one native call
(`PagedAttention.rotary_decode`), the router (linear, `route_topk`) and the experts in
another (`Experts.route_decode`), and no module-call or dispatch wrappers between them.
Its results are bitwise those of the separate ops (tests/model/test_paged_decode.py,
tests/model/test_fused_decode_layer.py); the model decides once per step. Where the plan
also says `decode_stack`, every layer of such a step runs as one native call (`DecodeStack`)
for batch sizes at which each layer's ops are all native. Tests and profilers choose the path
through the plan: `model.use_plan(dataclasses.replace(model.plan, decode_stack=False))`.

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
from kvrelay.model.layers.attention import AttentionMetadata, PagedAttention
from kvrelay.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvrelay.model.layers.linear import QKVParallelLinear, RowParallelLinear, runs_on_dense_kernel
from kvrelay.model.layers.moe import ExpertPaths, Experts, MoE, Router
from kvrelay.model.layers.norm import RMSNorm
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qk, v = self.qkv.qk_v(x)                               # [T, h + kvh, hd], [T, kvh, hd]
        q, k = self.rotary.rotate(positions, qk).split(       # one rotary call for q and k
            [self.qkv.num_heads, self.qkv.num_kv_heads], dim=1)
        out = self.attn(q, k, v, kv_cache, meta)               # [T, h, hd]
        return self.o_proj(out.flatten(1))                     # [T, H]


@dataclass(frozen=True, slots=True)
class DecodeModules:
    """The modules `DecoderLayer.decode` calls, named, fetched once per plan (an nn.Module
    attribute lookup costs ~0.5 µs; a layer step makes a dozen). `DecoderLayer.use_plan`
    fetches them again: replace a layer's submodules before handing the model its plan."""

    ln1: RMSNorm
    qkv: QKVParallelLinear
    attn: PagedAttention
    o_proj: RowParallelLinear
    ln2: RMSNorm
    experts: Experts
    router: Router
    ctx: ParallelContext


class DecoderLayer(nn.Module):
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

    def _fetch(self) -> DecodeModules:
        attn, mlp = self.self_attn, self.mlp
        return DecodeModules(self.input_layernorm, attn.qkv, attn.attn, attn.o_proj,
                             self.post_attention_layernorm, mlp.experts, mlp.router, mlp.ctx)

    def use_plan(self, plan: ExecutionPlan) -> None:
        """Every submodule follows `plan` from the next step on."""
        m = self.mods = self._fetch()
        for module in (m.ln1, m.qkv, m.attn, m.o_proj, m.ln2, m.experts, m.router):
            module.plan = plan

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
        m = self.mods
        if residual is None:
            residual, x = h, m.ln1.forward(h)
        else:
            residual, x = m.ln1.add_forward(residual, h)
        qk, v = m.qkv.qk_v(x)                                  # [T, h + kvh, hd], [T, kvh, hd]
        out = m.attn.rotary_decode(qk, v, positions, cos, sin, kv_cache, meta)   # [T, h·hd]
        residual, x = m.ln2.add_forward(residual, m.o_proj.forward(out))
        return m.experts.route_decode(x, m.router, m.router.route_native), residual


class DecodeStack:
    """`DecoderLayer.decode` of every layer as one native call
    (`kvrelay_kernels.DecodeStack`, csrc/decode_stack_op.cpp: the same ops in the same
    order, called from C++, so bitwise the same results), the weights registered once.
    The model makes one where its plan says `decode_stack` and every layer can join (one
    rank, the kernels built: `make`), and runs it for a batch size where every layer's
    decode would run natively (`usable`). Made again when an experts' paths (their kernel
    arguments) are made again (`current`)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self.mods = [layer.mods for layer in layers]
        self.paths = [m.experts.paths() for m in self.mods]
        self.usable: dict[int, bool] = {}
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
        return all(m.experts.paths() is paths for m, paths in zip(self.mods, self.paths))

    def get(self, h: torch.Tensor) -> Any:
        """The native stack for a batch like h, or None (layer by layer)."""
        usable = self.usable.get(h.shape[0])
        if usable is None:
            usable = self.usable[h.shape[0]] = self._usable(h)
        return self.native if usable else None

    def _usable(self, h: torch.Tensor) -> bool:
        """Whether every layer's `decode` of a batch like h takes the native ops only."""
        for m in self.mods:
            out = h.new_empty(h.shape[0], m.o_proj.weight.shape[1])
            if (m.ln1._ops(h) is None or m.ln2._ops(h) is None
                    or not runs_on_dense_kernel(h, m.qkv.weight, m.qkv.plan)
                    or not runs_on_dense_kernel(out, m.o_proj.weight, m.o_proj.plan)
                    or not m.experts.fuses_router(h, m.router)):
                return False
        return True

    def _add(self, m: DecodeModules, paths: ExpertPaths) -> None:
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
                   meta: AttentionMetadata) -> bool:
        """Whether this step's layers take `DecoderLayer.decode`: the plan's fused decode,
        a decode-only step, eager, one rank (no expert parallelism across replicas), every
        layer's cache contiguous in the activations' dtype (the caches are allocated
        alike: the first layer's decides)."""
        if (not self.plan.fused_decode or meta.num_decodes != h.shape[0]
                or self.ctx.expert_group is not None or not self.layers
                or torch.compiler.is_compiling() or h.device.type != "cpu"):
            return False
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        if self.rotary.tables()[0].dtype != torch.float32:   # e.g. after a model.bfloat16()
            return False
        return first.self_attn.attn.fuses_decode(h, kv_caches[0], meta)

    def _decode_stack(self, h: torch.Tensor) -> Any:
        """The layers of this decode-only step as one native call (`DecodeStack`), or None:
        the plan has no stack, or some layer would not run `decode` on native ops alone."""
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
