"""gpt-oss mixture of experts: top-k router and grouped expert matmuls.

Router: logits = x Wᵀ + b; the top-k logits are soft-maxed among themselves.
Experts: h = x W_guᵀ + b_gu with gate/up interleaved (even rows gate, odd rows up);
gate ≤ limit, -limit ≤ up ≤ limit; act = (up + 1) · gate · σ(alpha · gate);
y = act W_dᵀ + b_d, weighted by the routing weight.

Three implementations of the expert computation; `ExpertPaths.choose` picks one per call
from the execution plan's `moe` (KVRELAY_MOE_KERNEL: auto | native | torch), the weights
and the rows per expert, and nothing else does:
- kernel (`kvrelay.model.kernels`): one C++ call per layer covering every local expert —
  choices counting-sorted by expert, gate_up + swiglu and down + routing weight as two
  parallel sweeps over (expert, row tile), MXFP4 dequantised in registers, fp32
  accumulation throughout;
- tiles (`moe_tiles.py`): the same computation as AVX512-BF16 tiles, for bf16 models at
  many rows per expert;
- torch (the reference the others are tested against): tokens grouped by expert (argsort
  of the flattened (token, k) choices + bincount) and one matmul per *active* expert.
Decode-only steps the model hands a `FusedDecode` add one variant of the kernel: the router
and the experts as one native call (`Experts.route_forward`), bitwise the router then the
kernel.

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
from typing import Any, Literal, Self

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay import envs
from kvrelay.model import execution_plan, kernels
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers import moe_tiles
from kvrelay.model.layers.attention import FusedDecode
from kvrelay.model.layers.ep_dispatch import moe_across_replicas
from kvrelay.model.layers.linear import linear, runs_on_dense_kernel, upcasts
from kvrelay.model.layers.moe_mode import moe_kernel_mode as moe_kernel_mode  # re-exported
from kvrelay.model.mxfp4 import BLOCK, MXFP4Tensor
from kvrelay.model.parallel import Collectives, ParallelContext, divide, shard_range
from kvrelay.model.weights import WeightSource, padded_slice

ExpertPath = Literal["kernel", "tiles", "torch"]

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
# Token rows per expert from which the tiles (moe_tiles.py) take over. An expert's rows are
# padded to 16 (one vector of token rows), so below that the tiles cost as much as 16 rows.
# Measured (one thread, CPU time per layer call, AVX512-BF16 Zen 4 VM under load; tiles /
# the path taken before): tiny config (hidden = intermediate = 128, 8 experts, top-2) at
# 6 / 8 / 10 / 12 / 16 / 256 / 1024 rows per expert, bf16 107/89, 105/112, 117/136, 121/165,
# 142/272, 1572/3373, 8658/17365 us, MXFP4 114/97, 114/118, 127/150, 137/200, 147/226,
# 1565/3847, 6867/15359 us; the embedded model's shape (576/1536, 2 experts, top-1) at
# 4 / 8 / 16 rows 1243/390, 1015/986, 1377/1551 us.
TILE_MIN_ROWS = 10


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


# What `kernels.moe_experts` takes besides x, the routing weights and the expert ids (see
# `Experts.kernel_args`); the raw ops take the same values flattened (`ExpertPaths.op_args`).
KernelArgs = tuple[int, tuple[torch.Tensor, torch.Tensor | None], torch.Tensor,
                   tuple[torch.Tensor, torch.Tensor | None], torch.Tensor | None, float, float]


class Experts(nn.Module):
    """This rank's share of the experts, in the model dtype or packed MXFP4. Owner of its
    `ExpertPaths` (which implementation computes a call, and the kernels' arguments), made
    from what the layer holds on first use. Whoever sets one of those facts anew — the
    plan, ctx, dtype, the weights or biases — calls `invalidate` (`load`, `use_plan` and
    `_apply` do); a bias copied into in place is caught by its version counter."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, ctx: ParallelContext,
                 dtype: torch.dtype, alpha: float, limit: float, mxfp4: bool,
                 plan: ExecutionPlan | None = None) -> None:
        super().__init__()
        self._paths: ExpertPaths | None = None      # `paths`, made on first use
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
        if not mxfp4:
            self.gate_up = nn.Parameter(torch.zeros(E, 2 * I, hidden, dtype=dtype),
                                        requires_grad=False)
            self.down = nn.Parameter(torch.zeros(E, hidden, I, dtype=dtype), requires_grad=False)

    def invalidate(self) -> None:
        """Drop the paths: they are made again from what the layer holds on next use."""
        self._paths = None

    def use_plan(self, plan: ExecutionPlan) -> None:
        """Follow `plan` from the next call on."""
        self.plan = plan
        self.invalidate()

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
        self.invalidate()                   # new weights, perhaps new tensors

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
        self.invalidate()           # the parameters' data moved or changed dtype in place
        return self

    def nbytes(self) -> int:
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        packed = sum(w.nbytes() for w in (self.gate_up, self.down) if isinstance(w, MXFP4Tensor))
        return dense + packed

    def _weight(self, w: torch.Tensor | MXFP4Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return w.expert(e, dtype) if isinstance(w, MXFP4Tensor) else w[e].to(dtype)

    # -- compute --------------------------------------------------------------------------
    def paths(self) -> ExpertPaths:
        """This layer's `ExpertPaths`, made again where a bias was copied into in place since
        (a reload: no setter sees it, the biases' versions do)."""
        paths = self._paths
        if paths is None or not paths.current():
            paths = self._paths = ExpertPaths(self)
        return paths

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/expert_ids [T, k] → this rank's partial output [T, H], on the
        path `ExpertPaths.choose` picks."""
        if torch.compiler.is_compiling():
            return self._traced(x, weights, expert_ids)
        return self.paths().run(self, x, weights, expert_ids)

    def route_forward(self, x: torch.Tensor, router: Router,
                      fused: FusedDecode | None = None) -> torch.Tensor:
        """The MoE block of one step: `router`'s choices for x [T, H], this rank's experts
        on them, the partial outputs all-reduced → [T, H]. `fused` (a decode-only step,
        `GptOssModel.fused_step`): where `ExpertPaths.fuses_router` says so, the router and
        the experts are one native call (`moe_route_experts`, which calls the router's
        linear on the dense kernel, `route_topk` and the expert kernel from C++: bitwise
        those ops, two Python op dispatches fewer a layer), otherwise `Router.route_native`
        then `forward`'s path; the all-reduce skipped where it is the identity (one rank).
        Without it the general ops: `router`, `forward` and the all-reduce, or the tokens
        of every replica where the experts span them."""
        if fused is not None:
            paths = self.paths()
            if paths.fuses_router(self, x, router):
                y = paths.route_op(x, router.weight, router.bias, router.top_k, *paths.op_args)
            else:
                y = paths.run(self, x, *router.route_native(x))
            return y if paths.reduce is None else paths.reduce(y)
        if self.ctx.expert_group is not None:      # experts span every DP replica's ranks
            return moe_across_replicas(router, self, x, self.ctx)
        weights, expert_ids = router(x)
        return self.ctx.comm.all_reduce(self(x, weights, expert_ids))

    def fuses_router(self, x: torch.Tensor, router: Router) -> bool:
        """Whether `route_forward` of a fused step of a batch like x takes the one native
        call."""
        return self.paths().fuses_router(self, x, router)

    def uses_native_kernel(self, choices: int = 1) -> bool:
        """Whether `choices` (token, expert) pairs go to the kernel rather than torch's GEMMs
        (`ExpertPaths.kernel_takes`; the tiles, where they run, take many rows first)."""
        return ExpertPaths.kernel_takes(self, choices, torch.compiler.is_compiling())

    def _traced(self, x: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
        """`forward` while torch.compile traces: `ExpertPaths.choose` as traced code sees it
        (never the tiles; MXFP4 never torch's GEMMs), the kernel's arguments computed in the
        graph. Nothing cached is read, so the graph's guards hold as the caches change."""
        if ExpertPaths.choose(self, x, expert_ids.numel(), compiling=True) == "kernel":
            return ExpertPaths.kernel(x, weights, expert_ids, self.kernel_args())
        return self.forward_torch(x, weights, expert_ids)

    def kernel_args(self) -> KernelArgs:
        """What `kernels.moe_experts` takes besides the activations and choices: the first
        local expert, the weights (and MXFP4 scales), the biases in float32 (the down bias
        only on the first intermediate shard), alpha and limit."""
        return (self.first_expert, self._kernel_weight(self.gate_up), self._f32("gate_up_bias"),
                self._kernel_weight(self.down),
                self._f32("down_bias") if self.add_down_bias else None, self.alpha, self.limit)

    @staticmethod
    def _kernel_weight(w: torch.Tensor | MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(w, MXFP4Tensor):
            return w.blocks.contiguous(), w.scales.contiguous()
        return w.detach().contiguous(), None

    def _f32(self, name: str) -> torch.Tensor:
        """A bias as the kernels read it: float32 (a copy of a half-precision one)."""
        bias = getattr(self, name).detach()
        return bias if bias.dtype == torch.float32 else bias.float().contiguous()

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


class ExpertPaths:
    """Which implementation computes a call of one `Experts`, decided here and nowhere
    else, and what the kernels take besides the activations, worked out once. Made by
    `Experts.paths` from the layer's plan, weights, biases, parallel context and dtype;
    made again when one of them changes (`Experts.invalidate`: set anew, the module moved;
    `current`: a bias copied into).

    The rule (`choose`), by the rows each expert gets on average,
    rows = choices / (local experts × ep_size), choices = T·k (token, expert) pairs:

        tiles   (`tiles_take`) bf16 activations on the CPU, bf16 or MXFP4 weights, the
                plan's `moe_tiles`, even hidden and intermediate sizes, rows ≥ TILE_MIN_ROWS;
                not bf16 weights from the plan's `upcast_min_rows` rows where it computes
                half matmuls in fp32 (torch's fp32 GEMMs pay there); never while traced
        kernel  (`kernel_takes`) the plan's moe is not "torch", the weights on the CPU and
                MXFP4 or fp32/bf16, the kernels built; under "auto" not from the rows where
                torch's GEMMs win: dense rows ≥ DENSE_TORCH_MIN_ROWS with rows · hidden ·
                intermediate ≥ DENSE_TORCH_MIN_WORK, MXFP4 rows ≥ MXFP4_TORCH_MIN_ROWS (not
                while traced: the per-expert loop breaks the graph)
        torch   the rest (`Experts.forward_torch`, the reference)

    `run` computes a call on its path, the choice kept per choice count (activations in the
    layer's dtype; eager code only). `fuses_router` says per batch size whether a fused
    step's `route_forward` runs the router and the kernel as one call: where the kernel rule
    takes the batch's choices (the fused op is the streaming kernel's, so it reads that rule
    only, also at rows the tiles take on their own), the kernel reads x as it is and the
    router's linear runs on the dense kernel. The experts pass themselves to the methods that read
    them: the paths hold no reference back (no cycle keeps a dropped model alive)."""

    def __init__(self, ex: Experts) -> None:
        self.dtype = ex.dtype
        self.x_native = ex.dtype in _KERNEL_X_DTYPES     # activations in the model dtype
        self.chosen: dict[int, ExpertPath] = {}          # per choice count, x in self.dtype
        self.fused: dict[int, bool] = {}                 # `fuses_router` per batch size
        self._biases = (ex.gate_up_bias.detach(), ex.down_bias.detach())   # share versions
        self._versions = tuple(b._version for b in self._biases)
        comm = ex.ctx.comm
        trivial = type(comm).all_reduce is Collectives.all_reduce
        self.reduce = None if trivial else comm.all_reduce
        self.route_op: Any = None                        # the ops, where the kernels are built
        self.args: tuple[Any, ...] = ()                  # `kernels.moe_experts`'s (KernelArgs)
        self.op_args: tuple[Any, ...] = ()               # the same, in the raw ops' order
        if ex.plan.native_kernels:
            self.route_op = torch.ops.kvrelay_kernels.moe_route_experts.default
            args = self.args = ex.kernel_args()
            first, gate_up, gate_up_bias, down, down_bias, alpha, limit = args
            self.op_args = (first, *gate_up, gate_up_bias, *down, down_bias, alpha, limit, "")

    def current(self) -> bool:
        """Whether the biases still hold what the fp32 copies were made from."""
        gate_up_bias, down_bias = self._biases
        return (gate_up_bias._version == self._versions[0]
                and down_bias._version == self._versions[1])

    # -- the rule ---------------------------------------------------------------------------
    @staticmethod
    def choose(ex: Experts, x: torch.Tensor, choices: int, compiling: bool) -> ExpertPath:
        """The path of `ex`'s call of `choices` pairs on activations like x."""
        if ExpertPaths.tiles_take(ex, x, choices, compiling):
            return "tiles"
        return "kernel" if ExpertPaths.kernel_takes(ex, choices, compiling) else "torch"

    @staticmethod
    def tiles_take(ex: Experts, x: torch.Tensor, choices: int, compiling: bool) -> bool:
        """The tiles rule (the class docstring)."""
        if compiling or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return False
        rows = choices / (ex.num_local * ex.ctx.ep_size)
        if rows < TILE_MIN_ROWS:
            return False
        w, plan = ex.gate_up, ex.plan
        if isinstance(w, torch.Tensor):          # dense weights
            if w.dtype != torch.bfloat16:
                return False
            if plan.half_in_fp32 and rows >= plan.upcast_min_rows:
                return False                     # torch's fp32 GEMMs pay from here
        return plan.moe_tiles and ex.hidden % 2 == 0 and ex.i_local % 2 == 0

    @staticmethod
    def kernel_takes(ex: Experts, choices: int, compiling: bool) -> bool:
        """The kernel rule (the class docstring). KVRELAY_MOE_KERNEL=native without the
        kernels is an error; "auto" falls back with the one warning `kernels.status` logs."""
        plan = ex.plan
        if plan.moe == "torch" or ex.gate_up_bias.device.type != "cpu":
            return False
        rows = choices / (ex.num_local * ex.ctx.ep_size)
        auto = plan.moe == "auto"
        if not isinstance(ex.gate_up, MXFP4Tensor):
            if ex.dtype not in _NATIVE_DENSE_DTYPES:
                return False
            if (auto and rows >= DENSE_TORCH_MIN_ROWS
                    and rows * ex.hidden * ex.i_local >= DENSE_TORCH_MIN_WORK):
                return False
        elif auto and not compiling and rows >= MXFP4_TORCH_MIN_ROWS:
            return False
        if not plan.native_kernels and plan.moe == "native":
            raise RuntimeError(f"{envs.MOE_KERNEL.shown}=native but the native kernels could "
                               f"not be built: {kernels.status().reason}")
        return plan.native_kernels

    # -- the paths --------------------------------------------------------------------------
    def run(self, ex: Experts, x: torch.Tensor, weights: torch.Tensor,
            expert_ids: torch.Tensor) -> torch.Tensor:
        """`ex`'s partial output [T, H] for x [T, H], weights/expert_ids [T, k]."""
        choices = expert_ids.numel()
        path = self.chosen.get(choices) if x.dtype is self.dtype else None
        if path is None:
            path = self.choose(ex, x, choices, compiling=False)
            if x.dtype is self.dtype:
                self.chosen[choices] = path
        if path == "kernel":
            return self.kernel(x, weights, expert_ids, self.args)
        if path == "tiles":
            return moe_tiles.forward(x, weights, expert_ids, self.op_args)
        return ex.forward_torch(x, weights, expert_ids)

    @staticmethod
    def kernel(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
               args: tuple[Any, ...]) -> torch.Tensor:
        """The whole expert computation as one `kernels.moe_experts` call, in fp32 whatever
        the dtype: fp32/bf16 activations as given (the kernel widens them and rounds its
        result to theirs), others widened here and the result rounded back."""
        native = x.dtype in _KERNEL_X_DTYPES
        if weights.dtype != torch.float32:         # `Router.forward`'s, in the model dtype
            weights = weights.float()
        if expert_ids.dtype != torch.int64:
            expert_ids = expert_ids.long()
        y = kernels.moe_experts((x if native else x.float()).contiguous(), weights.contiguous(),
                                expert_ids.contiguous(), *args)               # [T, H]
        return y if native else y.to(x.dtype)

    def fuses_router(self, ex: Experts, x: torch.Tensor, router: Router) -> bool:
        """Whether `ex.route_forward` of a fused step of a batch like x takes the one
        native call (the router is the layer's: its plan changes with the experts')."""
        fused = self.fused.get(x.shape[0])
        if fused is None:
            fused = self.fused[x.shape[0]] = (
                bool(self.op_args) and self.x_native and router.bias.dtype == x.dtype
                and self.kernel_takes(ex, x.shape[0] * router.top_k, compiling=False)
                and runs_on_dense_kernel(x, router.weight, router.plan))
        return fused


class MoE(nn.Module):
    """The router and this rank's experts of one layer; their step is
    `Experts.route_forward` (which `DecoderLayer.forward` calls with the step's choice)."""

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
        """x [T, H] → the MoE output [T, H], on the general ops."""
        return self.experts.route_forward(x, self.router)
