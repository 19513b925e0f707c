"""Tensor-parallel linear layers (Megatron style).

    RowParallelLinear     y   = Σ_r x_r W_rᵀ  + b   input features sharded; all-reduce,
                                                  bias added by the first rank only
    QKVParallelLinear     one fused column-parallel matmul for q, k and v of this
                          rank's heads (KV heads replicated when tp_size > kv heads)

Every matmul of the model goes through `linear`, under an `ExecutionPlan`
(model/execution_plan.py) that the layers get at construction. Half-precision (bf16/fp16)
weights are multiplied natively where the plan's `matmul` is "native"; where it is "fp32"
the weights are upcast per matmul and the product computed in fp32: weights stay half in
memory, results are rounded back to the activation dtype, and matmuls of fewer rows than
the plan's `upcast_min_rows` keep the half kernel. The plan's rule is a function of the
running CPU's features and KVRELAY_CPU_HALF_MATMUL only (execution_plan.matmul_rule), so a
prefill and a decode on alike machines compute alike whatever their load at start-up;
`measure_half_matmul` times both precisions (~60 ms) for a person or a benchmark choosing
the setting, and decides nothing.

Decode-sized matmuls (a few rows: one per sequence) go to the native skinny-matmul kernel
(`kvrelay_kernels::dense_linear`, AVX512-BF16 / AVX-512 / AVX2 chosen at run time) where
it beats torch on this CPU's ISA for that many rows (`DENSE_MAX_ROWS`): torch's bf16 matmul
of one row pays a fixed ~40-60 µs in oneDNN, several times the time to stream the weights
of a 576-wide layer. The plan's `dense` None (`KVRELAY_DENSE_KERNEL=torch`) keeps every
matmul on torch (the reference the kernel is tested against); traced code (torch.compile)
always uses F.linear.

Where a product is torch's fp32 GEMM (`fp32_product`) of a shallow weight, the projections
(and the LM head, layers/embedding.py) take it from the ordered kernel once it was seen to
give the same bits (layers/ordered.py): no upcast per call, one native call. The decode stack
(gpt_oss.py `DecodeStack`) computes every product of a step in the form the Python path
would (`stack_form`): the dense kernel, the ordered kernel where checked, or torch's fp32
GEMM, so a step of more rows than the dense kernel takes still runs as one native call.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import UPCAST_MIN_ROWS, ExecutionPlan
from kvrelay.model.layers.ordered import Operands, OrderedProduct
from kvrelay.model.parallel import ParallelContext, divide
from kvrelay.model.weights import WeightSource

__all__ = ["UPCAST_MIN_ROWS"]

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class HalfMatmulChoice:
    """How bf16/fp16 matmuls run in this process, and why (for logs and metrics)."""

    native: bool            # torch's half-precision GEMM (oneDNN) rather than fp32 compute
    cpu_features: tuple[str, ...]   # the native-bf16 features the running CPU reports
    reason: str
    upcast_min_rows: int       # fp32 compute: the fewest rows a matmul is upcast from


def cpu_bf16_features() -> tuple[str, ...]:
    """Native bf16 arithmetic on the running CPU, as torch's cpuinfo sees it."""
    return execution_plan.CpuFeatures.detect().bf16_names()


def half_matmul_choice(plan: ExecutionPlan | None = None) -> HalfMatmulChoice:
    """The plan's half-precision matmul choice (this process's plan by default)."""
    plan = plan or execution_plan.current()
    return HalfMatmulChoice(plan.matmul == "native", plan.cpu.bf16_names(), plan.matmul_reason,
                            plan.upcast_min_rows)


def cpu_half_matmul_in_fp32() -> bool:
    """Whether bf16/fp16 matmuls run as fp32 under this process's plan."""
    return execution_plan.current().half_in_fp32


# The measurement: a [PROBE_ROWS, F] x [F, F] product in bf16 (oneDNN) and in fp32 on weights
# upcast beforehand, and the upcast of the weight alone (which `linear` pays every call),
# best of PROBE_REPEATS alternated calls each, on one thread: ~60 ms.
PROBE_ROWS, PROBE_FEATURES, PROBE_REPEATS = 256, 1024, 5


