"""gpt-oss mixture of experts: top-k router and grouped expert matmuls.

Router: logits = x Wᵀ + b; the top-k logits are soft-maxed among themselves.
Experts: h = x W_guᵀ + b_gu with gate/up interleaved (even rows gate, odd rows up);
gate ≤ limit, -limit ≤ up ≤ limit; act = (up + 1) · gate · σ(alpha · gate);
y = act W_dᵀ + b_d, weighted by the routing weight.

Two implementations of the expert computation, chosen by the execution plan's `moe`
(KVRELAY_MOE_KERNEL: auto | native | torch):
- native (`kvrelay.model.kernels`): one C++ call per layer covering every local expert —
  choices counting-sorted by expert, gate_up + swiglu and down + routing weight as two
  parallel sweeps over (expert, row tile), MXFP4 dequantised in registers, fp32
  accumulation throughout;
- torch (the reference it is tested against): tokens grouped by expert (argsort of the
  flattened (token, k) choices + bincount) and one matmul per *active* expert.

Sharding: a rank holds experts [e0, e1) (expert parallel, `ep_size` ways) and, of
each, the intermediate rows [i0, i1) (tensor parallel, zero-padded to whole MXFP4
blocks; see `shard_range`). Partial outputs are all-reduced; the down bias is added
by one rank only. With experts sharded across data-parallel replicas the tokens of
all replicas are gathered first (`ep_dispatch.py`).

Weights are stored `[E_local, out, in]` (like nn.Linear). Transformers' bf16
checkpoint tensors are `[E, in, out]` and get transposed at load; MXFP4 tensors are
already `[E, out, in/32, 16]` and stay packed (`MXFP4Tensor`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay import envs
from kvrelay.model import execution_plan, kernels
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers import moe_tiles
from kvrelay.model.layers.ep_dispatch import moe_across_replicas
from kvrelay.model.layers.linear import linear, runs_on_dense_kernel, upcasts
from kvrelay.model.layers.moe_mode import moe_kernel_mode as moe_kernel_mode  # re-exported
from kvrelay.model.mxfp4 import BLOCK, MXFP4Tensor
from kvrelay.model.parallel import Collectives, ParallelContext, divide, shard_range
from kvrelay.model.weights import WeightSource, padded_slice

_NATIVE_DENSE_DTYPES = (torch.float32, torch.bfloat16)   # and MXFP4, whatever the model dtype
_KERNEL_X_DTYPES = (torch.float32, torch.bfloat16)       # activations the kernel reads as given
# Dense experts run as torch GEMMs (MKL fp32 / oneDNN bf16) once each expert's matmuls
# have rows to reuse every weight for *and* enough work to pay for the Python loop over
# experts: rows per expert ≥ DENSE_TORCH_MIN_ROWS and rows per expert × hidden ×
# intermediate ≥ DENSE_TORCH_MIN_WORK. Measured (benchmarks/moe_kernels.py shapes, bf16,
# one thread, AVX512-BF16, CPU time): the kernel is 3.5-10× faster at hidden =
# intermediate = 32 for any batch, faster at 128 up to ~100 rows per expert, at 256 up to
# ~40, at 512 up to ~16; at 1024 oneDNN wins from 4 rows, and on a gpt-oss-20b layer the
# two are on par at 1-2 rows. Re-measured after the bf16 kernel got faster (session 6, Zen 4,
# one thread, CPU ms kernel / torch): "big" (1024/1024, 32 experts top-4) 2 / 4 / 8 rows per
# expert 7.8/17.0, 21.5/21.2, 38.2/23.0 (parity at 4 rows = 4.2M of work: the threshold);
# the embedded model (576/1536, 2 experts top-1) 1 / 2 / 4 / 6 / 8 / 12 / 16 rows 0.64/1.46,
# 0.73/1.73, 1.20/1.83, 1.35/1.54, 1.42/1.48, 1.84/1.79, 2.93/2.55 (parity at 8-12 rows; the
# threshold switches at 8, within 4 %). The constants stand.
DENSE_TORCH_MIN_ROWS = 2
DENSE_TORCH_MIN_WORK = 1 << 22
# MXFP4 experts take the kernel (dequantising in registers, ~4× faster at decode sizes)
# until an expert averages MXFP4_TORCH_MIN_ROWS rows: the kernel decodes every weight
# group again for each block of 8 rows, while the torch path dequantises each active
# expert once per call and runs torch's GEMMs (prefill of long prompts). Measured
# (`benchmarks/moe_kernels.py --tokens`, one thread, AVX512-BF16, CPU time): hidden 128,
# 8 experts top-2, 4096 tokens (1024 rows per expert): kernel 22.8 ms, torch 15 ms.
MXFP4_TORCH_MIN_ROWS = 256


@functools.cache
def route_topk_op() -> Any:
    """`kvrelay_kernels::route_topk` (csrc/fused_decode_op.cpp), resolved once."""
    return torch.ops.kvrelay_kernels.route_topk.default


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.plan = plan or execution_plan.current()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, self.bias, self.plan)              # [T, E]
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)               # [T, k]
        return torch.softmax(top_logits, dim=-1), top_ids

    def route_native(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the top-k and softmax in one native call: (weights [T, k] f32,
        expert ids [T, k] int64), the values the experts read from `forward`."""
        return route_topk_op()(linear(x, self.weight, self.bias, self.plan), self.top_k)


