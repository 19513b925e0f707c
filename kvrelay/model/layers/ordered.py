"""torch's fp32 product of a shallow weight (a small model's LM head and projections),
computed by a native kernel in the summation order torch's GEMM uses — checked, not assumed.

Where `linear` computes `F.linear(x.float(), weight.float(), bias)` (bf16 weights upcast
per matmul under an "fp32" plan, or a float32 model past the dense kernel's rows), a weight
of a 201k vocabulary and 32 input features costs, per step of 8 rows, an upcast of 13 MB
into 26 MB, an sgemm whose work is mostly writing its output, and two conversions of the
logits (to the activation dtype and back to float32): ~7.5 ms of one core on an AVX2 EPYC,
of a c=8 serving step of ~12. `kvrelay_kernels::dense_ordered_linear` (csrc/dense_impl.h)
reads the bf16 weight once, packed by 16 rows k-major, and writes each output once,
already rounded: ~2 ms. A small layer's projection (32 -> 384) costs torch five ops and a
two-thread GEMM region; the kernel one call.

Its summation order is fixed (csrc/dense.h): k in blocks of `kc`, each block one chain of
fused multiply-adds in k order from 0, the blocks added in order after the bias — what a
blocked GEMM microkernel computes, as MKL's sgemm does for the shapes measured (one block
up to K = 128, balanced blocks of at most 192 beyond: `block_size`), for 4 rows or more,
and for some row counts only on one thread (with two it hands a few leftover rows to
another kernel). So the kernel replaces torch's product only where it was seen to give the
same bits: the first call for each (row count, thread count, plan) computes both, compares
the float32 outputs bit for bit, and returns torch's; later calls of a matching key take
the kernel, the others keep torch's. A GEMM's order depends on the shapes and the thread
count, not on the values, so one full-width match is a match of the order. Outputs are
therefore those of the reference path, bit for bit, whichever path runs.

A step whose every row samples greedily with nothing else asked (`StepInput.greedy`) needs
only each row's argmax: `argmax` gives it from the same outputs, folded as the kernel makes
them (`dense_ordered_argmax`: argmax_rows' answers — first maximal index, first NaN — on
the rounded values), so the float32 rows are never written or read again (26 MB per step
at 32 rows of a 201k vocabulary).

A projection (`linear`) gets its output in x's dtype from the kernel itself: a bf16 x goes
in as it is and the outputs come out rounded once, which is `.to(torch.bfloat16)` of the
reference (no conversion ops around the call). The decode stack (gpt_oss.py `DecodeStack`,
which computes a whole step's layers in C++) asks for a key's verdict before it has an input
(`checked`: decided on a seeded random input of the real weight, as the order is the shapes'
and the thread count's), registers the packed operands (`operands`), and is made again once
they are no longer the weight's (`holds`).

The packed copy (the weight's size again, in its own dtype) is made on first use and again
when the weight changes in place, only for K <= MAX_K and weights of at most
MAX_PACKED_BYTES. `layers/linear.py` decides when a product is torch's fp32 one
(`fp32_product`) and asks here; the kernel needs the plan's dense kernels (`plan.dense`:
KVRELAY_DENSE_KERNEL=torch turns it off with them).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvrelay.model.execution_plan import ExecutionPlan

logger = logging.getLogger(__name__)

LANES = 16                      # rows per packed block (csrc/dense.h kOrderedLanes)
MAX_K = 256                     # input features: where the kernel beats the upcast GEMM
MAX_BLOCK = 192                 # the GEMM's largest k block (MKL, the shapes measured)
MAX_PACKED_BYTES = 64 << 20     # the extra copy of the weight this may keep

# What `dense_ordered_linear` takes besides x and N: the packed weight, the packed float32
# bias (or None) and the k block.
Operands = tuple[torch.Tensor, torch.Tensor | None, int]


def block_size(k: int) -> int:
    """The k block of the GEMM the kernel follows: K split into equal blocks of at most
    MAX_BLOCK (K = 256: two of 128; 576: three of 192)."""
    blocks = -(-k // MAX_BLOCK)
    return -(-k // blocks)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → [ceil(N / 16), K, 16]: block b, step k holds W[16 b : 16 b + 16, k] (zeros
    past N)."""
    n, k = weight.shape
    blocks = -(-n // LANES)
    padded = weight.new_zeros(blocks * LANES, k)
    padded[:n] = weight
    return padded.view(blocks, LANES, k).transpose(1, 2).contiguous()


class OrderedProduct:
    """`F.linear(x.float(), weight.float(), bias.float())` for one weight (and bias),
    rounded to x's dtype (`linear`; widened back to float32 by `__call__`), on the ordered
    kernel where checked equal. The caller guarantees that this is what it computes
    otherwise (`linear.fp32_product`). Owner of the packed copy and of the verdicts."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 max_rows: int | None = None) -> None:
        self.weight, self.bias, self.max_rows = weight, bias, max_rows
        self.packed: torch.Tensor | None = None
        self.packed_bias: torch.Tensor | None = None
        self.version = -1                # the weight's and bias's versions when packed
        self.kc = block_size(weight.shape[-1]) if weight.dim() == 2 else 0
        self.usable = (weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float32)
                       and weight.device.type == "cpu" and 0 < weight.shape[1] <= MAX_K
                       and weight.numel() * weight.element_size() <= MAX_PACKED_BYTES)
        # (rows, threads, plan) -> whether the kernel gave the reference's bits
        self.verdicts: dict[tuple[int, int, ExecutionPlan], bool] = {}

    def _versions(self) -> int:
        return self.weight._version + (self.bias._version if self.bias is not None else 0)

    def _ready(self, x: torch.Tensor, plan: ExecutionPlan) -> bool:
        """Whether the kernel may be asked for x at all (packing it first where needed)."""
        if (x.dim() != 2 or (self.max_rows is not None and x.shape[0] > self.max_rows)
                or not self._packs(plan)):
            return False
        self._pack()
        return True

    def _packs(self, plan: ExecutionPlan) -> bool:
        return self.usable and plan.dense is not None and _op() is not None

    def _pack(self) -> None:
        """The packed copy of the weight (and bias) as they are now; the verdicts, which were
        checked on the old values, dropped with the old copy."""
        if self.version == self._versions():
            return
        self.packed = pack(self.weight)
        self.packed_bias = None
        if self.bias is not None:
            self.packed_bias = self.bias.new_zeros(self.packed.shape[0] * LANES,
                                                   dtype=torch.float32)
            self.packed_bias[:self.bias.shape[0]] = self.bias.float()
        self.verdicts.clear()
        self.version = self._versions()

    def __call__(self, x: torch.Tensor, plan: ExecutionPlan) -> torch.Tensor | None:
        """The float32 result (the LM head's logits: rounded to x's dtype and widened back),
        or None where the kernel does not apply or did not reproduce the reference for this
        key (the caller computes it as before)."""
        use = self._use(x, plan)
        if use is None:
            return self._check(x, plan).to(x.dtype).float()
        if not use:
            return None
        return _kernel()(x.float(), self.packed, self.weight.shape[0],
                         x.dtype == torch.bfloat16, self.packed_bias, self.kc)

    def linear(self, x: torch.Tensor, plan: ExecutionPlan) -> torch.Tensor | None:
        """The result in x's dtype (a projection's output), or None as `__call__`. A bf16 x
        goes to the kernel as it is: it widens x and rounds its outputs to bf16 once, which
        is `.to(x.dtype)` of the reference, with no conversion around the call."""
        use = self._use(x, plan)
        if use is None:
            return self._check(x, plan).to(x.dtype)
        if not use:
            return None
        return _kernel()(x, self.packed, self.weight.shape[0], False, self.packed_bias, self.kc)

    def _use(self, x: torch.Tensor, plan: ExecutionPlan) -> bool | None:
        """Whether the kernel computes x's product (packed, and seen to give the reference's
        bits for this key), None for a key not checked yet (this call checks it)."""
        if not self._ready(x, plan):
            return False
        return self.verdicts.get((x.shape[0], torch.get_num_threads(), plan))

    def _check(self, x: torch.Tensor, plan: ExecutionPlan) -> torch.Tensor:
        """torch's float32 product of x, after comparing the kernel's with it bit for bit:
        the verdict for x's key. The first call of each key returns what this returns."""
        key = (x.shape[0], torch.get_num_threads(), plan)
        x32 = x.float()
        bias = None if self.bias is None else self.bias.float()
        reference = F.linear(x32, self.weight.float(), bias)
        raw = _kernel()(x32, self.packed, self.weight.shape[0], False, self.packed_bias, self.kc)
        same = torch.equal(raw.view(torch.int32), reference.view(torch.int32))
        self.verdicts[key] = same
        logger.debug("ordered product %s: %d rows, %d threads: %s", tuple(self.weight.shape),
                     key[0], key[1], "the reference's bits, in use" if same else
                     "other bits than the reference, not used")
        return reference

    def checked(self, rows: int, plan: ExecutionPlan) -> bool:
        """Whether a product of `rows` rows on this many threads (torch.get_num_threads())
        runs on the kernel: its verdict, decided now where there is none yet on seeded
        normal inputs (the order is the shapes' and the thread count's, not the values'; an
        input of the weight's own scale would hide nothing the real one shows). For a
        caller that computes the product elsewhere (the decode stack, `operands`)."""
        x = torch.empty(rows, self.weight.shape[1], dtype=self.weight.dtype)
        if not self._ready(x, plan):
            return False
        key = (rows, torch.get_num_threads(), plan)
        if key not in self.verdicts:
            g = torch.Generator().manual_seed(rows)
            self._check(torch.randn(x.shape, generator=g).to(x.dtype), plan)
        return self.verdicts[key]

    def operands(self, plan: ExecutionPlan) -> Operands | None:
        """(packed weight, packed bias, k block): what `dense_ordered_linear` takes besides x,
        for the weight as it is now; None where the kernel never runs for this weight."""
        if not self._packs(plan):
            return None
        self._pack()
        assert self.packed is not None
        return self.packed, self.packed_bias, self.kc

    def holds(self, packed: torch.Tensor) -> bool:
        """Whether `packed` (from `operands`) is still this product's copy of the weight as
        it is now (no repack since, no change to the weight or bias pending one)."""
        return self.packed is packed and self.version == self._versions()

    def argmax(self, x: torch.Tensor, plan: ExecutionPlan) -> torch.Tensor | None:
        """`argmax_rows(self(x, plan))` (int64 [rows]) without the float32 rows, where this
        key already runs on the kernel (`__call__` checked it); None otherwise."""
        if (self.bias is not None or self.version != self._versions()
                or not self._ready(x, plan)
                or not self.verdicts.get((x.shape[0], torch.get_num_threads(), plan))):
            return None
        op = _op("dense_ordered_argmax")
        if op is None or self.packed is None:
            return None
        return op(x, self.packed, self.weight.shape[0], x.dtype == torch.bfloat16)


def _op(name: str = "dense_ordered_linear") -> torch._ops.OpOverload | None:
    ops = torch.ops.kvrelay_kernels
    return getattr(ops, name).default if hasattr(ops, name) else None


def _kernel() -> torch._ops.OpOverload:
    """`dense_ordered_linear`, for a product already packed (`_ready` saw the op)."""
    op = _op()
    assert op is not None
    return op