def measure_half_matmul() -> tuple[float, float, float]:
    """Seconds of the probe GEMM in bf16, in fp32, and of the weight's upcast: a suggestion
    for KVRELAY_CPU_HALF_MATMUL on this machine, never read by the plan (its numerics must
    not depend on the load at start-up)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, PROBE_FEATURES, generator=g).bfloat16()
    w = torch.randn(PROBE_FEATURES, PROBE_FEATURES, generator=g).bfloat16()
    x32, w32 = x.float(), w.float()
    best = [float("inf")] * 3
    calls = (lambda: F.linear(x, w), lambda: F.linear(x32, w32).bfloat16(), lambda: w.float())
    # one thread: the precisions' relative speed is a core's, and a thread team on a busy
    # machine measures its barriers instead (two threads beside a loaded neighbour timed
    # bf16 at 67 and fp32 at 27 GFLOP/s; alone, 145 and 192)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for f in calls:                                  # oneDNN primitives, first touch
                f()
            for _ in range(PROBE_REPEATS):
                for i, f in enumerate(calls):
                    t0 = time.perf_counter()
                    f()
                    best[i] = min(best[i], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best[0], best[1], best[2]


def upcast_min_rows(plan: ExecutionPlan | None = None) -> int:
    """Where half matmuls run in fp32: the fewest rows a matmul is upcast from."""
    return (plan or execution_plan.current()).upcast_min_rows


def upcasts(weight: torch.Tensor, plan: ExecutionPlan | None = None) -> bool:
    """Whether matmuls with this weight compute in fp32 (from `upcast_min_rows` rows)."""
    return (weight.dtype in _HALF and weight.device.type == "cpu"
            and (plan or execution_plan.current()).half_in_fp32)


# Most rows (per weight dtype) for which the native dense kernel takes a matmul, per dense
# ISA variant: where it was faster than F.linear on every layer shape of the embedded
# model (576-wide: qkv, o_proj, router, expert shapes; docs/benchmarks.md "Native skinny
# matmuls"), one thread, on an AVX-512 Zen 4 against oneDNN's native bf16 GEMM. The AVX2
# bf16 limit is the row count where `linear` starts upcasting (UPCAST_MIN_ROWS): on
# CPUs without native bf16 torch's half kernel is emulated, so the kernel is compared
# with a faster torch here than it meets there. The generic (scalar) build is never
# faster than torch: it stays a tested fallback, not a dispatch target.
DENSE_MAX_ROWS: dict[str, dict[torch.dtype, int]] = {
    "avx512_bf16": {torch.bfloat16: 16, torch.float32: 16},
    "avx512": {torch.bfloat16: 4, torch.float32: 16},
    "avx2": {torch.bfloat16: 4, torch.float32: 8},
}
# From this many input features on, at most WIDE_MAX_ROWS rows take the kernel: past ~8
# rows of 2,048+ features the inputs of one pass no longer sit in L1 beside the weights it
# reuses, and oneDNN's blocked GEMM is as fast or faster (gpt-oss-20b's qkv and o_proj,
# K = 2,880 / 4,096, AVX512-BF16, per CPU second: 0.97-1.05x torch at 8 rows, 0.76-0.94x at 12-16;
# benchmarks/dense_kernels.py, docs/benchmarks.md "Dense kernels at weight bandwidth").
WIDE_K = 2048
WIDE_MAX_ROWS = 8
# A call of at most this many multiply-adds (rows x weight elements) takes the kernel at any
# row count, per dense ISA variant: F.linear pays a fixed ~16 µs a call in oneDNN, more than
# the kernel needs for the whole of such a call (AVX512-BF16, bf16 and fp32, 1 and 2 threads:
# 2^21 MACs is where they tie; `benchmarks/dense_kernels.py --shapes tiny --rows 17,32,64,128`,
# docs/benchmarks.md "Session 10"). What it buys is the step rather than the call: a small
# model's decode steps of 17-64 sequences then run in one native call (`DecodeStack`)
# instead of layer by layer from Python. Not measured, so 0, for the other variants.
DENSE_SMALL_CALL_MACS: dict[str, int] = {"avx512_bf16": 1 << 21}


def dense_kernel_isa() -> str | None:
    """This process's plan's dense kernel ISA (None: every matmul and norm on torch)."""
    return execution_plan.current().dense


@functools.cache
def _dense_op() -> torch._ops.OpOverload:
    """The op overload itself: the packet's overload resolution costs a few µs a call."""
    return torch.ops.kvrelay_kernels.dense_linear.default


