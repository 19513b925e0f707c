"""Per step: the allowed-token masks of the sequences that sample under a grammar.

    engine step:  schedule ─▶ TokenMasks.start(sampling requests) ─▶ forward ─▶ Sampler
                                 └─ worker thread: llguidance fills the bitmasks ─┘ (apply)

Owner of: the bitmask buffer and the worker thread. A step whose sampling requests have
no grammar does nothing here: no buffer, no thread hop, no logits pass.

The bitmask is llguidance's layout, int32 [rows, ceil(V / 32)], bit i of word j allowing
token 32 j + i. llguidance's mask is the costly part (0.3-30 ms inside a JSON string at 201k
tokens), so greedy rows first try their best tokens against the grammar without one. The
rest is read straight from the bitmask words by the native kernel
(`kvrelay_kernels::grammar_rows`, kernels/csrc/bitmask_op.cpp): sparse rows' allowed ids,
greedy rows' masked argmax, and -inf written into dense rows, in one call for all rows.
`_torch_rows` (numpy unpack + one `torch.where` over the rows) is its reference and the path
without the extension.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from kvrelay.structured.backend import GrammarMatcher


class _Params(Protocol):
    @property
    def logits_processors(self) -> Sequence[object]: ...


class Constrained(Protocol):
    """What the masks read of a request (the engine's `Request`): its matcher and whether
    it has logits processors."""

    @property
    def grammar(self) -> GrammarMatcher | None: ...
    @property
    def params(self) -> _Params: ...


_NEG_INF = torch.tensor(float("-inf"))
# A row is sampled among its allowed ids when they lie in at most this many 32-token words
# (≤ 8k candidates); a denser mask (free text inside a JSON string) is applied to the row.
SPARSE_WORDS = 256


def _constrained(requests: Sequence[Constrained]) -> list[tuple[int, GrammarMatcher]]:
    return [(i, r.grammar) for i, r in enumerate(requests)
            if r.grammar is not None and r.grammar.failed is None]


# Fewer constrained rows than this are filled inline in `apply`: on a CPU, where the forward
# already keeps every core busy, the thread hop cost more than it hid at 8 rows (greedy, o200k:
# 12 % of throughput with the hop, 7 % inline) and the two were equal at 64.
OVERLAP_MIN_ROWS = 16

# A plain greedy grammar row checks this many of its best tokens against its grammar before
# it gets a mask (TokenMasks._speculate). Inside a JSON string most tokens are allowed and
# the mask is the costly one (0.3-30 ms at 201k tokens, against microseconds per check);
# between strings few are allowed, no candidate hits, and the mask is cheap (~10-50 µs).
SPECULATE_TOP = 8


class TokenMasks:
    def __init__(self, overlap: bool = True, min_rows: int = OVERLAP_MIN_ROWS) -> None:
        self.overlap = overlap           # fill in a thread during the forward (else in apply)
        self.min_rows = min_rows         # ... when the step has at least this many grammar rows
        self._pool: ThreadPoolExecutor | None = None
        # (the step's request ids, the rows being filled, their bitmask)
        self._pending: tuple[tuple[int, ...], frozenset[int], Future[np.ndarray]] | None = None
        self.native: bool | None = None  # the native row kernel: None = where available
        self.speculate = True            # plain greedy rows: try the unmasked argmax first

    def start(self, requests: Sequence[Constrained],
              plain_greedy: frozenset[int] = frozenset()) -> None:
        """Before the forward: begin filling the masks of `requests` (the step's sampling
        rows, in the sampler's order) that have a grammar. Plain greedy rows are left to
        `apply`, which needs a mask only for those whose unmasked argmax is not allowed."""
        self._pending = None
        rows = [(i, m) for i, m in _constrained(requests)
                if not (self.speculate and i in plain_greedy)]
        if len(rows) < max(self.min_rows, 1) or not self.overlap:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        key = tuple(id(r) for r in requests)
        filling = frozenset(i for i, _ in rows)
        self._pending = (key, filling, self._pool.submit(_fill, rows, len(requests), True))

    def apply(self, logits: torch.Tensor, requests: Sequence[Constrained],
              plain_greedy: frozenset[int] = frozenset(),
              ) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, int]]:
        """logits [N, V] of `requests` → (logits, sparse, chosen). Dense rows come back with
        their disallowed tokens at -inf (in place; the caller owns `logits`). A row whose mask
        allows few tokens (a JSON grammar between strings: tens of ids out of 201k) is left
        unmasked and listed in `sparse` as its sorted allowed ids instead: the sampler picks
        among those alone, which is the same distribution as masking the row and sampling
        it, without an O(V) pass per step (the mask, the softmax and the noise all shrink
        to the allowed set). A row in `plain_greedy` (greedy, nothing applied after the mask)
        gets its token here, in `chosen`: the argmax over its allowed tokens (the first one
        on ties, as torch.argmax of the masked row). Rows without a grammar are untouched.

        Plain greedy rows first ask their matcher whether the unmasked argmax is allowed
        (a lexer step, microseconds): if it is, it is the masked argmax too, and the row
        needs no mask at all — llguidance's mask is the costly part of a grammar step
        (~0.3 ms per row inside a JSON string at 201k tokens). The others get masks: the
        native kernel (`kvrelay_kernels::grammar_rows`) does the rest in one pass over the
        bitmask words; `_torch_rows` is the reference it is tested against and the path
        where the extension is unavailable."""
        pending, self._pending = self._pending, None
        rows = _constrained(requests)
        if not rows:
            return logits, {}, {}
        native = self._use_native(logits)
        picked = self._speculate(logits, rows, plain_greedy, native) if self.speculate else {}
        rows = [(i, m) for i, m in rows if i not in picked]
        if not rows:
            return logits, {}, picked
        if pending is not None and pending[0] == tuple(id(r) for r in requests):
            bitmask = pending[2].result()
            missing = [(i, m) for i, m in rows if i not in pending[1]]
        else:
            bitmask, missing = None, rows
        if missing:
            bitmask = _fill(missing, len(requests), len(missing) >= self.min_rows, bitmask)
        assert bitmask is not None
        modes = [_mode(i, requests[i], plain_greedy) for i, _ in rows]
        index = [i for i, _ in rows]
        if native:
            sparse, chosen, empty = _native_rows(logits, bitmask, index, modes)
        else:
            sparse, chosen, empty = _torch_rows(logits, bitmask, index, modes)
        for i in empty:       # a matcher with no way forward: the request ends with an error
            matcher = requests[i].grammar
            if matcher is not None:
                matcher.fail("the grammar allows no token here")
        chosen.update(picked)
        return logits, sparse, chosen

    @staticmethod
    def _speculate(logits: torch.Tensor, rows: list[tuple[int, GrammarMatcher]],
                   plain_greedy: frozenset[int], native: bool) -> dict[int, int]:
        """{row: token} for the plain greedy rows whose masked argmax is found without a
        mask: walking the row's best logits in argmax order (value, then lower id), the
        first one the grammar allows is the masked argmax. With the native kernel the walk
        covers the SPECULATE_TOP best (a candidate tied with the last one is not trusted:
        an equal logit outside the list could come first); without it, the argmax alone."""
        greedy = [(i, m) for i, m in rows if i in plain_greedy]
        if not greedy:
            return {}
        index = [i for i, _ in greedy]
        vocab = logits.shape[-1]
        if native:
            k = min(SPECULATE_TOP, vocab)
            values, ids = torch.ops.kvrelay_kernels.topk_rows(logits, torch.tensor(index), k, "")
            picked: dict[int, int] = {}
            for (i, m), vs, ts in zip(greedy, values.tolist(), ids.tolist()):
                for v, t in zip(vs, ts):
                    if k < vocab and v == vs[-1]:
                        break
                    if m.allows(t):
                        picked[i] = t
                        break
            return picked
        if len(index) == logits.shape[0]:
            best = logits.argmax(dim=-1).tolist()
        else:
            best = logits[index].argmax(dim=-1).tolist()
        return {i: t for (i, m), t in zip(greedy, best) if m.allows(t)}

    def _use_native(self, logits: torch.Tensor) -> bool:
        if self.native is False or logits.dtype != torch.float32 or not logits.is_contiguous():
            return False
        # builds/loads once; warns once when unavailable
        from kvrelay.model import kernels

        return kernels.kernels_available()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# What a grammar row needs (see TokenMasks.apply and the native op's modes)
SAMPLED, PLAIN_GREEDY, MASK_ONLY = 0, 1, 2


def _mode(i: int, request: Constrained, plain_greedy: frozenset[int]) -> int:
    if i in plain_greedy:
        return PLAIN_GREEDY
    return MASK_ONLY if request.params.logits_processors else SAMPLED


def _native_rows(logits: torch.Tensor, bitmask: np.ndarray, index: list[int], modes: list[int],
                 ) -> tuple[dict[int, torch.Tensor], dict[int, int], list[int]]:
    """(sparse, chosen, empty rows) from one call of the native kernel; dense rows masked."""
    tokens, offsets, ids = torch.ops.kvrelay_kernels.grammar_rows(
        logits, torch.from_numpy(bitmask), torch.tensor(index), torch.tensor(modes),
        SPARSE_WORDS, "")
    sparse: dict[int, torch.Tensor] = {}
    chosen: dict[int, int] = {}
    empty: list[int] = []
    off = offsets.tolist()
    for j, (i, t) in enumerate(zip(index, tokens.tolist())):
        if t >= 0:
            chosen[i] = t
        elif t == -1:
            sparse[i] = ids[off[j]:off[j + 1]]
        elif t == -3:
            empty.append(i)
    return sparse, chosen, empty


def _torch_rows(logits: torch.Tensor, bitmask: np.ndarray, index: list[int], modes: list[int],
                ) -> tuple[dict[int, torch.Tensor], dict[int, int], list[int]]:
    """The reference of `_native_rows` (numpy and PyTorch): the same results."""
    vocab = logits.shape[-1]
    sparse: dict[int, torch.Tensor] = {}
    chosen: dict[int, int] = {}
    empty: list[int] = []
    dense: list[int] = []
    for i, mode in zip(index, modes):
        words = np.flatnonzero(bitmask[i])
        if words.size == 0:
            empty.append(i)
        elif mode != MASK_ONLY and words.size <= SPARSE_WORDS:
            ids = torch.from_numpy(_allowed_ids(bitmask[i], words, vocab))
            if mode == PLAIN_GREEDY:
                chosen[i] = int(ids[logits[i, ids].argmax()])
            else:
                sparse[i] = ids
        elif mode == PLAIN_GREEDY and _allowed(bitmask[i], best := int(logits[i].argmax())):
            chosen[i] = best            # the unmasked argmax is allowed: the masked one too
        else:
            dense.append(i)
    if dense:
        _mask_rows(logits, bitmask, dense, len(bitmask))
        greedy = [i for i in dense if modes[index.index(i)] == PLAIN_GREEDY]
        if greedy:
            chosen.update(zip(greedy, logits[greedy].argmax(dim=-1).tolist()))
    return sparse, chosen, empty


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _allowed_ids(row: np.ndarray, words: np.ndarray, vocab: int) -> np.ndarray:
    """The token ids whose bits are set in `row` (int32 words), given its nonzero `words`."""
    bits = np.unpackbits(row[words].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    ids = (words[:, None] * 32 + np.arange(32))[bits.astype(bool)]
    return ids[ids < vocab].astype(np.int64)


def _mask_rows(logits: torch.Tensor, bitmask: np.ndarray, idx: list[int], batch: int) -> None:
    """Set the disallowed tokens of rows `idx` of `logits` to -inf, in place."""
    vocab = logits.shape[-1]
    neg_inf = _NEG_INF.to(logits.dtype)
    if len(idx) == batch:       # every row: one op over the whole tensor
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        torch.where(torch.from_numpy(bits).view(torch.bool), logits, neg_inf, out=logits)
        return
    # a few ops for the subset, not one per row (each small op wakes the thread pool)
    bits = np.unpackbits(bitmask[idx].view(np.uint8), axis=1, count=vocab, bitorder="little")
    rows_t = torch.tensor(idx)
    keep = torch.from_numpy(bits).view(torch.bool)                        # [k, V]
    logits.index_copy_(0, rows_t, torch.where(keep, logits.index_select(0, rows_t), neg_inf))


def _fill(rows: list[tuple[int, GrammarMatcher]], batch: int, parallel: bool,
          bitmask: np.ndarray | None = None) -> np.ndarray:
    """int32 [batch, words] (`bitmask`, or zeros); only the rows of `rows` are written;
    `parallel`: over llguidance's executor threads, else on this thread."""
    backend = rows[0][1].backend
    words = (backend.vocab_size + 31) // 32
    if bitmask is None:
        bitmask = np.zeros((batch, words), dtype=np.int32)
    backend.fill([(m, i) for i, m in rows], bitmask.ctypes.data, batch, parallel)
    return bitmask
