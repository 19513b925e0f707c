"""Paged attention with sinks, sliding windows and GQA over a flattened batch.

The batch is S sequences whose new tokens are concatenated ("flattened"):

    tokens:           | s0: q0 tokens | s1: q1 tokens | ... |
    query_start_loc:  [0, q0, q0+q1, ..., T]                  (cu_seqlens of the queries)
    seq_lens[i]:      context length of s_i *after* this step (cached + new)
    positions:        the new tokens of s_i sit at seq_lens[i]-q_i ... seq_lens[i]-1

The KV cache of one layer is `[2, num_blocks, kv_heads, block_size, head_dim]` (K, V;
KV heads outer within a block, so a TP rank's heads and a transferred block are
contiguous). Token at position p of s_i lives in block `block_table[i, p // B]`, slot
`p % B`; `slot_mapping[t] = block * B + offset` says where new token t is written
(-1: not written, e.g. padding).

Sequences with one new token (decodes) come first (`num_decodes` of them) and are
attended as one batch with query length 1; the rest (prefill chunks) are padded to
the longest chunk. Both parts gather only the key blocks each sequence can see: a
sliding-window layer starts at the block holding position `first_query_pos - W + 1`.

Sinks: softmax over [scores, sink] then dropping the sink column equals ordinary
softmax attention scaled per row by `sigmoid(lse - sink)`, where lse is the row's
log-sum-exp — so any kernel that returns the lse does attention with sinks.

Fresh prompts: a prefill chunk from position 0 (no cached prefix) has exactly its own
new k/v as keys, so the fresh chunks that close a step attend over
them directly (`_attend_fresh`): no gather from the cache, no per-sequence [L, K] mask,
and the queries in pieces of `QUERY_PIECE` rows, each attending only the keys it can see
(causal, window) under a small mask shared by the batch — the CPU flash kernel's
`is_causal` alone still computes the whole [L, L] at prompt lengths of a few hundred.
Chunks that continue a prefix (the scheduler puts them before the fresh ones) take the
gather path, the reference both are tested against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers import paged_decode as kernel
from kvrelay.model.layers.rotary import RotaryEmbedding
from kvrelay.model.parallel import ParallelContext


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the runner (or a test) once per step.

    `block_tables[g]` / `slot_mappings[g]` belong to KV-cache group g (full-attention
    and sliding-window layers form separate groups under the hybrid KV cache manager).
    """

    query_start_loc: torch.Tensor            # [S+1] int64
    seq_lens: torch.Tensor                   # [S] int64
    block_tables: tuple[torch.Tensor, ...]   # per group: [S, max_blocks] int64
    slot_mappings: tuple[torch.Tensor, ...]  # per group: [T] int64
    block_size: int
    num_decodes: int = 0
    _plans: dict[tuple[int, int | None, str], _GatherPlan | _FreshPlan | None] = field(
        default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def fresh_plan(self) -> _FreshPlan | None:
        """The prefill part's layout when every prefill chunk starts at 0 (None otherwise);
        built once per step, shared by every layer."""
        key = (-1, None, "fresh")
        if key not in self._plans:
            self._plans[key] = _build_fresh_plan(self)
        return self._plans[key]  # type: ignore[return-value]

    def plan(self, group: int, window: int | None, part: str) -> _GatherPlan | None:
        """The gather indices and mask for (group, window, part); built once per step
        and shared by every layer with the same group and window."""
        key = (group, window, part)
        if key not in self._plans:
            self._plans[key] = _build_plan(self, group, window, part)
        return self._plans[key]  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """The model's choice for one decode-only step (`GptOssModel.fused_step`), handed to
    every layer: their attention rotates, writes K/V and attends in one native call
    (`PagedAttention.rope_attend`), their MoE routes and runs the experts in another
    (`Experts.route_forward`). Bitwise the general ops, which serve every step where the
    model hands None instead. Carries what the fused calls read besides the layer's inputs:
    the whole RoPE tables (the kernel gathers and rounds the step's rows itself)."""

    cos: torch.Tensor          # [max_positions, hd/2] float32, scaled
    sin: torch.Tensor          # [max_positions, hd/2] float32, scaled


@dataclass
class _GatherPlan:
    seqs: slice                # which sequences
    tokens: slice              # which flattened tokens
    block_ids: torch.Tensor    # [s, nb] cache blocks to gather per sequence
    mask: torch.Tensor         # [s, 1, max_q, nb*B] additive (0 or -inf)
    token_seq: torch.Tensor    # [t] row of each token in the padded query batch
    token_off: torch.Tensor    # [t] column of each token in the padded query batch
    max_q: int


@dataclass
class _FreshPlan:
    """Prefill chunks that each hold a whole prompt prefix from position 0, as one padded
    batch [s, L] (`padded`) or, when padding would waste most of the work, one by one."""
    tokens: slice              # the prefill chunks' flattened tokens
    lens: list[int]            # tokens per chunk (= its context length)
    max_q: int
    padded: bool
    token_seq: torch.Tensor | None      # padded batch of unequal lengths: row of each token
    token_off: torch.Tensor | None      # … and its column
    cu_seqlens: torch.Tensor            # [s + 1] token offsets of the chunks (from 0)
    _pieces: dict[tuple[int, int, torch.dtype], list[tuple[int, int, int, torch.Tensor | None]]] \
        = field(default_factory=dict)

    def pieces(self, L: int, window: int | None, dtype: torch.dtype,
               device: torch.device) -> list[tuple[int, int, int, torch.Tensor | None]]:
        """Query rows [a, b) attend keys [k0, b) under `mask` ([1, 1, b - a, b - k0],
        causal and window; None: the kernel's own `is_causal` suffices): pieces of
        `QUERY_PIECE` rows, so no piece computes the scores above the diagonal or before
        the window that a single [L, L] call would (the CPU flash kernel's `is_causal`
        does not skip them at these lengths). Built once per (L, window, dtype) per step."""
        key = (L, window or 0, dtype)
        if key not in self._pieces:
            self._pieces[key] = _pieces(L, window or 0, dtype, device)
        return self._pieces[key]


QUERY_PIECE = 64      # query rows per fresh-prefill attention call (measured: 48-64 best)


def _pieces(L: int, window: int, dtype: torch.dtype,
            device: torch.device) -> list[tuple[int, int, int, torch.Tensor | None]]:
    out: list[tuple[int, int, int, torch.Tensor | None]] = []
    for a in range(0, L, QUERY_PIECE):
        b = min(a + QUERY_PIECE, L)
        k0 = max(0, a - window + 1) if window else 0
        if a == 0 and (not window or b <= window):
            out.append((a, b, k0, None))
            continue
        qpos = torch.arange(a, b, device=device)[:, None]
        kpos = torch.arange(k0, b, device=device)[None, :]
        hidden = kpos > qpos
        if window:
            hidden |= kpos <= qpos - window
        mask = torch.zeros(b - a, b - k0, dtype=dtype, device=device)
        out.append((a, b, k0, mask.masked_fill_(hidden, float("-inf"))[None, None]))
    return out


def _build_fresh_plan(meta: AttentionMetadata) -> _FreshPlan | None:
    nd = meta.num_decodes
    if nd >= meta.num_seqs:
        return None
    qsl = meta.query_start_loc.tolist()
    lens = [qsl[i + 1] - qsl[i] for i in range(nd, meta.num_seqs)]
    ctx, cont = meta.seq_lens[nd:].tolist(), len(lens)
    while cont and ctx[cont - 1] == lens[cont - 1]:   # the fresh chunks that close the step
        cont -= 1                 # (the scheduler puts chunks that continue a prefix first)
    if cont == len(lens):
        return None
    nd, lens = nd + cont, lens[cont:]         # the continued ones: `_build_plan`, gathered
    L, s = max(lens), len(lens)
    # one padded batch costs s·L² (causal halves both sides alike); alone, Σ len²
    padded = 2 * sum(n * n for n in lens) >= s * L * L
    token_seq = token_off = None
    if padded and min(lens) != L:
        dev = meta.query_start_loc.device
        lens_t = torch.tensor(lens, device=dev)
        token_seq = torch.repeat_interleave(torch.arange(s, device=dev), lens_t)
        starts = torch.tensor([qsl[i] - qsl[nd] for i in range(nd, meta.num_seqs)], device=dev)
        token_off = torch.arange(qsl[-1] - qsl[nd], device=dev) - starts[token_seq]
    cu = meta.query_start_loc[nd:] - qsl[nd]
    return _FreshPlan(slice(qsl[nd], qsl[-1]), lens, L, padded, token_seq, token_off, cu)


@functools.cache
def _prefill_op() -> Any:
    """`kvrelay_kernels::prefill_attention`, its overload resolved once (needs the native
    kernels: `PagedAttention.native`)."""
    return torch.ops.kvrelay_kernels.prefill_attention.default


def _build_plan(meta: AttentionMetadata, group: int, window: int | None,
                part: str) -> _GatherPlan | None:
    nd = meta.num_decodes
    qsl = meta.query_start_loc
    if part == "decode":
        seqs, tokens = slice(0, nd), slice(0, nd)
    else:       # "continued": the prefill chunks before the fresh plan's
        fresh = meta.fresh_plan() if part == "continued" else None
        end = meta.num_seqs - (len(fresh.lens) if fresh is not None else 0)
        seqs, tokens = slice(nd, end), slice(int(qsl[nd]), int(qsl[end]))
    if seqs.stop <= seqs.start:
        return None
    B = meta.block_size
    seq_lens = meta.seq_lens[seqs]                                          # [s]
    q_lens = (qsl[seqs.start + 1: seqs.stop + 1] - qsl[seqs.start: seqs.stop])  # [s]
    max_q = int(q_lens.max())
    first_q_pos = seq_lens - q_lens                                         # [s]
    first_key = (first_q_pos - window + 1).clamp(min=0) if window else torch.zeros_like(seq_lens)
    first_block = first_key // B                                            # [s]
    nb = int((-(-seq_lens // B) - first_block).max())
    table = meta.block_tables[group][seqs]                                  # [s, max_blocks]
    logical = (first_block[:, None] + torch.arange(nb, device=table.device)).clamp(
        max=table.shape[1] - 1)                                             # [s, nb]
    block_ids = table.gather(1, logical)
    key_pos = first_block[:, None] * B + torch.arange(nb * B, device=table.device)  # [s, K]
    q_off = torch.arange(max_q, device=table.device)                        # [max_q]
    q_pos = first_q_pos[:, None] + q_off                                    # [s, max_q]
    allowed = (key_pos[:, None, :] <= q_pos[:, :, None])                    # [s, max_q, K]
    if window:
        allowed &= key_pos[:, None, :] > (q_pos[:, :, None] - window)
    # padded query rows attend to key 0 of their block range so no row is all -inf
    pad_rows = q_off[None, :] >= q_lens[:, None]                            # [s, max_q]
    allowed[..., 0] |= pad_rows
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=table.device)
    mask.masked_fill_(~allowed, float("-inf"))
    t = torch.arange(tokens.start, tokens.stop, device=table.device)
    token_seq = torch.searchsorted(qsl[seqs.start + 1: seqs.stop + 1], t, right=True)  # [t]
    token_off = t - qsl[seqs.start: seqs.stop][token_seq]
    return _GatherPlan(seqs, tokens, block_ids, mask[:, None], token_seq, token_off, max_q)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int) -> None:
    """Scatter new keys/values ([T, kv_heads, hd]) into their slots (-1 = skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0, blocks, :, offsets] = k.to(kv_cache.dtype)
    kv_cache[1, blocks, :, offsets] = v.to(kv_cache.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out [s, h, L, hd], lse [s, h, L] float32)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask.to(q.dtype), scale=scale)
        return out, lse.float()
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + mask        # [s, h, L, K]
    lse = torch.logsumexp(scores, dim=-1)                                   # [s, h, L]
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    return out, lse


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend` of query rows that end where the keys end (mask None: the rows are the
    keys' own positions, top-left causal)."""
    if mask is None:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, is_causal=True, scale=scale)
            return out, lse.float()
        L = q.shape[-2]
        above = torch.ones(L, L, dtype=torch.bool, device=q.device).triu_(1)
        mask = torch.zeros(L, L, dtype=q.dtype, device=q.device).masked_fill_(above, float("-inf"))
    return _attend(q, k, v, mask, scale)


class PagedAttention(nn.Module):
    """Attention of one layer over its paged KV cache, with learned sinks per head.

    Where the execution plan's `attention` is "native", decodes go through the in-place C++
    kernel (`layers/paged_decode.py`) and a step whose prefill chunks all start at 0 attends
    them over their own k/v (`_attend_fresh`); other prefill chunks, and every step under a
    "reference" plan, take the reference path (gather the visible blocks, SDPA with lse)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None, group: int, ctx: ParallelContext,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.group = window, group
        self.scale = head_dim ** -0.5
        self.plan = plan or execution_plan.current()
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)

    def native(self, device: torch.device) -> bool:
        """Whether this layer's plan runs attention on the native kernels here."""
        return device.type == "cpu" and self.plan.attention == "native"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, h, hd], k/v [T, kvh, hd] → [T, h, hd]."""
        native = self.native(q.device)
        if native and kv_cache.is_contiguous():
            kernel.write_kv(kv_cache, k, v, meta.slot_mappings[self.group])
        else:
            write_kv(kv_cache, k, v, meta.slot_mappings[self.group], meta.block_size)
        nd = meta.num_decodes
        in_place = nd > 0 and native
        if in_place and nd == q.shape[0]:                  # decode-only step: the kernel alone
            return self._decode_in_place(q, kv_cache, meta)
        out = torch.empty_like(q)
        if in_place:
            out[:nd] = self._decode_in_place(q[:nd], kv_cache, meta)
        fresh = meta.fresh_plan() if self.plan.fresh_prefill else None
        if fresh is not None:
            dt = kv_cache.dtype      # the keys the gather path would read: rounded like the cache
            k, v = ((k, v) if k.dtype == dt else (k.to(dt).to(q.dtype), v.to(dt).to(q.dtype)))
            t = fresh.tokens
            out[t] = self._attend_fresh(q[t], k[t], v[t], fresh)
        parts = ("prefill",) if in_place else ("decode", "prefill")
        for part in parts[:-1] + ("continued",) if fresh is not None else parts:
            plan = meta.plan(self.group, self.window, part)
            if plan is not None:
                out[plan.tokens] = self._attend_part(q[plan.tokens], kv_cache, plan)
        return out

    def fuses_decode(self, x: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata) -> bool:
        """Whether `rope_attend` may take its one native call for this step of activations x
        ([T, ...]): every token a decode, the plan's fused decode (native kernels), the cache
        contiguous in the activations' dtype, eager (a compiled graph keeps the separate
        ops, which it fuses itself)."""
        return (meta.num_decodes == x.shape[0] and self.plan.fused_decode
                and self.native(x.device) and kv_cache.dtype == x.dtype
                and kv_cache.is_contiguous() and not torch.compiler.is_compiling())

    def rope_attend(self, qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    fused: FusedDecode | None) -> torch.Tensor:
        """RoPE of the q and k heads (qk [T, h + kvh, hd]), the K/V write and attention of
        one step → [T, h·hd]. `fused` (a decode-only step, `fuses_decode`): all three in one
        native call, bitwise the separate ops (`rotary.rotate`, then `forward`) that serve
        every other step."""
        if fused is not None:
            return kernel.rotary_decode(qk, v, positions, fused.cos, fused.sin, kv_cache,
                                        meta.slot_mappings[self.group],
                                        meta.block_tables[self.group], meta.seq_lens,
                                        self.sinks, self.scale, self.window or 0)
        q, k = rotary.rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        return self.forward(q, k, v, kv_cache, meta).flatten(1)     # [T, h, hd] → [T, h·hd]

    def _decode_in_place(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """The first num_decodes sequences, one query each, read from their blocks in place."""
        nd = q.shape[0]
        table = meta.block_tables[self.group][:nd]
        return kernel.decode(q.to(kv_cache.dtype), kv_cache, table, meta.seq_lens[:nd],
                             self.sinks, self.scale, self.window or 0).to(q.dtype)

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      plan: _FreshPlan) -> torch.Tensor:
        """Prefill chunks from position 0 over their own k/v: [t, h, hd] → [t, h, hd].
        The native kernel where it is built (csrc/prefill*: tiles of query rows against
        blocks of keys, only the visible ones); otherwise SDPA in query pieces."""
        if self.native(q.device):
            return _prefill_op()(q, k, v, plan.cu_seqlens, self.sinks, self.scale,
                                 self.window or 0).to(q.dtype)
        if not plan.padded:
            outs, i = [], 0
            for n in plan.lens:
                outs.append(self._attend_batch(q[None, i:i + n], k[None, i:i + n],
                                               v[None, i:i + n], plan)[0])
                i += n
            return torch.cat(outs)
        s, L = len(plan.lens), plan.max_q
        if plan.token_seq is None:                       # equal lengths: views, no copy
            return self._attend_batch(q.view(s, L, *q.shape[1:]), k.view(s, L, *k.shape[1:]),
                                      v.view(s, L, *v.shape[1:]), plan).reshape(q.shape)
        # right padding: a real query never sees a padded key (they sit after it)
        rows, cols = plan.token_seq, plan.token_off
        pq, pk, pv = (x.new_zeros(s, L, *x.shape[1:]) for x in (q, k, v))
        pq[rows, cols], pk[rows, cols], pv[rows, cols] = q, k, v
        return self._attend_batch(pq, pk, pv, plan)[rows, cols]

    def _attend_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      plan: _FreshPlan) -> torch.Tensor:
        """Causal attention of s sequences from position 0: q [s, L, h, hd], k/v
        [s, L, kvh, hd] → [s, L, h, hd], sinks and this layer's window applied."""
        s, L, h, hd = q.shape
        g = h // self.num_kv_heads
        if g > 1:                # each KV head serves its g query heads (GQA)
            k, v = (x.unsqueeze(3).expand(s, L, self.num_kv_heads, g, hd).reshape(s, L, h, hd)
                    for x in (k, v))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))                 # [s, h, L, hd]
        sinks = self.sinks.view(1, h, 1)
        out = q.new_empty(s, L, h, hd)        # each piece's rows written once, sinks applied
        for a, b, k0, mask in plan.pieces(L, self.window, q.dtype, q.device):
            part, lse = _attend_causal(qt[:, :, a:b], kt[:, :, k0:b], vt[:, :, k0:b], mask,
                                       self.scale)
            weight = torch.sigmoid(lse - sinks).unsqueeze(-1).to(part.dtype)
            torch.mul(part, weight, out=out[:, a:b].transpose(1, 2))
        return out

    def _attend_part(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     plan: _GatherPlan) -> torch.Tensor:
        s = plan.block_ids.shape[0]
        kvh, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        hd, L = self.head_dim, plan.max_q
        keys = kv_cache[0, plan.block_ids]                                  # [s, nb, kvh, B, hd]
        values = kv_cache[1, plan.block_ids]
        keys = keys.transpose(1, 2).reshape(s, kvh, -1, hd)                 # [s, kvh, K, hd]
        values = values.transpose(1, 2).reshape(s, kvh, -1, hd)
        # queries padded per sequence, the g query heads of a KV head stacked as rows
        padded = q.new_zeros(s, L, self.num_heads, hd)                      # [s, L, h, hd]
        padded[plan.token_seq, plan.token_off] = q
        padded = padded.view(s, L, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(s, kvh, g * L, hd)
        mask = plan.mask if L == 1 else plan.mask[:, :, None].expand(s, 1, g, L,
                                                                     -1).reshape(s, 1, g * L, -1)
        out, lse = _attend(padded, keys.to(q.dtype), values.to(q.dtype), mask, self.scale)
        sinks = self.sinks.view(kvh, g, 1).expand(kvh, g, L).reshape(1, kvh, g * L)
        out = out * torch.sigmoid(lse - sinks).unsqueeze(-1).to(out.dtype)  # [s, kvh, g*L, hd]
        out = out.view(s, kvh, g, L, hd).permute(0, 3, 1, 2, 4).reshape(s, L, self.num_heads, hd)
        return out[plan.token_seq, plan.token_off]                          # [t, h, hd]
