"""The screened greedy LM head: the exact path's greedy tokens from an int8 copy of the head,
reading about half its bytes.

A greedy decode step needs each row's argmax over the vocabulary, not its logits, and all
but a handful of vocabulary rows are far from winning. The screen
(`kvrelay_kernels::screen_argmax`, csrc/screen.h) reads the int8 copy (codes, one bf16
scale per row) and bounds every logit the exact path would compute: |L - A| <= G, where A is
the copy's integer dot product with the input's int16 codes, scaled, and G covers the
weight's and the input's quantisation residuals (‖w‖‖f‖ + ‖e‖(‖x‖ + ‖f‖), from per-row norms
kept beside the codes) and the fp32 rounding of both computations. Rows whose upper end
cannot reach the best lower end cannot win (nor tie); the others, the candidates, are
computed exactly — by the very kernel code the exact path runs, on copies of their rows
laid out so that code computes them as it does in place, so with the same bits — and the
first maximum among them, in index order, is the token: the exact path's argmax_rows answer.

    exact path here                      mode      candidates computed by
    dense_linear (few rows, dense ISA)   DENSE     dense_linear's kernel, on their aligned
                                                   groups of 4 rows side by side
    torch's fp32 GEMM (fp32_product)     ORDERED   the ordered product, 16 rows as the
                                                   lanes of a block (k blocks of
                                                   ordered.block_size(K))

Checked, not assumed: the first call of each (rows, threads, plan, mode, dtype) computes the
exact path's logits and the candidates' computation for every vocabulary row, and uses
the screen for that key only where the bits agree (for torch's GEMM that is the bet
layers/ordered.py makes and checks the same way). An input that is not finite, logits that
could overflow, or more candidates than `max_candidates` answer None: the caller takes the
exact path. The copy (seconds at gpt-oss-20b's head) and the checks its decode steps'
keys need are made in the engine's warm-up (`ModelRunner.warm_greedy_head`, through the
head's own `greedy`; `warmed_ahead` says which), not in the first requests' steps; any other
key is checked on its first call.

Memory: the codes are the head's K bytes per row, plus 6 bytes (scale, ‖w‖, ‖e‖); made on
first use (the warm-up's) and again when the weight changes in place. The plan decides where
it runs (`ExecutionPlan.screened_head`: KVRELAY_SCREENED_HEAD=off turns it off);
`ScreenStats` counts what it saw.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.layers.linear import fp32_product, runs_on_dense_kernel
from kvrelay.model.layers.ordered import OrderedProduct, block_size

logger = logging.getLogger(__name__)

LANES = 16                 # vocab rows per block of the copy (csrc/screen.h kScreenLanes)
MAX_ROWS = 16              # input rows per call (kScreenMaxRows)
DENSE, ORDERED = 0, 1      # how the candidates are computed (the exact path's kernel)


def max_candidates(vocab: int) -> int:
    """Candidates per row past which the exact path is taken instead: 1/256 of the
    vocabulary (785 of 201,088), at least 64."""
    return max(64, vocab // 256)


@dataclass(frozen=True)
class Int8Copy:
    """The screen's copy of a [N, K] head: codes [ceil(N/16), ceil(K/2), 16, 2] int8
    (16 rows k-pair-major per block, zeros past N and K) and facts [blocks, 3, 16] bf16
    (per row: the scale s, ‖w‖ and ‖w - s·q‖, the norms rounded up); w_max = max ‖w‖."""

    codes: torch.Tensor
    facts: torch.Tensor
    w_max: float

    def nbytes(self) -> int:
        return self.codes.numel() + self.facts.numel() * 2


def quantize(weight: torch.Tensor) -> Int8Copy | None:
    """The copy of `weight` [N, K] (bf16 or float32, contiguous); None where a weight is not
    finite. Per row (`kvrelay_kernels::screen_quantize`): s = max|w| / 127 rounded up to
    bf16, q = round(w / s) in [-127, 127], and the norms of w and of w - s q computed in
    float64 (the residual is exact there), rounded up."""
    op = _op("screen_quantize")
    assert op is not None
    codes, facts, w_max = op(weight.contiguous())
    return None if w_max < 0 else Int8Copy(codes, facts, w_max)


def exact_mode(x: torch.Tensor, weight: torch.Tensor, plan: ExecutionPlan) -> int | None:
    """How the exact path computes `linear(x, weight)` here, as the screen reproduces it;
    None where it cannot (torch's half GEMM, too many rows)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return None
    if runs_on_dense_kernel(x, weight, plan):
        return DENSE
    if fp32_product(x, weight, plan):
        return ORDERED
    return None


def warmed_ahead(x: torch.Tensor, weight: torch.Tensor, plan: ExecutionPlan) -> bool:
    """Whether the engine's warm-up checks x's key ahead (`ModelRunner.warm_greedy_head`):
    where the exact path is a native kernel (the dense kernel, or the ordered product of a
    shallow weight) a check is two passes over the head. Where it is torch's fp32 GEMM of a
    wide weight, upcast per call, a check costs that GEMM for every row count (the embedded
    model's 49,152 x 576 bf16 head past 4 rows: ~0.25 s of CPU each on a loaded 2-core AVX2
    EPYC, 12 row counts): those keys are checked on first use, which adds a native pass to a
    step that computes that GEMM anyway."""
    mode = exact_mode(x, weight, plan)
    return mode == DENSE or (mode == ORDERED and OrderedProduct(weight).usable)


STATS_RECENT = 4096        # input rows whose candidate counts ScreenStats keeps


@dataclass
class ScreenStats:
    """What the screen saw: calls it answered, calls the exact path took, and the
    candidates (rows computed exactly) per input row of the answered calls: the most
    seen, and the last STATS_RECENT counts (bounded: a server runs for days)."""

    answered: int = 0
    fallbacks: int = 0
    most: int = 0
    candidates: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_RECENT))

    def add(self, counts: torch.Tensor, answered: bool) -> None:
        if answered:
            self.answered += 1
            seen = counts.tolist()
            self.candidates.extend(seen)
            self.most = max(self.most, *seen)
        else:
            self.fallbacks += 1