def runs_on_dense_kernel(x: torch.Tensor, weight: torch.Tensor,
                         plan: ExecutionPlan | None = None) -> bool:
    """Whether `linear(x, weight, plan=plan)` runs on the native dense kernel."""
    if torch.compiler.is_compiling() or x.dim() != 2:     # traced code keeps F.linear
        return False
    isa = (plan or execution_plan.current()).dense
    limit = DENSE_MAX_ROWS[isa].get(weight.dtype, 0) if isa else 0
    if not limit or x.dtype != weight.dtype or x.device.type != "cpu":
        return False
    rows = x.shape[0]
    if x.shape[1] >= WIDE_K:
        limit = min(limit, WIDE_MAX_ROWS)
    return rows > 0 and (rows <= limit
                         or rows * weight.numel() <= DENSE_SMALL_CALL_MACS.get(isa or "", 0))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           plan: ExecutionPlan | None = None) -> torch.Tensor:
    """`F.linear` under `plan` (this process's by default): on the native dense kernel for
    decode-sized inputs (see DENSE_MAX_ROWS); in fp32 for half-precision weights where the
    plan computes them so (from `upcast_min_rows` rows, see the module docstring)."""
    plan = plan or execution_plan.current()
    if runs_on_dense_kernel(x, weight, plan):
        return _dense_op()(x, weight, bias, "")
    if not upcasts(weight, plan) or x.numel() < plan.upcast_min_rows * x.shape[-1]:
        return F.linear(x, weight, bias)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def fp32_product(x: torch.Tensor, weight: torch.Tensor, plan: ExecutionPlan) -> bool:
    """Whether `linear(x, weight, bias, plan)` is `F.linear(x.float(), weight.float(),
    bias.float())` rounded to x's dtype (bf16 or float32): torch's fp32 GEMM, not a native
    kernel or a half-precision one."""
    if (x.dim() != 2 or x.device.type != "cpu" or weight.device.type != "cpu"
            or torch.compiler.is_compiling()):
        return False
    if runs_on_dense_kernel(x, weight, plan):
        return False
    if x.dtype == weight.dtype == torch.float32:
        return True
    return (x.dtype == weight.dtype == torch.bfloat16 and upcasts(weight, plan)
            and x.numel() >= plan.upcast_min_rows * x.shape[-1])


# Most rows a projection asks the ordered kernel for: decode-sized steps (a prefill's rows
# keep torch's GEMM, which is as fast there).
ORDERED_MAX_ROWS = 64


def _ordered(module: QKVParallelLinear | RowParallelLinear,
             bias: torch.Tensor | None) -> OrderedProduct:
    """The module's ordered product of its weight and `bias` (made on first use)."""
    ordered = module.ordered
    if ordered is None or ordered.bias is not bias:
        ordered = module.ordered = OrderedProduct(module.weight, bias, ORDERED_MAX_ROWS)
    return ordered


