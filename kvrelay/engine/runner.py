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

Compiled decode steps (`KVRELAY_COMPILE_DECODE`, opt-in): a decode-only step of S
sequences pads to the smallest compiled batch size b ≥ S and runs the forward (and LM
head) that torch.compile built for that shape during warm-up; every other step runs
eagerly. Padding rows read and write nothing real: token 0 at position 0, no KV slot
(-1), context 1 in the null block 0. The block tables of compiled steps are as wide as
the longest sequence allowed (max positions / B), so the shapes are the same every step.

KV tensors: with the hybrid manager a block id belongs to one group at a time, so
layer j of group 0 and layer j of group 1 share one `[2, num_blocks, ...]` tensor;
memory per block is (layers in the largest group) × 2 × kv_heads × B × head_dim.
"""
from __future__ import annotations

import array
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay import envs
from kvrelay.model import compile_hints, kernels
from kvrelay.model.gpt_oss import GptOssModel
from kvrelay.model.layers import moe, paged_decode, screened
from kvrelay.model.layers.attention import AttentionMetadata
from kvrelay.model.layers.linear import runs_on_dense_kernel

logger = logging.getLogger(__name__)


# Inductor settings of compiled decode steps, each measured on the tiny model's c=1 step:
# frozen weights are constants (folded, prepacked for oneDNN); the C++ wrapper calls the
# kernels without Python; max-autotune picks Inductor's C++ GEMM templates, which skip
# oneDNN's ~13 µs per call on tiny bf16 matmuls (eager 1.05 ms → 0.17 ms of CPU per step)
COMPILE_OPTIONS: dict[str, Any] = {"freezing": True, "cpp_wrapper": True, "max_autotune": True}

# An LM head weight this large takes every thread even in a step small enough for one
# (`ModelRunner.head_threads`): the dense kernel's own rule wakes a thread per 4 MiB streamed.
HEAD_SPLIT_BYTES = 4 << 20


@dataclass
class StepInput:
    token_ids: list[int]                     # the new tokens of every chunk, flattened
    query_lens: list[int]                    # per chunk
    starts: list[int]                        # per chunk: tokens already in the KV cache
    block_tables: list[list[list[int]]]      # [group][chunk] → block ids
    logits_rows: list[int]                   # flattened token indices whose logits are wanted
    num_decodes: int = 0                     # leading chunks with one token each
    dp_token_counts: tuple[int, ...] | None = None  # EP across DP: every replica's tokens this step
    kv_work: Any = None                      # disaggregation: KV reads for ranks ≥ 1 to start
                                             # before this step (kvrelay/disagg/worker.KVWork)
    greedy: bool = False                     # every logits row is a plain greedy sample
                                             # (step_io.greedy_only): `execute` may return the
                                             # token ids instead of the logits


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
        # ... but the LM head of a small step on every thread where it streams a large weight
        # on the dense kernel: one parallel region a step (its split is its own rule's),
        # whose results do not depend on the thread count; a small model's c=1 step is
        # mostly that stream (the tiny o200k model: 12.9 MB of 14 MB read per token)
        self.head_threads = (self.single_thread_macs > 0 and self.max_threads > 1
                             and model.lm_head.weight.nbytes >= HEAD_SPLIT_BYTES)
        self.table_width = -(-model.max_positions // block_size)   # blocks of the longest sequence
        self.decode_buckets = compile_buckets(model, self.device)
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._aranges: dict[int, torch.Tensor] = {}
        self._wide_tables: dict[tuple[int, int], torch.Tensor] = {}
        self.compiled_steps = 0              # decode steps that ran the compiled forward

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        if step.num_decodes == len(step.query_lens):
            return self._prepare_decodes(step)
        dev = self.device
        q_lens = _ints(step.query_lens, None)
        starts = _ints(step.starts, None)
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
        return _ints(step.token_ids, dev), positions.to(dev), meta

    def _prepare_decodes(self, step: StepInput, rows: int | None = None,
                         width: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode-only step: token i of sequence i sits at position starts[i]. `rows`
        pads it to a compiled batch size; `width` gives the block tables that width (the
        compiled graphs' shape), in a persistent buffer per (group, rows) of which only the
        used columns are rewritten: columns past a row's blocks are never read.

        The indices are computed on Python ints and become tensors in one call each: at
        a few sequences, tensor ops (each ~1 µs of dispatch) cost more than the maths."""
        dev, B, starts = self.device, self.block_size, step.starts
        n = rows or len(starts)
        pad = n - len(starts)
        tables, slots = [], []
        for g in range(self.num_groups):
            blocks = step.block_tables[g]
            slots.append(_ints([t[p // B] * B + p % B for t, p in zip(blocks, starts)]
                               + [-1] * pad, dev))
            table = _table(blocks, n)
            if width is not None:
                wide = self._wide_tables.get((g, n))
                if wide is None:
                    wide = self._wide_tables[(g, n)] = torch.zeros(
                        n, width, dtype=torch.int64, device=dev)
                wide[:, :table.shape[1]] = table
                table = wide
            tables.append(table.to(dev))
        seq_lens = _ints([p + 1 for p in starts] + [1] * pad, dev)
        meta = AttentionMetadata(self._arange(n + 1), seq_lens, tuple(tables), tuple(slots), B, n)
        ids = _ints(step.token_ids + [0] * pad, dev)
        positions = _ints(starts + [0] * pad, dev)
        return ids, positions, meta

    def _arange(self, n: int) -> torch.Tensor:
        """query_start_loc of n - 1 decodes; never written, so one tensor per size serves."""
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n, device=self.device)
        return self._aranges[n]

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Runs the step; returns float32 logits [len(logits_rows), V] on the CPU — or, for
        a `greedy` step where the LM head gives them directly, the rows' greedy token ids
        (int64 [len(logits_rows)]: `GptOssModel.compute_logits`)."""
        bucket = self._bucket(step)
        if bucket:
            return self._execute_compiled(step, bucket)
        self._set_threads(len(step.token_ids), len(step.logits_rows))
        ids, positions, meta = self.prepare(step)
        if step.dp_token_counts is not None:        # MoE layers gather all replicas' tokens
            group = self.model.ctx.expert_group
            assert group is not None          # set whenever dp_token_counts is
            group.begin_step(step.dp_token_counts)
        hidden = self.model(ids, positions, self.kv_caches, meta)             # [T, H]
        if step.logits_rows != list(range(hidden.shape[0])):   # not every row in order (decodes)
            hidden = hidden[_ints(step.logits_rows, self.device)]
        self._head_threads(hidden)
        return self.model.compute_logits(hidden, step.greedy).cpu()

    def _head_threads(self, hidden: torch.Tensor) -> None:
        """Every thread for a large LM head on the dense kernel (`head_threads`)."""
        if (self.head_threads and torch.get_num_threads() < self.max_threads
                and runs_on_dense_kernel(hidden, self.model.lm_head.weight,
                                         self.model.lm_head.plan)):
            torch.set_num_threads(self.max_threads)    # until the next step's _set_threads

    @torch.inference_mode()         # as `execute`
    def warm_greedy_head(self, max_rows: int) -> int:
        """The LM head's greedy path once per greedy decode step of 1..max_rows rows (at most
        the screen's MAX_ROWS), at the thread count `execute` gives that step's head: the
        screened head's int8 copy and per-key bit checks (layers/screened.py) then happen in
        warm-up, not in the first requests' steps — for the keys whose check is cheap
        (`screened.warmed_ahead`). Only where the plan screens the head; returns the row
        counts warmed."""
        head = self.model.lm_head
        if not head.plan.screened_head or self.model.ctx.tp_size != 1 \
                or self.device.type != "cpu":
            return 0
        g = torch.Generator().manual_seed(0)
        warmed = 0
        for rows in range(1, min(max_rows, screened.MAX_ROWS) + 1):
            hidden = torch.randn(rows, head.weight.shape[1], generator=g)     # [rows, H]
            hidden = hidden.to(self.model.dtype)
            if not screened.warmed_ahead(hidden, head.weight, head.plan):
                continue
            self._set_threads(rows, rows)              # a decode step: one token per row
            self._head_threads(hidden)
            self.model.compute_logits(hidden, greedy=True)
            warmed += 1
        return warmed


    # -- compiled decode steps ------------------------------------------------------------------
    def _bucket(self, step: StepInput) -> int | None:
        """The compiled batch size this step pads to, or None (eager)."""
        if self._compiled is None or step.num_decodes != len(step.query_lens) \
                or step.dp_token_counts is not None:
            return None
        n = len(step.query_lens)
        return next((b for b in self.decode_buckets if b >= n), None)

    @torch.inference_mode()         # as `execute`: the graph's guards include grad mode
    def _execute_compiled(self, step: StepInput, bucket: int) -> torch.Tensor:
        """A decode step through the graph compiled for `bucket`."""
        assert self._compiled is not None
        self._set_threads(bucket, bucket)           # the thread count it was compiled under
        try:
            ids, positions, meta = self._prepare_decodes(step, bucket, self.table_width)
            logits = self._compiled(ids, positions, meta)                   # [bucket, V]
        except Exception as e:  # noqa: BLE001 -- stay correct: this step and later ones eager
            logger.warning("a compiled decode step failed (%s: %s); running eagerly from now on",
                           type(e).__name__, _first_line(e))
            logger.debug("the compiled step's failure", exc_info=True)
            self._compiled, self.decode_buckets = None, ()
            return self.execute(step)
        self.compiled_steps += 1
        rows = step.logits_rows
        if rows == list(range(len(rows))):
            return logits[:len(rows)].cpu()
        return logits[torch.tensor(rows, dtype=torch.int64, device=self.device)].cpu()

    def _forward_logits(self, ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """The forward and LM head of every row: what `torch.compile` traces. The KV
        caches are read as attributes, not passed: as arguments, the layers' aliases of
        one tensor made the graph copy the whole cache around its in-place writes."""
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))

    def compile_decode(self) -> None:
        """Compiles the decode forward for every bucket by running a dummy decode step of
        that size (writing nothing; reading the null block). A failure leaves the runner
        eager, with a warning: compiling is an optimisation, never a reason not to serve."""
        if not self.decode_buckets:
            return
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, len(self.decode_buckets) + 1)
        compile_hints.apply()                    # the capability probes are constants
        self._compiled = torch.compile(self._forward_logits, dynamic=False, fullgraph=True)
        tables = [[[0]] for _ in range(self.num_groups)]
        # set globally while compiling: `torch.compile(options=...)` does not apply freezing;
        # autotuning's tables of timings (written to stderr) left out of the server's log
        with torch._inductor.config.patch(autotune_num_choices_displayed=0, **COMPILE_OPTIONS):
            self._compile_buckets(tables)
        if self._compiled is not None:
            # from now on only the graphs compiled above: a step whose guards they fail
            # (none is expected) runs eagerly instead of recompiling for tens of seconds
            # mid-serving; cheaper per call than torch.compile's own wrapper, too
            self._compiled = torch._dynamo.run(self._forward_logits)

    def _compile_buckets(self, tables: list[list[list[int]]]) -> None:
        for b in self.decode_buckets:
            t0 = time.perf_counter()
            step = StepInput([0] * b, [1] * b, [0] * b, [t * b for t in tables],
                             list(range(b)), num_decodes=b)
            self._execute_compiled(step, b)
            if self._compiled is None:
                return                               # failed, and said so
            logger.info("decode forward compiled for %d sequence(s) in %.1fs", b,
                        time.perf_counter() - t0)

    def _set_threads(self, tokens: int, rows: int) -> None:
        if self.max_threads <= 1 or not self.single_thread_macs:
            return
        macs = tokens * self.token_macs + rows * self.row_macs
        threads = 1 if macs < self.single_thread_macs else self.max_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def compile_buckets(model: GptOssModel, device: torch.device) -> tuple[int, ...]:
    """The decode batch sizes `KVRELAY_COMPILE_DECODE` asks to compile, or () where
    compiling does not apply (with a warning saying why)."""
    raw = envs.COMPILE_DECODE.raw()
    if not raw:
        return ()
    try:
        buckets = tuple(sorted({int(b) for b in raw.split(",") if b.strip()}))
    except ValueError:
        buckets = ()
    if not buckets or buckets[0] < 1:
        raise ValueError(f"{envs.COMPILE_DECODE.shown}: expected batch sizes such as "
                         f"'1,2,4,8', got {raw!r}")
    ctx = model.ctx
    why = ("it compiles for the CPU only" if device.type != "cpu"
           else "tensor/expert parallel collectives are not traced" if ctx.tp_size > 1
           or ctx.ep_size > 1 or ctx.expert_group is not None
           else "the native kernels are unavailable or turned off"
           if not (paged_decode.enabled() and kernels.kernels_available()
                   and moe.moe_kernel_mode() != "torch")
           else "")
    if why:
        logger.warning("%s is set but ignored: %s", envs.COMPILE_DECODE.shown, why)
        return ()
    return buckets


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _pad_table(rows: list[list[int]]) -> torch.Tensor:
    """Block ids per sequence, zero-padded to the widest: one tensor built in one call
    (a `torch.tensor` per row costs microseconds each, per group, per step)."""
    return _table(rows, len(rows))


def _table(rows: list[list[int]], n: int) -> torch.Tensor:
    """[n, widest] int64: the rows zero-padded, then all-zero rows up to n."""
    width = max((len(r) for r in rows), default=0) or 1
    flat: list[int] = []
    for r in rows:
        flat += r
        flat += [0] * (width - len(r))
    return _ints(flat + [0] * (width * (n - len(rows))), None).view(n, width)


def _ints(values: list[int], device: torch.device | None) -> torch.Tensor:
    """int64 tensor of Python ints: through an `array` buffer, ~2x faster than
    `torch.tensor(list)` (which converts element by element)."""
    t = torch.frombuffer(array.array("q", values), dtype=torch.int64) if values \
        else torch.empty(0, dtype=torch.int64)
    return t if device is None or device.type == "cpu" else t.to(device)
