"""The model runner: owns the model and every device tensor (KV caches, inputs).

`StepInput` is the compact, tensor-free description of a step that the engine core
builds from the scheduler's output (and that a multi-process executor can ship to
worker ranks). `execute` turns it into the model's flattened inputs with vectorised
tensor code and returns the float32 logits of the rows that need them.

Index maths for one step (block size B):

    chunk i: tokens [start_i, start_i + q_i) of request i
    cu_q      = [0, q_0, q_0+q_1, ...]                      (query_start_loc)
    seq_of[t] = i for t in [cu_q[i], cu_q[i+1])
    pos[t]    = start_i + (t - cu_q[i])
    slot[g,t] = table_g[i, pos[t] // B] * B + pos[t] % B     per KV-cache group g
    seq_lens  = start_i + q_i

KV tensors: with the hybrid manager a block id belongs to one group at a time, so
layer j of group 0 and layer j of group 1 share one `[2, num_blocks, ...]` tensor;
memory per block is (layers in the largest group) × 2 × kv_heads × B × head_dim.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay import envs
from kvrelay.model.gpt_oss import GptOssModel
from kvrelay.model.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class StepInput:
    token_ids: list[int]                     # the new tokens of every chunk, flattened
    query_lens: list[int]                    # per chunk
    starts: list[int]                        # per chunk: tokens already in the KV cache
    block_tables: list[list[list[int]]]      # [group][chunk] → block ids
    logits_rows: list[int]                   # flattened token indices whose logits are wanted
    num_decodes: int = 0                     # leading chunks with one token each
    dp_token_counts: tuple[int, ...] | None = None   # EP across DP: every replica's tokens this step
    kv_work: Any = None                      # disaggregation: KV reads for ranks ≥ 1 to start
                                             # before this step (kvrelay/disagg/worker.KVWork)


def kv_tensor_index(layer_groups: tuple[int, ...]) -> tuple[list[int], int]:
    """For each layer, which shared KV tensor it uses, and how many tensors exist."""
    seen: dict[int, int] = {}
    index = []
    for g in layer_groups:
        index.append(seen.get(g, 0))
        seen[g] = seen.get(g, 0) + 1
    return index, max(seen.values())


def kv_bytes_per_block(model: GptOssModel, block_size: int) -> int:
    _, num_tensors = kv_tensor_index(model.layer_groups)
    elem = torch.empty((), dtype=model.dtype).element_size()
    return num_tensors * 2 * model.num_kv_heads_local * block_size * model.config.head_dim * elem


class ModelRunner:
    def __init__(self, model: GptOssModel, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.model, self.block_size = model, block_size
        self.device = torch.device(device)
        index, num_tensors = kv_tensor_index(model.layer_groups)
        shape = (2, num_blocks, model.num_kv_heads_local, block_size, model.config.head_dim)
        self.kv_tensors = [torch.zeros(shape, dtype=model.dtype, device=self.device)
                           for _ in range(num_tensors)]
        self.kv_caches = [self.kv_tensors[i] for i in index]          # per layer (aliases)
        self.num_groups = max(model.layer_groups) + 1
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size,
                    sum(t.nbytes for t in self.kv_tensors) / 2**20)
        # small steps on one thread: every op of a small step is a parallel region whose
        # barrier costs more than the split saves, and on shared cores a preempted thread
        # stalls its partner at every barrier (measured: 2 threads 50x slower than 1 under load)
        self.max_threads = torch.get_num_threads()
        self.single_thread_macs = (envs.SINGLE_THREAD_STEP_MACS.as_float() or 0.0
                                   if self.device.type == "cpu" else 0.0)
        self.token_macs, self.row_macs = step_macs(model)

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        if step.num_decodes == len(step.query_lens):
            return self._prepare_decodes(step)
        dev = self.device
        q_lens = torch.tensor(step.query_lens, dtype=torch.int64)
        starts = torch.tensor(step.starts, dtype=torch.int64)
        cu_q = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)   # [T]
        positions = starts[seq_of] + torch.arange(int(cu_q[-1])) - cu_q[seq_of]
        tables, slots = [], []
        for g in range(self.num_groups):
            table = _pad_table(step.block_tables[g])                           # [S, max_blocks]
            tables.append(table.to(dev))
            blocks = table[seq_of, positions // self.block_size]
            slots.append((blocks * self.block_size + positions % self.block_size).to(dev))
        meta = AttentionMetadata(cu_q.to(dev), (starts + q_lens).to(dev), tuple(tables),
                                 tuple(slots), self.block_size, step.num_decodes)
        ids = torch.tensor(step.token_ids, dtype=torch.int64, device=dev)
        return ids, positions.to(dev), meta

    def _prepare_decodes(self, step: StepInput
                         ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode-only step: token i of sequence i sits at position starts[i]."""
        dev, B, S = self.device, self.block_size, len(step.starts)
        positions = torch.tensor(step.starts, dtype=torch.int64)
        rows = torch.arange(S)
        tables, slots = [], []
        for g in range(self.num_groups):
            table = _pad_table(step.block_tables[g])
            tables.append(table.to(dev))
            slots.append((table[rows, positions // B] * B + positions % B).to(dev))
        meta = AttentionMetadata(torch.arange(S + 1, device=dev), (positions + 1).to(dev),
                                 tuple(tables), tuple(slots), B, S)
        ids = torch.tensor(step.token_ids, dtype=torch.int64, device=dev)
        return ids, positions.to(dev), meta

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Runs the step; returns float32 logits [len(logits_rows), V] on the CPU."""
        self._set_threads(len(step.token_ids), len(step.logits_rows))
        ids, positions, meta = self.prepare(step)
        if step.dp_token_counts is not None:        # MoE layers gather all replicas' tokens
            self.model.ctx.expert_group.begin_step(step.dp_token_counts)
        hidden = self.model(ids, positions, self.kv_caches, meta)             # [T, H]
        rows = torch.tensor(step.logits_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows]).cpu()


    def _set_threads(self, tokens: int, rows: int) -> None:
        if self.max_threads <= 1 or not self.single_thread_macs:
            return
        macs = tokens * self.token_macs + rows * self.row_macs
        threads = 1 if macs < self.single_thread_macs else self.max_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def warmup(self) -> float:
        """One small prefill and one decode through the model (first-call kernel setup)
        writing only into the null block; returns the seconds it took."""
        import time
        t0 = time.perf_counter()
        n = min(self.block_size, 8)
        tables = [[[0]] for _ in range(self.num_groups)]
        self.execute(StepInput([0] * n, [n], [0], tables, [n - 1]))
        self.execute(StepInput([0], [1], [n - 1], tables, [0], num_decodes=1))
        return time.perf_counter() - t0


def step_macs(model: GptOssModel) -> tuple[int, int]:
    """Multiply-adds per token through the layers (attention projections, router, the
    top-k experts), and per logits row (the LM head), for this rank."""
    c = model.config
    attn = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
        + c.num_attention_heads * c.head_dim * c.hidden_size
    experts = 3 * c.num_experts_per_tok * c.hidden_size * c.intermediate_size
    moe = c.hidden_size * c.num_local_experts + experts
    tp = model.ctx.tp_size
    return c.num_hidden_layers * (attn + moe) // tp, c.vocab_size * c.hidden_size // tp


def _pad_table(rows: list[list[int]]) -> torch.Tensor:
    """Block ids per sequence, zero-padded to the widest: one tensor built in one call
    (a `torch.tensor` per row costs microseconds each, per group, per step)."""
    width = max((len(r) for r in rows), default=0) or 1
    padded = [r + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).view(-1, width)
