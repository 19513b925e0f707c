"""Per step: the allowed-token masks of the sequences that sample under a grammar.

    engine step:  schedule ─▶ TokenMasks.start(sampling requests) ─▶ forward ─▶ Sampler
                                 └─ worker thread: llguidance fills the bitmasks ─┘ (apply)

Owner of: the bitmask buffer and the worker thread. A step whose sampling requests have
no grammar does nothing here: no buffer, no thread hop, no logits pass.

The bitmask is llguidance's layout, int32 [rows, ceil(V / 32)], bit i of word j allowing
token 32 j + i. numpy unpacks it to one byte per token, and `torch.where(keep, row, -inf)`
writes the row in place: ~0.1 ms for 201k tokens on one core, half of adding a 0/-inf bias
table and far below masked_fill or a scatter of the kept ids (measured in this file's commit).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvrelay.engine.request import Request
    from kvrelay.structured.backend import GrammarMatcher

logger = logging.getLogger(__name__)

_NEG_INF = torch.tensor(float("-inf"))
# A row is sampled among its allowed ids when they lie in at most this many 32-token words
# (≤ 8k candidates); a denser mask (free text inside a JSON string) is applied to the row.
SPARSE_WORDS = 256


def _constrained(requests: list[Request]) -> list[tuple[int, GrammarMatcher]]:
    return [(i, r.grammar) for i, r in enumerate(requests)
            if r.grammar is not None and r.grammar.failed is None]


# Fewer constrained rows than this are filled inline in `apply`: on a CPU, where the forward
# already keeps every core busy, the thread hop cost more than it hid at 8 rows (greedy, o200k:
# 12 % of throughput with the hop, 7 % inline) and the two were equal at 64.
OVERLAP_MIN_ROWS = 16


class TokenMasks:
    def __init__(self, overlap: bool = True, min_rows: int = OVERLAP_MIN_ROWS) -> None:
        self.overlap = overlap           # fill in a thread during the forward (else in apply)
        self.min_rows = min_rows         # ... when the step has at least this many grammar rows
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[int, ...], Future[np.ndarray]] | None = None

    def start(self, requests: list[Request]) -> None:
        """Before the forward: begin filling the masks of `requests` (the step's sampling
        rows, in the sampler's order) that have a grammar."""
        self._pending = None
        rows = _constrained(requests)
        if len(rows) < max(self.min_rows, 1) or not self.overlap:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        key = tuple(id(r) for r in requests)
        self._pending = (key, self._pool.submit(_fill, rows, len(requests)))

    def apply(self, logits: torch.Tensor, requests: list[Request],
              plain_greedy: frozenset[int] = frozenset(),
              ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """logits [N, V] of `requests` → (logits, sparse). Dense rows come back with their
        disallowed tokens at -inf (in place; the caller owns `logits`). A row whose mask
        allows few tokens (a JSON grammar between strings: tens of ids out of 201k) is left
        unmasked and listed in `sparse` as its sorted allowed ids instead: the sampler picks
        among those alone, which is the same distribution as masking the row and sampling
        it, without an O(V) pass per step (the mask, the softmax and the noise all shrink
        to the allowed set). A dense row in `plain_greedy` (greedy, nothing applied after
        the mask) whose unmasked argmax is allowed is listed with that one id: the masked
        argmax is the same token. Rows without a grammar are untouched."""
        pending, self._pending = self._pending, None
        rows = _constrained(requests)
        if not rows:
            return logits, {}
        if pending is not None and pending[0] == tuple(id(r) for r in requests):
            bitmask = pending[1].result()
        else:
            bitmask = _fill(rows, len(requests))
        vocab = logits.shape[-1]
        sparse: dict[int, torch.Tensor] = {}
        dense: list[int] = []
        for i, _ in rows:
            words = np.flatnonzero(bitmask[i])
            if words.size == 0:       # a matcher with no way forward: leave the row free
                logger.error("structured output: no allowed token for %s", requests[i].request_id)
            elif words.size <= SPARSE_WORDS and not requests[i].params.logits_processors:
                sparse[i] = torch.from_numpy(_allowed_ids(bitmask[i], words, vocab))
            elif i in plain_greedy and _allowed(bitmask[i], best := int(logits[i].argmax())):
                sparse[i] = torch.tensor([best])
            else:
                dense.append(i)
        if dense:
            _mask_rows(logits, bitmask, dense, len(requests))
        return logits, sparse

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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


def _fill(rows: list[tuple[int, GrammarMatcher]], batch: int) -> np.ndarray:
    """int32 [batch, words]; only the rows of `rows` are written (the rest stay zero)."""
    backend = rows[0][1].backend
    words = (backend.vocab_size + 31) // 32
    bitmask = np.zeros((batch, words), dtype=np.int32)
    backend.fill([(m, i) for i, m in rows], bitmask.ctypes.data, batch)
    return bitmask
