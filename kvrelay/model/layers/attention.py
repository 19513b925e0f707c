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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvrelay.model.layers import paged_decode as kernel
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
    _plans: dict[tuple[int, int | None, str], _GatherPlan | None] = field(default_factory=dict,
                                                                          repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def plan(self, group: int, window: int | None, part: str) -> _GatherPlan | None:
        """The gather indices and mask for (group, window, part); built once per step
        and shared by every layer with the same group and window."""
        key = (group, window, part)
        if key not in self._plans:
            self._plans[key] = _build_plan(self, group, window, part)
        return self._plans[key]


@dataclass
class _GatherPlan:
    seqs: slice                # which sequences
    tokens: slice              # which flattened tokens
    block_ids: torch.Tensor    # [s, nb] cache blocks to gather per sequence
    mask: torch.Tensor         # [s, 1, max_q, nb*B] additive (0 or -inf)
    token_seq: torch.Tensor    # [t] row of each token in the padded query batch
    token_off: torch.Tensor    # [t] column of each token in the padded query batch
    max_q: int


def _build_plan(meta: AttentionMetadata, group: int, window: int | None,
                part: str) -> _GatherPlan | None:
    nd = meta.num_decodes
    qsl = meta.query_start_loc
    if part == "decode":
        seqs, tokens = slice(0, nd), slice(0, nd)
    else:
        seqs, tokens = slice(nd, meta.num_seqs), slice(int(qsl[nd]), int(qsl[-1]))
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


class PagedAttention(nn.Module):
    """Attention of one layer over its paged KV cache, with learned sinks per head.

    Decodes go through the in-place C++ kernel (`layers/paged_decode.py`) where it is
    available; prefill chunks, and decodes without the kernel, through the reference path
    (gather the visible blocks, SDPA with lse). `use_kernel = False` forces the reference."""

    use_kernel = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None, group: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.group = window, group
        self.scale = head_dim ** -0.5
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, h, hd], k/v [T, kvh, hd] → [T, h, hd]."""
        native = self.use_kernel and kernel.available(q.device)
        if native and kv_cache.is_contiguous():
            kernel.write_kv(kv_cache, k, v, meta.slot_mappings[self.group])
        else:
            write_kv(kv_cache, k, v, meta.slot_mappings[self.group], meta.block_size)
        nd = meta.num_decodes
        in_place = nd > 0 and self.use_kernel and kernel.available(q.device)
        if in_place and nd == q.shape[0]:                  # decode-only step: the kernel alone
            return self._decode_in_place(q, kv_cache, meta)
        out = torch.empty_like(q)
        if in_place:
            out[:nd] = self._decode_in_place(q[:nd], kv_cache, meta)
        for part in ("prefill",) if in_place else ("decode", "prefill"):
            plan = meta.plan(self.group, self.window, part)
            if plan is not None:
                out[plan.tokens] = self._attend_part(q[plan.tokens], kv_cache, plan)
        return out

    def _decode_in_place(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """The first num_decodes sequences, one query each, read from their blocks in place."""
        nd = q.shape[0]
        table = meta.block_tables[self.group][:nd]
        return kernel.decode(q.to(kv_cache.dtype), kv_cache, table, meta.seq_lens[:nd],
                             self.sinks, self.scale, self.window or 0).to(q.dtype)

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
