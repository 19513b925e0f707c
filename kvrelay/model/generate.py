"""A minimal greedy loop over the model with a paged KV cache.

A test and benchmark harness, not part of serving (the engine's scheduler and runner
are): the model tests use it to drive the model alone through prefill, chunked prefill
and incremental decoding, and `benchmarks/model_forward.py` to time forward passes.
Each sequence gets its own blocks from a simple free list (optionally shuffled, so
block tables are deliberately non-contiguous).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvrelay.model.gpt_oss import GptOssModel
from kvrelay.model.layers.attention import AttentionMetadata


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0          # tokens whose KV is in the cache


class PagedGreedyLoop:
    """Owns a KV cache and the block tables of the sequences it is given."""

    def __init__(self, model: GptOssModel, num_blocks: int, block_size: int,
                 shuffle_blocks: bool = False, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        device = next(model.parameters()).device
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, device)
        self.free = list(range(num_blocks))
        if shuffle_blocks:
            random.Random(seed).shuffle(self.free)
        self.num_groups = max(model.layer_groups) + 1

    def _ensure_blocks(self, seq: _Seq, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            if not self.free:
                raise RuntimeError("PagedGreedyLoop: out of KV blocks")
            seq.blocks.append(self.free.pop())

    @torch.no_grad()
    def step(self, seqs: list[_Seq], num_new: list[int]) -> torch.Tensor:
        """Feed `num_new[i]` not-yet-computed tokens of each sequence; returns the float32
        logits of every fed token, flattened [T, V]."""
        device = self.kv_caches[0].device
        ids, pos, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, n in zip(seqs, num_new):
            end = seq.computed + n
            self._ensure_blocks(seq, end)
            for p in range(seq.computed, end):
                ids.append(seq.tokens[p])
                pos.append(p)
                block = seq.blocks[p // self.block_size]
                slots.append(block * self.block_size + p % self.block_size)
            q_lens.append(n)
            seq_lens.append(end)
            seq.computed = end
        width = max(len(s.blocks) for s in seqs)
        table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs],
                             device=device)
        slot_t = torch.tensor(slots, device=device)
        qsl = torch.tensor([0] + q_lens, device=device).cumsum(0)
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
        meta = AttentionMetadata(qsl, torch.tensor(seq_lens, device=device),
                                 (table,) * self.num_groups, (slot_t,) * self.num_groups,
                                 self.block_size, num_decodes)
        hidden = self.model(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                            self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def generate(self, prompt: list[int], max_new_tokens: int, chunk: int | None = None,
                 stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy decoding of one prompt (prefilled in chunks of `chunk` tokens)."""
        seq = _Seq(list(prompt))
        chunk = chunk or len(prompt)
        while seq.computed < len(prompt):
            logits = self.step([seq], [min(chunk, len(prompt) - seq.computed)])
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            if token in stop_ids:
                break
            seq.tokens.append(token)
            logits = self.step([seq], [1])
        self.free.extend(seq.blocks)
        return out

    def decode_batch(self, prompts: list[list[int]], steps: int) -> torch.Tensor:
        """Prefill every prompt in one step, then `steps` decode-only steps of them all (each
        sequence fed its own greedy token): every decode step's logits, [steps, B, V] —
        batched decode steps as the engine runs them (tests compare paths on these)."""
        seqs = [_Seq(list(p)) for p in prompts]
        logits = self.step(seqs, [len(p) for p in prompts])
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        out = []
        for _ in range(steps):
            for seq, row in zip(seqs, logits[last]):
                seq.tokens.append(int(row.argmax()))
            logits = self.step(seqs, [1] * len(seqs))
            last = torch.arange(len(seqs))
            out.append(logits)
        return torch.stack(out)