class ScreenedHead:
    """Owner of one LM head weight's int8 copy and of the per-key checks that its candidates'
    computation gives the exact path's bits (see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.copy: Int8Copy | None = None
        self.version = -1                     # the weight's version when copied
        self.usable = (weight.dim() == 2 and weight.device.type == "cpu"
                       and weight.dtype in (torch.bfloat16, torch.float32)
                       and weight.shape[0] >= 1 and _op("screen_quantize") is not None)
        # (rows, threads, plan, mode, x dtype) -> whether the candidates get the exact bits
        self.verdicts: dict[tuple[int, int, ExecutionPlan, int, torch.dtype], bool] = {}
        self.checks = 0                       # keys checked (`_check` calls), for tests and logs
        self.stats = ScreenStats()

    def _current_copy(self) -> Int8Copy | None:
        if self.version != self.weight._version:        # first use, or changed in place
            self.copy = quantize(self.weight.detach())
            self.version = self.weight._version
            self.verdicts.clear()
            if self.copy is not None:
                logger.debug("screened LM head: int8 copy of %s, %.1f MB",
                             tuple(self.weight.shape), self.copy.nbytes() / 1e6)
        return self.copy

    def argmax(self, x: torch.Tensor, mode: int, plan: ExecutionPlan,
               exact_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """int64 [rows]: argmax_rows of the exact path's logits, or None (the caller takes the
        exact path). `exact_logits(x)`: those logits (float32), asked once per key."""
        if not self.usable:
            return None
        copy = self._current_copy()
        if copy is None:
            return None
        key = (x.shape[0], torch.get_num_threads(), plan, mode, x.dtype)
        verdict = self.verdicts.get(key)
        if verdict is None:
            if not bool(torch.isfinite(x).all()):      # no verdict from NaN's bits
                return None
            return self._check(key, x, mode, copy, exact_logits(x))
        if not verdict:
            return None
        tokens, counts = self._screen(x, mode, copy)
        answered = bool((tokens >= 0).all())
        self.stats.add(counts, answered)
        return tokens if answered else None

    def _screen(self, x: torch.Tensor, mode: int,
                copy: Int8Copy) -> tuple[torch.Tensor, torch.Tensor]:
        op = _op("screen_argmax")
        assert op is not None
        n = self.weight.shape[0]
        return op(x, copy.codes, copy.facts, n, copy.w_max, self.weight, mode,
                  block_size(self.weight.shape[1]), max_candidates(n), "", "")

    def _check(self, key: tuple[int, int, ExecutionPlan, int, torch.dtype], x: torch.Tensor,
               mode: int, copy: Int8Copy, reference: torch.Tensor) -> torch.Tensor:
        """The first call of a key: the exact path's answer, and the verdict on the screen."""
        op = _op("screen_exact_rows")
        assert op is not None
        self.checks += 1
        want = reference.argmax(dim=-1)          # argmax_rows' answer (first max, NaN)
        if not bool(torch.isfinite(reference).all()):   # overflowed: ask again another time
            return want
        mine = op(x, self.weight, mode, block_size(self.weight.shape[1]), "")
        same = torch.equal(mine.view(torch.int32), reference.view(torch.int32))
        if same:
            tokens, _ = self._screen(x, mode, copy)
            answered = tokens >= 0
            if not torch.equal(tokens[answered], want[answered]):    # a broken bound: never
                logger.error("screened LM head: tokens %s where the exact path gives %s; "
                             "the screen is off for %s", tokens.tolist(), want.tolist(), key[:2])
                same = False
        self.verdicts[key] = same
        logger.debug("screened LM head %s, %d rows, %d threads, %s: %s",
                     tuple(self.weight.shape), key[0], key[1], "dense" if mode == DENSE
                     else "ordered", "the exact path's bits, in use" if same
                     else "other bits than the exact path, not used")
        return want


def _op(name: str) -> torch._ops.OpOverload | None:
    ops = torch.ops.kvrelay_kernels
    return getattr(ops, name).default if hasattr(ops, name) else None