class Experts(nn.Module):
    """This rank's share of the experts, in the model dtype or packed MXFP4."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, ctx: ParallelContext,
                 dtype: torch.dtype, alpha: float, limit: float, mxfp4: bool,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.ctx, self.dtype, self.alpha, self.limit, self.mxfp4 = ctx, dtype, alpha, limit, mxfp4
        self.plan = plan or execution_plan.current()
        self.hidden, self.intermediate = hidden, intermediate
        self.num_local = divide(num_experts, ctx.ep_size, "num_local_experts (expert parallel)")
        self.first_expert = ctx.ep_rank * self.num_local
        granule = BLOCK if mxfp4 else 1
        self.i0, self.i1, self.i_local = shard_range(intermediate, ctx.moe_tp_size,
                                                     ctx.moe_tp_rank, granule)
        # each (token, expert) pair gets the down bias once: from the first intermediate shard
        self.add_down_bias = self.i0 == 0
        E, I = self.num_local, self.i_local  # noqa: E741 -- I as in the shape comments
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * I, dtype=dtype), requires_grad=False)
        self.down_bias = nn.Parameter(torch.zeros(E, hidden, dtype=dtype), requires_grad=False)
        self.gate_up: torch.Tensor | MXFP4Tensor
        self.down: torch.Tensor | MXFP4Tensor
        # fp32 copies of half-precision biases for the native kernel, keyed by the
        # source tensor's (data_ptr, version) so a reload refreshes them
        self._bias_f32: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        self._args: DecodeArgs | None = None       # `decode`'s arguments, made on first use
        if not mxfp4:
            self.gate_up = nn.Parameter(torch.zeros(E, 2 * I, hidden, dtype=dtype),
                                        requires_grad=False)
            self.down = nn.Parameter(torch.zeros(E, hidden, I, dtype=dtype), requires_grad=False)

    # -- loading -------------------------------------------------------------------------
    def load(self, src: WeightSource, prefix: str) -> None:
        e0, e1 = self.first_expert, self.first_expert + self.num_local
        rows = (2 * self.i0, 2 * self.i1, 2 * self.i_local)
        bias = self._local_slice(src, f"{prefix}.gate_up_proj_bias", 1, *rows)
        self.gate_up_bias.copy_(bias)
        self.down_bias.copy_(src.get(f"{prefix}.down_proj_bias", 0, e0, e1))
        if src.has(f"{prefix}.gate_up_proj_blocks"):
            self._load_mxfp4(src, prefix, rows)
        else:
            self._load_dense(src, prefix, rows)

    def _local_slice(self, src: WeightSource, name: str, dim: int, start: int, stop: int,
                     length: int) -> torch.Tensor:
        """This rank's experts, rows [start, stop) along `dim` zero-padded to `length`.
        When the rows are whole (expert parallel: a rank holds whole experts) only this
        rank's experts are read from disk."""
        e0, e1 = self.first_expert, self.first_expert + self.num_local
        if start == 0 and stop == length == src.shape(name)[dim]:
            return src.get(name, 0, e0, e1)
        return padded_slice(src, name, dim, start, stop, length)[e0:e1]

    def _load_dense(self, src: WeightSource, prefix: str, rows: tuple[int, int, int]) -> None:
        gate_up = self._local_slice(src, f"{prefix}.gate_up_proj", 2, *rows)       # [E, H, 2I]
        down = self._local_slice(src, f"{prefix}.down_proj", 1,                    # [E, I, H]
                                 self.i0, self.i1, self.i_local)
        # the loader keeps a dense checkpoint's experts dense (quantization "mxfp4" refuses it)
        assert isinstance(self.gate_up, torch.Tensor) and isinstance(self.down, torch.Tensor)
        self.gate_up.copy_(gate_up.transpose(1, 2))
        self.down.copy_(down.transpose(1, 2))

    def _load_mxfp4(self, src: WeightSource, prefix: str, rows: tuple[int, int, int]) -> None:
        g0, g1, gl = self.i0 // BLOCK, -(-self.i1 // BLOCK), self.i_local // BLOCK
        gu = MXFP4Tensor(
            self._local_slice(src, f"{prefix}.gate_up_proj_blocks", 1, *rows).to(torch.uint8),
            self._local_slice(src, f"{prefix}.gate_up_proj_scales", 1, *rows).to(torch.uint8))
        dn = MXFP4Tensor(
            self._local_slice(src, f"{prefix}.down_proj_blocks", 2, g0, g1, gl).to(torch.uint8),
            self._local_slice(src, f"{prefix}.down_proj_scales", 2, g0, g1, gl).to(torch.uint8))
        if self.mxfp4:
            self.gate_up, self.down = gu, dn
            return
        # dense experts requested: dequantise once at load
        self.gate_up = nn.Parameter(torch.stack([gu.expert(e, self.dtype)
                                                 for e in range(self.num_local)]),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.stack([dn.expert(e, self.dtype)
                                              for e in range(self.num_local)]),
                                 requires_grad=False)

    # keep packed MXFP4 tensors on the module's device
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)
        if self.mxfp4 and isinstance(self.gate_up, MXFP4Tensor):
            device = self.gate_up_bias.device
            self.gate_up, self.down = self.gate_up.to(device), self.down.to(device)
        return self

    def nbytes(self) -> int:
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        packed = sum(w.nbytes() for w in (self.gate_up, self.down) if isinstance(w, MXFP4Tensor))
        return dense + packed

    def _weight(self, w: torch.Tensor | MXFP4Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return w.expert(e, dtype) if isinstance(w, MXFP4Tensor) else w[e].to(dtype)

    # -- compute --------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, weights: torch.Tensor,
               expert_ids: torch.Tensor) -> torch.Tensor:
        """`forward` followed by the MoE all-reduce, for eager decode steps
        (`DecoderLayer.decode`): the same results, with what `forward` works out per call
        (kernel choice, weight views, fp32 biases) worked out once (`DecodeArgs`) and the
        all-reduce skipped where it is the identity (one rank). `weights`/`expert_ids` are
        the router's float32/int64 [T, k] (the kernel checks)."""
        args = self._decode_args()
        choices = expert_ids.numel()
        if moe_tiles.wants(self, x, choices):          # many rows per expert (offline3 hook)
            y = moe_tiles.forward(self, x, weights, expert_ids)
            return y if args.reduce is None else args.reduce(y)
        native = args.native.get(choices)
        if native is None:
            native = args.native[choices] = self.uses_native_kernel(choices)
        if native:
            y = args.op(x if args.x_native else x.float(), weights, expert_ids, *args.args)
            if not args.x_native:
                y = y.to(x.dtype)
        else:
            y = self.forward_torch(x, weights, expert_ids)
        return y if args.reduce is None else args.reduce(y)

    def route_decode(self, x: torch.Tensor, router: Router,
                     route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                     ) -> torch.Tensor:
        """`decode` of the choices `route(x)` makes (`Router.route_native`: the router's
        linear on the dense kernel, then `route_topk`): where both run natively,
        the router and the experts are one native call (`moe_route_experts`, which calls the
        same two ops from C++: bitwise the same result, two Python op dispatches fewer a
        layer); otherwise `route` and `decode`."""
        args = self._decode_args()
        fused = args.fused.get(x.shape[0])
        if fused is None:
            fused = args.fused[x.shape[0]] = self._fuses_router(x, router)
        if not fused:
            return self.decode(x, *route(x))
        y = args.route_op(x, router.weight, router.bias, router.top_k, *args.args)
        return y if args.reduce is None else args.reduce(y)

    def _fuses_router(self, x: torch.Tensor, router: Router) -> bool:
        """Whether `route_decode` of x's batch size takes the one native call: the kernel
        reads x as it is and is chosen for its choices, and the router's linear is the
        dense kernel's (what `linear` picks under the router's plan)."""
        args = self._decode_args()
        return (bool(args.args) and args.x_native and router.bias.dtype == x.dtype
                and self.uses_native_kernel(x.shape[0] * router.top_k)
                and runs_on_dense_kernel(x, router.weight, router.plan))

    def _decode_args(self) -> DecodeArgs:
        """The decode arguments, made again when what they were made from changed."""
        args = self._args
        if args is None or not args.current(self):
            args = self._args = DecodeArgs(self)
        return args

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/expert_ids [T, k] → this rank's partial output [T, H]."""
        if moe_tiles.wants(self, x, expert_ids.numel()):   # offline3 hook (moe_tiles.py)
            return moe_tiles.forward(self, x, weights, expert_ids)
        if self.uses_native_kernel(expert_ids.numel()):
            return self.forward_native(x, weights, expert_ids)
        return self.forward_torch(x, weights, expert_ids)

    def uses_native_kernel(self, choices: int = 1) -> bool:
        """Native unless the plan's moe is "torch", the weights are not on the CPU, or are
        dense and either in a dtype the kernel does not read (fp16) or given enough rows
        (`choices` (token, expert) pairs over all experts) for torch's GEMMs to win
        (`dense_prefers_torch`; 'auto' only), or the extension could not be built ('auto'
        then falls back with the one warning `kernels.status` logs; 'native' is an error)."""
        mode = self.plan.moe
        if mode == "torch" or self.gate_up_bias.device.type != "cpu":
            return False
        if not isinstance(self.gate_up, MXFP4Tensor):
            if self.dtype not in _NATIVE_DENSE_DTYPES:
                return False
            if mode == "auto" and self.dense_prefers_torch(choices):
                return False
        elif mode == "auto" and self.mxfp4_prefers_torch(choices):
            return False
        available = self.plan.native_kernels
        if not available and mode == "native":
            raise RuntimeError(f"{envs.MOE_KERNEL.shown}=native but the native kernels could "
                               f"not be built: {kernels.status().reason}")
        return available

    def dense_prefers_torch(self, choices: int) -> bool:
        """Whether `choices` (token, expert) pairs give torch's GEMMs the edge over the
        kernel on these dense experts (see DENSE_TORCH_MIN_ROWS / _WORK)."""
        rows_per_expert = choices / (self.num_local * self.ctx.ep_size)
        return (rows_per_expert >= DENSE_TORCH_MIN_ROWS
                and rows_per_expert * self.hidden * self.i_local >= DENSE_TORCH_MIN_WORK)

    def mxfp4_prefers_torch(self, choices: int) -> bool:
        """Whether `choices` (token, expert) pairs are enough rows per expert for the
        dequantise-then-GEMM path to beat the kernel on MXFP4 experts (never while
        torch.compile traces: the torch path's per-expert loop breaks the graph)."""
        if torch.compiler.is_compiling():
            return False
        return choices / (self.num_local * self.ctx.ep_size) >= MXFP4_TORCH_MIN_ROWS

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor,
                       expert_ids: torch.Tensor) -> torch.Tensor:
        """The whole expert computation as one kernel call, in fp32 whatever the dtype
        (the kernel widens fp32/bf16 activations itself and rounds its result to theirs)."""
        xk = x.contiguous() if x.dtype in _KERNEL_X_DTYPES else x.float().contiguous()
        y = kernels.moe_experts(
            xk, weights.float().contiguous(), expert_ids.long().contiguous(),
            self.first_expert, self._kernel_weight(self.gate_up), self._f32("gate_up_bias"),
            self._kernel_weight(self.down),
            self._f32("down_bias") if self.add_down_bias else None,
            self.alpha, self.limit)                                           # [T, H]
        return y.to(x.dtype)

    @staticmethod
    def _kernel_weight(w: torch.Tensor | MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(w, MXFP4Tensor):
            return w.blocks.contiguous(), w.scales.contiguous()
        return w.detach().contiguous(), None

    def _f32(self, name: str) -> torch.Tensor:
        bias = getattr(self, name).detach()
        if bias.dtype == torch.float32:
            return bias
        if torch.compiler.is_compiling():      # traced: computed in the graph (or frozen)
            return bias.float()
        key = (bias.data_ptr(), bias._version)
        cached = self._bias_f32.get(name)
        if cached is None or cached[0] != key:
            cached = (key, bias.float().contiguous())
            self._bias_f32[name] = cached
        return cached[1]

    def forward_torch(self, x: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        """The reference path: one matmul per active expert.

        The T·k (token, expert) choices are sorted by expert; this rank's experts form
        one contiguous run of the sorted order (others sort before or after it):

            sorted choices:  | other experts | e0 e0 e0 | e1 | e3 e3 | other experts |
                                             ^start

        Each active expert runs one matmul over its slice; results land in their
        choice's row with a plain (non-accumulating) scatter and the k rows of a
        token are summed — no atomic index_add. Where half-precision matmuls run in
        fp32 on this CPU (see `layers.linear`), the whole expert computation does.
        """
        out_dtype = x.dtype
        work_dtype = torch.float32 if upcasts(self.gate_up_bias, self.plan) else x.dtype
        x = x.to(work_dtype)
        T, k = expert_ids.shape
        local = expert_ids.flatten() - self.first_expert                    # [T*k]
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local.clamp(min=-1, max=self.num_local) + 1,
                                minlength=self.num_local + 2)               # [-1 | local | above]
        start = int(counts[0])
        sizes: list[int] = counts[1:self.num_local + 1].tolist()            # choices per expert
        chosen = order[start:start + sum(sizes)]                            # [n] local choices
        x_sorted = x[chosen // k]                                           # [n, H]
        y_sorted = torch.empty_like(x_sorted)
        offset = 0
        least = self.plan.upcast_min_rows if work_dtype != self.dtype else 0   # fewer: half
        for e, n in enumerate(sizes):
            if n:
                dt = work_dtype if n >= least else self.dtype             # see layers.linear
                y_sorted[offset:offset + n] = self._expert(e, x_sorted[offset:offset + n].to(dt))
                offset += n
        y_sorted *= weights.flatten()[chosen, None].to(y_sorted.dtype)
        per_choice = x.new_zeros(T * k, x.shape[1])                         # [T*k, H]
        per_choice[chosen] = y_sorted
        return per_choice.view(T, k, -1).sum(dim=1).to(out_dtype)           # [T, H]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = F.linear(x, self._weight(self.gate_up, e, dt), self.gate_up_bias[e].to(dt))  # [n, 2I]
        gate, up = h[:, 0::2], h[:, 1::2]                                     # [n, I]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        bias = self.down_bias[e].to(dt) if self.add_down_bias else None
        return F.linear(act, self._weight(self.down, e, dt), bias)          # [n, H]


class DecodeArgs:
    """What `Experts.decode` passes the kernel besides the activations, worked out once:
    the op, the weight views and fp32 biases in the op's argument order, the all-reduce
    (None when it is the identity), and the kernel choice per choice count. Made from the
    experts' plan, weights, biases and parallel context: `current` says whether those are
    still the ones it was made from (a reload replaces the weights or copies into the
    biases in place; a new plan arrives when the kernels become available)."""

    def __init__(self, ex: Experts) -> None:
        self.made_from = (ex.plan, ex.gate_up, ex.down, ex.ctx, ex.dtype)
        self.native: dict[int, bool] = {}
        self.fused: dict[int, bool] = {}       # route_decode's choice per batch size
        self.x_native = ex.dtype in _KERNEL_X_DTYPES     # activations in the model dtype
        self.sources = (ex.gate_up_bias.detach(), ex.down_bias.detach())   # share versions
        self.versions = tuple(b._version for b in self.sources)
        comm = ex.ctx.comm
        trivial = type(comm).all_reduce is Collectives.all_reduce
        self.reduce = None if trivial else comm.all_reduce
        self.op: Any = None                    # the ops, where the kernels are built
        self.route_op: Any = None
        self.args: tuple = ()
        if ex.plan.native_kernels:
            self.op = torch.ops.kvrelay_kernels.moe_experts.default
            self.route_op = torch.ops.kvrelay_kernels.moe_route_experts.default
            gate_up, down = ex._kernel_weight(ex.gate_up), ex._kernel_weight(ex.down)
            self.args = (ex.first_expert, gate_up[0], gate_up[1], ex._f32("gate_up_bias"),
                         down[0], down[1], ex._f32("down_bias") if ex.add_down_bias else None,
                         ex.alpha, ex.limit, "")

    def current(self, ex: Experts) -> bool:
        a, b = self.sources
        return ((a._version, b._version) == self.versions
                and all(x is y for x, y in zip(self.made_from,
                                               (ex.plan, ex.gate_up, ex.down, ex.ctx, ex.dtype))))


class MoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 ctx: ParallelContext, dtype: torch.dtype, alpha: float, limit: float,
                 mxfp4: bool, plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        plan = plan or execution_plan.current()
        self.router = Router(hidden, num_experts, top_k, dtype, plan)
        self.experts = Experts(hidden, intermediate, num_experts, ctx, dtype, alpha, limit, mxfp4,
                               plan)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.router.weight.copy_(src.get(f"{prefix}.router.weight"))
        self.router.bias.copy_(src.get(f"{prefix}.router.bias"))
        self.experts.load(src, f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.expert_group is not None:      # experts span every DP replica's ranks
            return moe_across_replicas(self.router, self.experts, x, self.ctx)
        weights, expert_ids = self.router(x)
        return self.ctx.comm.all_reduce(self.experts(x, weights, expert_ids))