def _ordered_linear(module: QKVParallelLinear | RowParallelLinear, x: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x, module.weight, bias, module.plan)`, bit for bit; on the ordered kernel
    where it was checked to give torch's fp32 GEMM's bits (layers/ordered.py)."""
    weight, plan = module.weight, module.plan
    if fp32_product(x, weight, plan):
        y = _ordered(module, bias).linear(x, plan)
        if y is not None:
            return y                                  # in x's dtype, rounded once: exact
    return linear(x, weight, bias, plan)


# How the native decode stack (csrc/decode_stack_op.cpp `DecodeStack.set_forms`) computes a
# product of a batch, each the very computation the Python path makes for it:
STACK_DENSE = 0     # the dense kernel (`runs_on_dense_kernel`)
STACK_ORDERED = 1   # the ordered kernel, checked equal to torch's fp32 GEMM for the batch
STACK_FP32 = 2      # torch's fp32 GEMM on upcast operands (`fp32_product`)


def stack_form(x: torch.Tensor, weight: torch.Tensor, plan: ExecutionPlan,
               ordered: OrderedProduct | None = None) -> int | None:
    """How the decode stack computes `linear(x, weight, bias, plan)` — or, given the module's
    `ordered` product, `_ordered_linear` — for a batch like x, bit for bit: STACK_*, or None
    where neither native form is what the Python path computes (torch's half-precision GEMM,
    traced code). The ordered product's verdict for the batch is decided here where it has
    none yet (`OrderedProduct.checked`)."""
    if runs_on_dense_kernel(x, weight, plan):
        return STACK_DENSE
    if not fp32_product(x, weight, plan):
        return None
    if ordered is not None and ordered.checked(x.shape[0], plan):
        return STACK_ORDERED
    return STACK_FP32


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext,
                 dtype: torch.dtype, bias: bool = True, plan: ExecutionPlan | None = None
                 ) -> None:
        super().__init__()
        self.ctx = ctx
        self.plan = plan or execution_plan.current()
        self.in_local = divide(in_features, ctx.tp_size, "input features")
        self.weight = _param(out_features, self.in_local, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.ordered: OrderedProduct | None = None

    def load(self, src: WeightSource, prefix: str) -> None:
        start = self.ctx.tp_rank * self.in_local
        self.weight.copy_(src.get(f"{prefix}.weight", 1, start, start + self.in_local))
        if self.bias is not None:
            self.bias.copy_(src.get(f"{prefix}.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.comm.all_reduce(_ordered_linear(self, x, self._rank_bias()))

    def _rank_bias(self) -> torch.Tensor | None:
        return self.bias if self.ctx.tp_rank == 0 else None

    def stack_form(self, x: torch.Tensor) -> int | None:
        """`stack_form` of this rank's product (before the all-reduce) of a batch like x."""
        return stack_form(x, self.weight, self.plan, _ordered(self, self._rank_bias()))

    def ordered_operands(self) -> Operands | None:
        """The ordered kernel's operands for this rank's product (`OrderedProduct.operands`):
        what the decode stack registers for STACK_ORDERED."""
        return _ordered(self, self._rank_bias()).operands(self.plan)


class QKVParallelLinear(nn.Module):
    """q, k, v projections of this rank's heads, fused into one matmul."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 ctx: ParallelContext, dtype: torch.dtype, plan: ExecutionPlan | None = None
                 ) -> None:
        super().__init__()
        self.ctx, self.head_dim = ctx, head_dim
        self.plan = plan or execution_plan.current()
        self.num_heads = divide(num_heads, ctx.tp_size, "num_attention_heads")
        if ctx.tp_size >= num_kv_heads:
            divide(ctx.tp_size, num_kv_heads, "tensor_parallel_size (KV heads replicated)")
            self.num_kv_heads = 1
            self.kv_head_start = ctx.tp_rank * num_kv_heads // ctx.tp_size
        else:
            self.num_kv_heads = divide(num_kv_heads, ctx.tp_size, "num_key_value_heads")
            self.kv_head_start = ctx.tp_rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _param(out, hidden, dtype=dtype)
        self.bias = _param(out, dtype=dtype)
        self.ordered: OrderedProduct | None = None

    def load(self, src: WeightSource, prefix: str) -> None:
        q0 = self.ctx.tp_rank * self.q_size
        kv0 = self.kv_head_start * self.head_dim
        spans = [("q_proj", q0, self.q_size), ("k_proj", kv0, self.kv_size),
                 ("v_proj", kv0, self.kv_size)]
        row = 0
        for name, start, size in spans:
            self.weight[row:row + size].copy_(src.get(f"{prefix}.{name}.weight", 0, start,
                                                      start + size))
            self.bias[row:row + size].copy_(src.get(f"{prefix}.{name}.bias", 0, start,
                                                    start + size))
            row += size

    def stack_form(self, x: torch.Tensor) -> int | None:
        """`stack_form` of the fused projection of a batch like x."""
        return stack_form(x, self.weight, self.plan, _ordered(self, self.bias))

    def ordered_operands(self) -> Operands | None:
        """The ordered kernel's operands for the fused projection (`OrderedProduct.operands`):
        what the decode stack registers for STACK_ORDERED."""
        return _ordered(self, self.bias).operands(self.plan)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = _ordered_linear(self, x, self.bias)                           # [tokens, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),        # [tokens, heads, hd]
                k.view(-1, self.num_kv_heads, self.head_dim),     # [tokens, kv_heads, hd]
                v.view(-1, self.num_kv_heads, self.head_dim))

    def qk_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q and k heads side by side [tokens, heads + kv_heads, hd], v [tokens, kv_heads, hd]):
        the layout in which one rotary call rotates q and k together."""
        qkv = _ordered_linear(self, x, self.bias)                           # [tokens, q + 2 kv]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        return (qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))
